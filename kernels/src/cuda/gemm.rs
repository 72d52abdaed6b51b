//! `x · Wᵀ` through cuBLAS: bf16 / f16 weights multiply a 16-bit copy of the activations on
//! the tensor cores with f32 accumulation and f32 output; f32 weights (the tiny test model)
//! use plain f32 GEMM.
//!
//! Row-major `x [rows, in]` is column-major `xᵀ [in, rows]`, and row-major `W [out, in]` is
//! column-major `Wᵀ [in, out]`; cuBLAS computes column-major `yᵀ [out, rows] = W · xᵀ`
//! (op(A) = transpose of the stored `Wᵀ`), which is row-major `y [rows, out]`.

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

use pd_engine::weights::DType;

use super::device::Device;

/// Element type of both GEMM inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmType {
    F32,
    F16,
    BF16,
}

impl GemmType {
    /// The GEMM type of weights stored as `dtype`.
    pub fn of(dtype: DType) -> Self {
        match dtype {
            DType::F32 => GemmType::F32,
            DType::F16 => GemmType::F16,
            DType::BF16 => GemmType::BF16,
        }
    }

    fn cuda(self) -> cudaDataType {
        match self {
            GemmType::F32 => cudaDataType::CUDA_R_32F,
            GemmType::F16 => cudaDataType::CUDA_R_16F,
            GemmType::BF16 => cudaDataType::CUDA_R_16BF,
        }
    }
}

/// One product `out [rows, n] = x [rows, k] · w [n, k]ᵀ`, `x` and `w` both of `ty`, `out`
/// f32; with `accumulate`, `out += x · wᵀ`. `x`, `w` and `out` are device addresses (of a
/// buffer or a range of one) that the caller keeps alive until the product has run (frees are
/// stream-ordered after it). What [`linear`] and the `gemv16` kernel both take.
#[derive(Debug, Clone, Copy)]
pub struct Product {
    pub ty: GemmType,
    pub x: u64,
    pub rows: usize,
    pub w: u64,
    pub n: usize,
    pub k: usize,
    pub out: u64,
    pub accumulate: bool,
}

/// `p` through cuBLAS; with `accumulate`, cuBLAS's beta = 1 adds the product to `out` in the
/// GEMM's f32 epilogue, so a residual add needs no launch of its own.
pub fn linear(dev: &Device, p: &Product) {
    let Product {
        ty,
        x,
        rows,
        w,
        n,
        k,
        out,
        accumulate,
    } = *p;
    let alpha = 1.0f32;
    let beta = if accumulate { 1.0f32 } else { 0.0f32 };
    let dim = |v: usize| i32::try_from(v).expect("GEMM dimension fits in i32");
    // SAFETY: the addresses start live device memory of at least n*k, rows*k and rows*n
    // elements of the stated types (the caller's contract); alpha/beta are host f32 as the
    // handle's default pointer mode and the f32 compute type expect.
    let result = unsafe {
        gemm_ex(
            *dev.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            dim(n),
            dim(rows),
            dim(k),
            (&alpha as *const f32).cast::<c_void>(),
            w as *const c_void,
            ty.cuda(),
            dim(k),
            x as *const c_void,
            ty.cuda(),
            dim(k),
            (&beta as *const f32).cast::<c_void>(),
            out as *mut c_void,
            cudaDataType::CUDA_R_32F,
            dim(n),
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    if let Err(e) = result {
        panic!(
            "cuda:{}: cuBLAS GEMM [{rows}x{k}]·[{n}x{k}]ᵀ failed: {e:?}",
            dev.ordinal
        );
    }
}
