//! The `gemv16` kernels (`gemv.cu`) in place of the cuBLAS GEMM for decode-sized batches:
//! which products they may take, and their launches. Chosen with `PD_CUDA_GEMV=kernel`;
//! cuBLAS (`PD_CUDA_GEMV=cublas`) stays the default until a GPU run has measured which streams
//! the weights faster (docs/cuda.md). Besides the plain product, two fused forms take the
//! layer norm before q/k/v (or the logits) and before gate/up, the latter also the SiLU after
//! it ([`NormedRows`]). Does not cover prefill-sized products (cuBLAS's tensor-core GEMMs) or
//! f32 weights; which ops use the fused forms is [`super::linear`]'s business.

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};

use super::CudaBackend;
use super::gemm::{GemmType, Product};
use super::pdl::arg;
use crate::CudaError;

/// Most rows one launch multiplies (`GEMV_MAX_ROWS` in gemv.cu).
pub const GEMV_MAX_ROWS: usize = 8;

/// Warps per thread block, one output column each (`GEMV_WARPS` in gemv.cu).
const GEMV_WARPS: usize = 8;

/// Threads per block.
pub(super) const GEMV_THREADS: u32 = (GEMV_WARPS * 32) as u32;

/// Dynamic shared memory a launch gets without opting in. The norm-fused kernels hold their
/// normalised rows there (`rows · k` 16-bit values) and opt in to more
/// ([`opt_in_norm_shared`]): 8 rows of qwen3-8b's 4,096 take 64 KiB.
const SHARED_BYTES: usize = 48 * 1024;

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
    weights_eligible(p.ty, p.rows, p.k, p.w) && p.x.is_multiple_of(16)
}

/// What every form needs of the weights `w` (`[n, k]`, device address) and the batch.
fn weights_eligible(ty: GemmType, rows: usize, k: usize, w: u64) -> bool {
    matches!(ty, GemmType::BF16 | GemmType::F16)
        && (1..=GEMV_MAX_ROWS).contains(&rows)
        && k.is_multiple_of(8)
        && i32::try_from(k).is_ok()
        && w.is_multiple_of(16)
}

/// The f32 residual rows `h` (`[rows, k]`, dense) that a norm-fused kernel normalises over
/// whole rows with `gamma` (`[k]` f32) and `eps` before multiplying them. Device addresses,
/// kept alive by the caller until the launch is queued.
pub(super) struct NormedRows {
    pub h: u64,
    pub gamma: u64,
    pub eps: f32,
    pub rows: usize,
    pub k: usize,
}

/// Whether the norm-fused kernels can take these rows into weights `w`: as [`eligible`], the
/// normalised rows fit the `shared_bytes` of dynamic shared memory the kernels may have
/// ([`opt_in_norm_shared`]), and `rms_norm_16` would reduce a row of width `k`
/// with as many threads as a GEMV block has (`norm_threads`: rows over 128 wide), so the
/// fused norm is the same arithmetic in the same order: the same bits.
pub(super) fn norm_eligible(ty: GemmType, input: &NormedRows, w: u64, shared_bytes: usize) -> bool {
    weights_eligible(ty, input.rows, input.k, w)
        && super::norm_threads(input.k) == GEMV_THREADS
        && input.rows * input.k * 2 <= shared_bytes
        && input.h.is_multiple_of(4)
}

