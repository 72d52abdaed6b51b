//! The CUDA backend's GEMMs as the ops see them: the left operand (f32 rows, or a 16-bit
//! copy an earlier kernel wrote), projections stacked in one buffer multiplied as one matrix
//! and split into column views, the residual-accumulating form, and the cast to 16 bits. The
//! cuBLAS call itself is [`super::gemm::linear`] (or, for decode-sized batches with
//! `PD_CUDA_GEMV=kernel`, the `gemv16` kernel of [`super::gemv`]), and with that kernel the
//! layer norms and the MLP's SiLU taken into the products (`norm_linear_gemv`,
//! `norm_mlp_gemv`); uploading the stacked weights is [`super::weights`].

use std::sync::Arc;

use cudarc::driver::{CudaSlice, PushKernelArg};
use pd_engine::backend::NormMlp;
use pd_engine::weights::DType;

use super::DeviceBuffer;
use super::gemm::{self, GemmType, Product};
use super::gemv::{self, NormedRows, SmallBatchLinear};
use super::weights::{weight_matrix, weight_vector};
use super::{CudaBackend, CudaTensor, CudaWeight};

/// A GEMM's left operand `[rows, cols]`: f32 rows (cast to the weight's 16-bit type if it
/// has one), or rows an earlier kernel already wrote in that 16-bit type.
#[derive(Clone, Copy)]
pub(super) enum Operand<'a> {
    F32(&'a CudaTensor),
    Bits16 {
        data: &'a CudaSlice<u16>,
        rows: usize,
        cols: usize,
    },
}

impl Operand<'_> {
    /// The 16-bit rows in `data`, shaped as `like`.
    pub(super) fn bits16<'a>(data: &'a CudaSlice<u16>, like: &CudaTensor) -> Operand<'a> {
        Operand::Bits16 {
            data,
            rows: like.rows,
            cols: like.cols,
        }
    }

    pub(super) fn rows(&self) -> usize {
        match self {
            Operand::F32(x) => x.rows,
            Operand::Bits16 { rows, .. } => *rows,
        }
    }

    pub(super) fn cols(&self) -> usize {
        match self {
            Operand::F32(x) => x.cols,
            Operand::Bits16 { cols, .. } => *cols,
        }
    }
}

/// The 16-bit dtype every one of `weights` is stored in, if they share one: then one 16-bit
/// copy of their input serves all their GEMMs.
pub(super) fn shared_16bit(weights: &[&CudaWeight]) -> Option<DType> {
    let dtype = weight_matrix(weights.first()?).0;
    (dtype != DType::F32 && weights.iter().all(|w| weight_matrix(w).0 == dtype)).then_some(dtype)
}

impl CudaBackend {
    /// `x · Wᵀ` into a new tensor (see [`Self::linear_into`]).
    pub(super) fn linear_with(&self, x: Operand<'_>, weight: &CudaWeight) -> CudaTensor {
        let matrix = self.matrix(weight);
        let out = self.tensor(x.rows(), matrix.1);
        self.linear_into(x, matrix, &out, false);
        out
    }

    /// `(dtype, rows, cols, address)` of a matrix weight.
    pub(super) fn matrix(&self, w: &CudaWeight) -> (DType, usize, usize, u64) {
        let (dtype, rows, cols, data, offset) = weight_matrix(w);
        (dtype, rows, cols, self.ptr(data) + offset as u64)
    }

    /// `weights` as one matrix `(dtype, total rows, cols, address)` when they lie side by
    /// side, in order, in one buffer (as [`Backend::load_stacked`] uploads them), so one GEMM
    /// computes all their products.
    pub(super) fn stacked(&self, weights: &[&CudaWeight]) -> Option<(DType, usize, usize, u64)> {
        let (dtype, _, cols, data, offset) = weight_matrix(weights.first()?);
        let mut next = offset;
        let mut rows = 0;
        for w in weights {
            let (d, r, c, buf, off) = weight_matrix(w);
            if d != dtype || c != cols || !Arc::ptr_eq(buf, data) || off != next {
                return None;
            }
            next = off + r * c * d.size_in_bytes();
            rows += r;
        }
        Some((dtype, rows, cols, self.ptr(data) + offset as u64))
    }

    /// `out = x · Wᵀ`, or `out += x · Wᵀ` with `accumulate` (the residual adds). `weight`
    /// is a matrix, or several stacked in one buffer ([`Self::stacked`]): `(dtype, rows,
    /// cols, address)`.
    pub(super) fn linear_into(
        &self,
        x: Operand<'_>,
        (dtype, n, k, w): (DType, usize, usize, u64),
        out: &CudaTensor,
        accumulate: bool,
    ) {
        let rows = x.rows();
        assert_eq!(x.cols(), k, "linear: input width");
        assert_eq!((out.rows, out.cols), (rows, n), "linear: output shape");
        let out_ptr = self.ptr(out.dense());
        if rows == 0 || n == 0 {
            return;
        }
        // A cast made here lives until the end of the call, after the GEMM is queued.
        let cast;
        let (ty, x_ptr) = match (dtype, x) {
            (DType::F32, Operand::F32(x)) => (GemmType::F32, self.ptr(x.dense())),
            (DType::F32, Operand::Bits16 { .. }) => {
                unreachable!("a 16-bit GEMM input is only made for 16-bit weights")
            }
            (DType::BF16 | DType::F16, x) => {
                let ty = GemmType::of(dtype);
                let x16 = match x {
                    Operand::Bits16 { data, .. } => data,
                    Operand::F32(x) => {
                        cast = self.cast(x, dtype);
                        &cast
                    }
                };
                (ty, self.ptr(x16))
            }
        };
        let product = Product {
            ty,
            x: x_ptr,
            rows,
            w,
            n,
            k,
            out: out_ptr,
            accumulate,
        };
        self.product(&product);
    }

