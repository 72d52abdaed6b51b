//! The `gemv16` kernel (`gemv.cu`) in place of the cuBLAS GEMM for decode-sized batches:
//! which products it may take, and its launch. Chosen with `PD_CUDA_GEMV=kernel`; cuBLAS
//! (`PD_CUDA_GEMV=cublas`) stays the default until a GPU run has measured which streams the
//! weights faster (docs/cuda.md). Does not cover prefill-sized products (cuBLAS's tensor-core
//! GEMMs) or f32 weights.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::CudaBackend;
use super::gemm::{GemmType, Product};
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
pub(super) fn eligible(p: &Product) -> bool {
    matches!(p.ty, GemmType::BF16 | GemmType::F16)
        && (1..=GEMV_MAX_ROWS).contains(&p.rows)
        && p.k.is_multiple_of(8)
        && i32::try_from(p.k).is_ok()
        && p.x.is_multiple_of(16)
        && p.w.is_multiple_of(16)
}

impl CudaBackend {
    /// `p` by `gemv16`; the caller checked [`eligible`].
    pub(super) fn gemv16(&self, p: &Product) {
        let dtype = match p.ty {
            GemmType::BF16 => super::tensor::dtype_code(pd_engine::weights::DType::BF16),
            GemmType::F16 => super::tensor::dtype_code(pd_engine::weights::DType::F16),
            GemmType::F32 => unreachable!("gemv16 multiplies 16-bit operands"),
        };
        let dim = |v: usize| i32::try_from(v).expect("GEMV dimension fits in i32");
        let (rows, n, k) = (dim(p.rows), dim(p.n), dim(p.k));
        let accumulate = i32::from(p.accumulate);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.gemv16);
        b.arg(&p.x)
            .arg(&p.w)
            .arg(&p.out)
            .arg(&dtype)
            .arg(&rows)
            .arg(&n)
            .arg(&k)
            .arg(&accumulate);
        let cfg = LaunchConfig {
            grid_dim: (p.n.div_ceil(GEMV_WARPS) as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("gemv16", b, cfg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn product(ty: GemmType, rows: usize, k: usize, x: u64, w: u64) -> Product {
        Product {
            ty,
            x,
            rows,
            w,
            n: 64,
            k,
            out: 0,
            accumulate: false,
        }
    }

    #[test]
    fn takes_only_small_aligned_16bit_products() {
        let eligible = |ty, rows, k, x, w| eligible(&product(ty, rows, k, x, w));
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