/// Let the norm-fused kernels have more dynamic shared memory than the 48 KiB a launch gets
/// by default, so that wide rows are normalised in the kernel too: up to the device's
/// opt-in limit per block, but at most half of a multiprocessor's shared memory (two blocks
/// of them still fit on one, and their weight loads keep the memory system busy), less the
/// kernels' static shared memory. Returns the bytes a launch may ask for: 48 KiB if the
/// device does not say, or refuses.
pub(super) fn opt_in_norm_shared(dev: &CudaContext, kernels: [&CudaFunction; 2]) -> usize {
    use cudarc::driver::sys::{CUdevice_attribute as D, CUfunction_attribute as F};
    let attribute = |a| dev.attribute(a).ok().and_then(|v| usize::try_from(v).ok());
    let (Some(per_block), Some(per_sm)) = (
        attribute(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        attribute(D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
    ) else {
        return SHARED_BYTES;
    };
    let statics = kernels
        .iter()
        .map(|f| {
            f.shared_size_bytes()
                .ok()
                .and_then(|v| usize::try_from(v).ok())
        })
        .try_fold(0, |most, b| b.map(|b| most.max(b)));
    let Some(statics) = statics else {
        return SHARED_BYTES;
    };
    let limit = per_block.min(per_sm / 2).saturating_sub(statics);
    if limit <= SHARED_BYTES {
        return SHARED_BYTES;
    }
    let value = i32::try_from(limit).unwrap_or(i32::MAX);
    for f in kernels {
        let set = f.set_attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, value);
        if let Err(e) = set {
            tracing::warn!(
                error = %e,
                "the norm-fused GEMV kernels keep 48 KiB of shared memory"
            );
            // One may have been raised: that only allows what the launches never ask for.
            return SHARED_BYTES;
        }
    }
    limit
}

impl CudaBackend {
    /// `p` by `gemv16`; the caller checked [`eligible`].
    pub(super) fn gemv16(&self, p: &Product) {
        let dtype = dtype_code(p.ty);
        let dim = |v: usize| i32::try_from(v).expect("GEMV dimension fits in i32");
        let (rows, n, k) = (dim(p.rows), dim(p.n), dim(p.k));
        let accumulate = i32::from(p.accumulate);
        let mut args = [
            arg(&p.x),
            arg(&p.w),
            arg(&p.out),
            arg(&dtype),
            arg(&rows),
            arg(&n),
            arg(&k),
            arg(&accumulate),
        ];
        // SAFETY: gemv16's parameters, in order; the caller checked `eligible` and keeps the
        // operands alive until the launch is queued; the kernel waits before its reads of x.
        unsafe {
            self.launch_dependent(
                "gemv16",
                &self.dev.kernels.gemv16,
                launch(p.n, 0),
                &mut args,
            )
        };
    }

    /// `out [rows, n] = rms_norm(input) · wᵀ` by `gemv16_norm`; the caller checked
    /// [`norm_eligible`].
    pub(super) fn gemv16_norm(&self, input: &NormedRows, ty: GemmType, w: u64, n: usize, out: u64) {
        self.launch_normed(
            "gemv16_norm",
            &self.dev.kernels.gemv16_norm,
            input,
            ty,
            w,
            n,
            out,
        );
    }

    /// `out16 [rows, inter] = silu(x · gateᵀ) · (x · upᵀ)` in `ty`, `x = rms_norm(input)`, by
    /// `gemv16_norm_silu`; `w` holds gate `[inter, k]` then up `[inter, k]`. The caller
    /// checked [`norm_eligible`].
    pub(super) fn gemv16_norm_silu(
        &self,
        input: &NormedRows,
        ty: GemmType,
        w: u64,
        inter: usize,
        out16: u64,
    ) {
        let f = &self.dev.kernels.gemv16_norm_silu;
        self.launch_normed("gemv16_norm_silu", f, input, ty, w, inter, out16);
    }

    /// One of the norm-fused kernels (they share their parameter list) over `columns`
    /// output columns.
    #[allow(clippy::too_many_arguments)]
    fn launch_normed(
        &self,
        name: &str,
        func: &CudaFunction,
        input: &NormedRows,
        ty: GemmType,
        w: u64,
        columns: usize,
        out: u64,
    ) {
        let dim = |v: usize| i32::try_from(v).expect("GEMV dimension fits in i32");
        let (dtype, rows, cols, k) = (dtype_code(ty), dim(input.rows), dim(columns), dim(input.k));
        let mut args = [
            arg(&input.h),
            arg(&input.gamma),
            arg(&input.eps),
            arg(&w),
            arg(&out),
            arg(&dtype),
            arg(&rows),
            arg(&cols),
            arg(&k),
        ];
        let cfg = launch(columns, input.rows * input.k * 2);
        // SAFETY: the norm-fused kernels' parameters, in order; the caller checked
        // `norm_eligible` and keeps the buffers alive until the launch is queued; the kernels
        // wait before they read h.
        unsafe { self.launch_dependent(name, func, cfg, &mut args) };
    }
}

fn dtype_code(ty: GemmType) -> i32 {
    match ty {
        GemmType::BF16 => super::tensor::dtype_code(pd_engine::weights::DType::BF16),
        GemmType::F16 => super::tensor::dtype_code(pd_engine::weights::DType::F16),
        GemmType::F32 => unreachable!("the GEMV kernels multiply 16-bit operands"),
    }
}

/// One warp per output column, [`GEMV_WARPS`] columns per block.
fn launch(columns: usize, shared_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (columns.div_ceil(GEMV_WARPS) as u32, 1, 1),
        block_dim: (GEMV_THREADS, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
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

    #[test]
    fn norm_fused_forms_take_whole_rows_that_fit_shared_memory() {
        let eligible = |ty, rows, k, h| {
            let input = NormedRows {
                h,
                gamma: 0,
                eps: 1e-6,
                rows,
                k,
            };
            norm_eligible(ty, &input, 512, SHARED_BYTES)
        };
        assert!(
            eligible(GemmType::BF16, 8, 1024, 256),
            "qwen3-0.6b, batch 8"
        );
        assert!(eligible(GemmType::BF16, 6, 4096, 256), "qwen3-8b, batch 6");
        assert!(
            !eligible(GemmType::BF16, 7, 4096, 256),
            "qwen3-8b, batch 7: 56 KiB of normalised rows without opting in"
        );
        let input = |rows| NormedRows {
            h: 256,
            gamma: 0,
            eps: 1e-6,
            rows,
            k: 4096,
        };
        assert!(
            norm_eligible(GemmType::BF16, &input(8), 512, 64 << 10),
            "qwen3-8b, batch 8: 64 KiB opted in"
        );
        assert!(!norm_eligible(
            GemmType::BF16,
            &input(8),
            512,
            (64 << 10) - 1
        ));
        assert!(
            !eligible(GemmType::F16, 1, 128, 256),
            "rms_norm_16 reduces 128-wide rows with 64 threads, in another order"
        );
        assert!(eligible(GemmType::F16, 1, 136, 256));
        assert!(!eligible(GemmType::F32, 1, 1024, 256), "f32 weights");
        assert!(
            !eligible(GemmType::BF16, 9, 1024, 256),
            "a prefill-sized batch"
        );
        assert!(
            !eligible(GemmType::BF16, 1, 1024, 2),
            "rows not f32-aligned"
        );
    }
}
