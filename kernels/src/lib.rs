//! pd-kernels: the CUDA implementation of `pd_engine::backend::Backend`.
//!
//! Skeleton: cudarc with dynamically loaded CUDA libraries, cuBLAS GEMMs and NVRTC-compiled
//! kernels arrive with the CUDA issue. Until then no CUDA device can be selected anywhere:
//! the CPU backend in `pd-engine` is the only backend.
