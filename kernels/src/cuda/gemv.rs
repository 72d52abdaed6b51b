//! The `gemv16` kernel (`gemv.cu`) in place of the cuBLAS GEMM for decode-sized batches:
//! which products it may take, and its launch. Chosen with `PD_CUDA_GEMV=kernel`; cuBLAS
//! (`PD_CUDA_GEMV=cublas`) stays the default until a GPU run has measured which streams the
//! weights faster (docs/cuda.md). Does not cover prefill-sized products (cuBLAS's tensor-core
//! GEMMs) or f32 weights.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::CudaBackend;
use super::gemm::GemmType;
use crate::CudaError;

/// Most rows one launch multiplies (`GEMV_MAX_ROWS` in gemv.cu).
pub const GEMV_MAX_ROWS: usize = 8;

/// Warps per thread block, one output column each (`GEMV_WARPS` in gemv.cu).
const GEMV_WARPS: usize = 8;

/// What multiplies 16-bit weights with a batch of at most [`GEMV_MAX_ROWS`] rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmallBatchLinear {
    /// cuBLAS, as every other product (`PD_CUDA_GEMV=cublas`, the default).
    #[default]
    Cublas,
    /// The `gemv16` weight-stream kernel (`PD_CUDA_GEMV=kernel`).
    Kernel,
}

impl SmallBatchLinear {
    /// `PD_CUDA_GEMV` as set in the environment (unset: the default).
    pub fn from_env() -> Result<Self, CudaError> {
        match std::env::var("PD_CUDA_GEMV") {
            Err(_) => Ok(Self::default()),
            Ok(v) if v == "cublas" => Ok(Self::Cublas),
            Ok(v) if v == "kernel" => Ok(Self::Kernel),
            Ok(v) => Err(CudaError::BadGemvSetting(v)),
        }
    }
}

/// Whether `gemv16` can take this product: few rows, 16-bit operands, whole 16-byte loads.
pub(super) fn eligible(ty: GemmType, rows: usize, k: usize, x: u64, w: u64) -> bool {
    matches!(ty, GemmType::BF16 | GemmType::F16)
        && (1..=GEMV_MAX_ROWS).contains(&rows)
        && k.is_multiple_of(8)
        && i32::try_from(k).is_ok()
        && x.is_multiple_of(16)
        && w.is_multiple_of(16)
}

impl CudaBackend {
    /// `out [rows, n] (+)= x [rows, k] · w [n, k]ᵀ` by `gemv16`; the caller checked
    /// [`eligible`]. Addresses as [`super::gemm::linear`] takes them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv16(
        &self,
        ty: GemmType,
        x: u64,
        rows: usize,
        w: u64,
        n: usize,
        k: usize,
        out: u64,
        accumulate: bool,
    ) {
        let dtype = match ty {
            GemmType::BF16 => super::tensor::dtype_code(pd_engine::weights::DType::BF16),
            GemmType::F16 => super::tensor::dtype_code(pd_engine::weights::DType::F16),
            GemmType::F32 => unreachable!("gemv16 multiplies 16-bit operands"),
        };
        let dim = |v: usize| i32::try_from(v).expect("GEMV dimension fits in i32");
        let (rows_i, n_i, k_i, acc) = (dim(rows), dim(n), dim(k), i32::from(accumulate));
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.gemv16);
        b.arg(&x)
            .arg(&w)
            .arg(&out)
            .arg(&dtype)
            .arg(&rows_i)
            .arg(&n_i)
            .arg(&k_i)
            .arg(&acc);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(GEMV_WARPS) as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("gemv16", b, cfg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_only_small_aligned_16bit_products() {
        assert!(eligible(GemmType::BF16, 1, 4096, 256, 512));
        assert!(eligible(GemmType::F16, 8, 1024, 0, 16));
        assert!(!eligible(GemmType::F32, 1, 4096, 256, 512), "f32 weights");
        assert!(!eligible(GemmType::BF16, 0, 4096, 256, 512), "no rows");
        assert!(
            !eligible(GemmType::BF16, 9, 4096, 256, 512),
            "a prefill-sized batch"
        );
        assert!(
            !eligible(GemmType::BF16, 1, 4100, 256, 512),
            "k not whole 8-element loads"
        );
        assert!(
            !eligible(GemmType::BF16, 1, 4096, 8, 512),
            "x not 16-byte aligned"
        );
        assert!(
            !eligible(GemmType::BF16, 1, 4096, 256, 520),
            "w not 16-byte aligned"
        );
    }
}
