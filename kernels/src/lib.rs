//! pd-kernels: the CUDA implementation of `pd_engine::backend::Backend`.
//!
//! With the `cuda` feature, [`CudaBackend`] runs Qwen3 on an NVIDIA GPU: cudarc with the CUDA
//! libraries (driver, cuBLAS, NVRTC) loaded at run time, so building needs no CUDA install;
//! cuBLAS bf16 / f16 GEMMs with f32 accumulation for the linear layers; CUDA C++ kernels
//! (`src/cuda/*.cu`) compiled with NVRTC at start-up for the device's compute capability.
//!
//! Without the feature, [`CudaBackend`] is a type with no values whose [`CudaBackend::open`]
//! returns [`CudaError::NotBuilt`]: callers select a device without any `cfg` of their own,
//! and asking for CUDA in a CPU-only build fails at start with one clear sentence.

mod error;

pub use error::CudaError;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(not(feature = "cuda"))]
pub use absent::CudaBackend;

/// Oldest compute capability the backend runs on (Ampere: bf16 tensor cores).
pub const MIN_COMPUTE_CAPABILITY: (u32, u32) = (8, 0);

/// Whether this build has the CUDA backend (spelled as `pd_transport::rdma::BUILT`, with
/// the stand-in of a build without it in `absent.rs`, as there).
pub const BUILT: bool = cfg!(feature = "cuda");
