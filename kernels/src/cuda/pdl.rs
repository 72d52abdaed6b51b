//! Programmatic dependent launch (Hopper and later, `PD_CUDA_PDL=on`): the GEMV kernels
//! launched so may start while the kernel before them in the stream is still finishing,
//! stream their first weights meanwhile and wait for its results in the kernel
//! (`griddepcontrol.wait`, gemv.cu). At batch 1 a decode step is a chain of ~170 short
//! kernels, so the gap between one kernel's end and the next one's start is a large share of
//! the step; this hides part of it, in CUDA graphs too (captured as programmatic edges).
//! Off by default until a GPU run has measured it (docs/cuda.md). Owns the setting and the
//! raw launch; which kernels use it is their launchers' business: the GEMV kernels
//! ([`super::gemv`]), the q/k norm + RoPE kernel and the decode attention kernel, i.e.
//! every kernel of a decode layer.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, LaunchConfig};

use super::CudaBackend;
use crate::CudaError;

/// `PD_CUDA_PDL` as set in the environment: `on`, `off` (the default when unset).
pub fn from_env() -> Result<bool, CudaError> {
    match std::env::var("PD_CUDA_PDL") {
        Err(_) => Ok(false),
        Ok(v) if v == "off" => Ok(false),
        Ok(v) if v == "on" => Ok(true),
        Ok(v) => Err(CudaError::BadPdlSetting(v)),
    }
}

impl CudaBackend {
    /// Launch `func` with `args` (pointers to each argument's value, in the kernel's order),
    /// programmatically dependent on the previous kernel in the stream when PDL is on and
    /// the device has it (compute capability 9.0 and later); else an ordinary launch.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and the buffers
    /// they name must cover what the grid reads and writes; the kernel must wait
    /// (`griddepcontrol.wait`) before it reads anything an earlier kernel writes or writes
    /// anything at all.
    pub(super) unsafe fn launch_dependent(
        &self,
        name: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
    ) {
        let programmatic = self.programmatic_launch() && self.dev.cc.major >= 9;
        // SAFETY: the caller's contract.
        unsafe { self.launch_ex(name, func, cfg, args, programmatic) }
    }

    /// An ordinary launch of `func` with `args` given as [`Self::launch_dependent`] takes
    /// them, for a kernel that shares its parameter list with one launched so.
    ///
    /// # Safety
    /// As [`Self::launch_dependent`], except that the kernel need not wait.
    pub(super) unsafe fn launch_plain(
        &self,
        name: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
    ) {
        // SAFETY: the caller's contract.
        unsafe { self.launch_ex(name, func, cfg, args, false) }
    }

    unsafe fn launch_ex(
        &self,
        name: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
        programmatic: bool,
    ) {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.dev.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(programmatic),
        };
        if let Err(e) = self.dev.stream.context().bind_to_thread() {
            self.fail(name, e);
        }
        self.count_launch(programmatic);
        // SAFETY: the caller's contract; `config` and `attr` outlive the call, and the
        // driver copies the argument values before it returns.
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if let Err(e) = r.result() {
            self.fail(name, e);
        }
    }
}

/// A kernel argument as the driver takes it: the address of its value.
pub(super) fn arg<T>(value: &T) -> *mut c_void {
    value as *const T as *mut c_void
}
