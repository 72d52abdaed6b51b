//! Opening a CUDA device: checks that turn every missing piece (driver, libraries, device,
//! compute capability) into one [`CudaError`] sentence instead of cudarc's panics, then the
//! context, stream, cuBLAS handle and the NVRTC-compiled kernels.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, sys};

use super::modules::{self, ComputeCapability, SOURCES};
use crate::{CudaError, MIN_COMPUTE_CAPABILITY};

/// A device ready to run: its context, the one stream every op is ordered on, cuBLAS and the
/// loaded kernels.
pub struct Device {
    pub ordinal: usize,
    pub name: String,
    pub cc: ComputeCapability,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub kernels: Kernels,
    pub num_sms: u32,
    /// Dynamic shared memory the norm-fused GEMV kernels may ask for (they opted in).
    pub norm_shared_bytes: usize,
}

/// Every kernel function, looked up once.
pub struct Kernels {
    pub embedding: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rope: CudaFunction,
    pub qk_norm_rope: CudaFunction,
    pub silu_mul: CudaFunction,
    pub rms_norm_16: CudaFunction,
    pub silu_mul_16: CudaFunction,
    pub add_assign: CudaFunction,
    pub add_rows_scaled: CudaFunction,
    pub select_rows: CudaFunction,
    pub cast_bf16: CudaFunction,
    pub cast_f16: CudaFunction,
    pub write_kv: CudaFunction,
    pub pack_blocks: CudaFunction,
    pub unpack_blocks: CudaFunction,
    pub paged_attention: CudaFunction,
    pub attention_mma: CudaFunction,
    pub reshape_copy: CudaFunction,
    pub reshape_edit: CudaFunction,
    pub sample_rows: CudaFunction,
    pub sample_dense: CudaFunction,
    pub prompt_logprobs: CudaFunction,
    pub gemv16: CudaFunction,
    pub gemv16_norm: CudaFunction,
    pub gemv16_norm_silu: CudaFunction,
    pub moe_route: CudaFunction,
    pub moe_topk: CudaFunction,
    pub moe_align: CudaFunction,
    pub moe_gather: CudaFunction,
    pub moe_silu: CudaFunction,
    pub moe_combine: CudaFunction,
    pub moe_gate_up: CudaFunction,
    pub moe_down: CudaFunction,
}

fn driver(ordinal: usize, what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        ordinal,
        what,
        message: e.to_string(),
    }
}

impl Device {
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        // SAFETY: these only try to dlopen each library's candidate names.
        let (has_driver, has_blas) = unsafe {
            (
                sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        if !has_driver {
            return Err(CudaError::NoDriver { ordinal });
        }
        if !modules::nvrtc_present() {
            return Err(CudaError::NoLibrary {
                ordinal,
                library: "libnvrtc",
            });
        }
        if !has_blas {
            return Err(CudaError::NoLibrary {
                ordinal,
                library: "libcublas",
            });
        }
        let count = CudaContext::device_count().map_err(driver(ordinal, "counting devices"))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver(ordinal, "creating a context"))?;
        let name = ctx.name().map_err(driver(ordinal, "reading the name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver(ordinal, "reading the compute capability"))?;
        let cc = ComputeCapability {
            major: major as u32,
            minor: minor as u32,
        };
        if (cc.major, cc.minor) < MIN_COMPUTE_CAPABILITY {
            return Err(CudaError::TooOld {
                ordinal,
                name,
                major: cc.major,
                minor: cc.minor,
            });
        }
        // One stream orders every op, so cudarc's per-buffer event tracking (for multi-stream
        // use) is pure overhead on each launch.
        // SAFETY: called before any buffer of this context exists.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx, ordinal)?;
        let num_sms =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(driver(ordinal, "reading the multiprocessor count"))? as u32;
        // A stream of our own rather than the legacy default stream, which cannot be
        // captured into a CUDA graph (`--cuda-graphs`).
        let stream = ctx
            .new_stream()
            .map_err(driver(ordinal, "creating a stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Driver {
            ordinal,
            what: "creating the cuBLAS handle",
            message: e.to_string(),
        })?;
        let kernels = Kernels::load(&ctx, cc, ordinal)?;
        let norm_shared_bytes = super::gemv::opt_in_norm_shared(
            &ctx,
            [&kernels.gemv16_norm, &kernels.gemv16_norm_silu],
        );
        Ok(Self {
            ordinal,
            name,
            cc,
            ctx,
            stream,
            blas,
            kernels,
            num_sms,
            norm_shared_bytes,
        })
    }
}

/// Activations come from the device's stream-ordered memory pool. Its default release
/// threshold (0) hands freed memory back to the driver at every synchronisation, i.e. once
/// per engine step; keep it instead so steady-state steps allocate nothing from the driver.
fn keep_pool_memory(ctx: &CudaContext, ordinal: usize) -> Result<(), CudaError> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut threshold = u64::MAX;
    // SAFETY: the device handle comes from a live context; the attribute takes a u64.
    unsafe {
        let pool = cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device())
            .map_err(driver(ordinal, "getting the memory pool"))?;
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(driver(
            ordinal,
            "setting the memory pool's release threshold",
        ))?;
    }
    Ok(())
}

impl Kernels {
    fn load(
        ctx: &Arc<CudaContext>,
        cc: ComputeCapability,
        ordinal: usize,
    ) -> Result<Self, CudaError> {
        let mut functions = std::collections::HashMap::new();
        for source in &SOURCES {
            let ptx = modules::compile(source, cc)?;
            let module = ctx
                .load_module(ptx)
                .map_err(driver(ordinal, "loading a kernel module"))?;
            for &name in source.kernels {
                let f = module
                    .load_function(name)
                    .map_err(driver(ordinal, "looking up a kernel"))?;
                functions.insert(name, f);
            }
        }
        let mut take = |name: &str| {
            functions.remove(name).ok_or_else(|| CudaError::Driver {
                ordinal,
                what: "looking up a kernel",
                message: format!("{name} is in no kernel source"),
            })
        };
        Ok(Self {
            embedding: take("embedding")?,
            rms_norm: take("rms_norm")?,
            rope: take("rope")?,
            qk_norm_rope: take("qk_norm_rope")?,
            silu_mul: take("silu_mul")?,
            rms_norm_16: take("rms_norm_16")?,
            silu_mul_16: take("silu_mul_16")?,
            add_assign: take("add_assign")?,
            add_rows_scaled: take("add_rows_scaled")?,
            select_rows: take("select_rows")?,
            cast_bf16: take("cast_bf16")?,
            cast_f16: take("cast_f16")?,
            write_kv: take("write_kv")?,
            pack_blocks: take("pack_blocks")?,
            unpack_blocks: take("unpack_blocks")?,
            paged_attention: take("paged_attention")?,
            attention_mma: take("attention_mma")?,
            reshape_copy: take("reshape_copy")?,
            reshape_edit: take("reshape_edit")?,
            sample_rows: take("sample_rows")?,
            sample_dense: take("sample_dense")?,
            prompt_logprobs: take("prompt_logprobs")?,
            gemv16: take("gemv16")?,
            gemv16_norm: take("gemv16_norm")?,
            gemv16_norm_silu: take("gemv16_norm_silu")?,
            moe_route: take("moe_route")?,
            moe_topk: take("moe_topk")?,
            moe_align: take("moe_align")?,
            moe_gather: take("moe_gather")?,
            moe_silu: take("moe_silu")?,
            moe_combine: take("moe_combine")?,
            moe_gate_up: take("moe_gate_up")?,
            moe_down: take("moe_down")?,
        })
    }
}