    /// `p` by the `gemv16` kernel when chosen and it takes `p`, else by cuBLAS.
    pub(super) fn product(&self, p: &Product) {
        if self.small_batch_linear() == SmallBatchLinear::Kernel && gemv::eligible(p) {
            self.gemv16(p);
        } else {
            gemm::linear(&self.dev, p);
        }
    }

    /// The products `x · Wᵢᵀ` of projections that share their input: one GEMM when the
    /// weights lie side by side in one buffer ([`Self::stacked`]), its columns then split
    /// into views, else one GEMM each.
    pub(super) fn linear_stacked<const N: usize>(
        &self,
        x: Operand<'_>,
        weights: [&CudaWeight; N],
    ) -> [CudaTensor; N] {
        match self.stacked(&weights) {
            Some(matrix) => {
                let out = self.tensor(x.rows(), matrix.1);
                self.linear_into(x, matrix, &out, false);
                out.split_cols(weights.map(|w| weight_matrix(w).1))
            }
            None => weights.map(|w| self.linear_with(x, w)),
        }
    }

    /// [`Backend::norm_linear_shared`] by one `gemv16_norm` launch when it qualifies
    /// ([`Self::normed_product`]); else `None`, nothing launched.
    pub(super) fn norm_linear_gemv<const N: usize>(
        &self,
        x: &CudaTensor,
        norm: &CudaWeight,
        group: usize,
        eps: f32,
        weights: [&CudaWeight; N],
    ) -> Option<[CudaTensor; N]> {
        let (ty, n, input, w) = self.normed_product(x, norm, group, eps, &weights)?;
        let out = self.tensor(x.rows, n);
        self.gemv16_norm(&input, ty, w, n, self.ptr(out.dense()));
        Some(out.split_cols(weights.map(|w| weight_matrix(w).1)))
    }

    /// [`Backend::norm_mlp_add`] by `gemv16_norm_silu` (norm, gate / up and SiLU into the
    /// down projection's 16-bit input) then `gemv16` adding the down projection to `x`, when
    /// both qualify; else `false`, nothing launched.
    pub(super) fn norm_mlp_gemv(&self, x: &mut CudaTensor, mlp: &NormMlp<'_, CudaWeight>) -> bool {
        let Some((ty, n, input, w)) =
            self.normed_product(x, mlp.norm, mlp.hidden, mlp.eps, &[mlp.gate, mlp.up])
        else {
            return false;
        };
        let inter = weight_matrix(mlp.gate).1;
        let (down_dtype, down_n, down_k, down_w) = self.matrix(mlp.down);
        let mut down = Product {
            ty,
            x: 0, // the activation's address, once allocated (aligned as every allocation)
            rows: x.rows,
            w: down_w,
            n: down_n,
            k: down_k,
            out: self.ptr(x.dense()),
            accumulate: true,
        };
        let shapes_fit = n == 2 * inter && down_k == inter && down_n == x.cols;
        if !shapes_fit || GemmType::of(down_dtype) != ty || !gemv::eligible(&down) {
            return false;
        }
        let act = self.alloc::<u16>(x.rows * inter);
        down.x = self.ptr(&act);
        self.gemv16_norm_silu(&input, ty, w, inter, down.x);
        self.gemv16(&down);
        true
    }

    /// What the norm-fused GEMV kernels need for `weights · rms_norm(x)ᵀ`, if they may take
    /// it: `PD_CUDA_GEMV=kernel`, a norm over whole rows, the weights stacked in one 16-bit
    /// buffer ([`Self::stacked`]) and [`gemv::norm_eligible`]. `(type, stacked columns, the
    /// normalised rows, weights' address)`.
    fn normed_product(
        &self,
        x: &CudaTensor,
        norm: &CudaWeight,
        group: usize,
        eps: f32,
        weights: &[&CudaWeight],
    ) -> Option<(GemmType, usize, NormedRows, u64)> {
        if self.small_batch_linear() != SmallBatchLinear::Kernel || group != x.cols || x.is_empty()
        {
            return None;
        }
        let (dtype, n, k, w) = self.stacked(weights)?;
        let ty = GemmType::of(dtype);
        let input = NormedRows {
            h: self.ptr(x.dense()),
            gamma: self.ptr(weight_vector(norm)),
            eps,
            rows: x.rows,
            k,
        };
        let shared = self.dev.norm_shared_bytes;
        (k == x.cols && gemv::norm_eligible(ty, &input, w, shared)).then_some((ty, n, input, w))
    }

    pub(super) fn cast(&self, x: &CudaTensor, dtype: DType) -> DeviceBuffer<u16> {
        let out = self.alloc::<u16>(x.len());
        let n = x.len() as u64;
        let f = match dtype {
            DType::BF16 => &self.dev.kernels.cast_bf16,
            DType::F16 => &self.dev.kernels.cast_f16,
            DType::F32 => unreachable!("f32 weights multiply f32 activations"),
        };
        let mut b = self.dev.stream.launch_builder(f);
        b.arg(x.dense()).arg(&out).arg(&n);
        self.launch("cast", b, Self::elements(x.len()));
        out
    }
}
