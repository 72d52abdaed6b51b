//! The element types the CPU backend can keep its KV cache in (`--kv-cache-dtype`): f32, or
//! f16 / bf16 at half the memory and half of attention's reads. Values are rounded to the
//! element type when written into the cache and widened to f32 when attention reads them;
//! all arithmetic stays in f32. What it does not own: the SIMD loads of each type, which
//! live with the kernels that use them (`attention::avx2`).

use half::{bf16, f16};

use crate::weights::DType;

/// One value of the KV cache as stored.
pub trait KvElem: bytemuck::Pod + Send + Sync + std::fmt::Debug + 'static {
    /// The stored type (the SIMD kernels branch on it at compile time).
    const DTYPE: DType;
    /// Rounded to nearest, ties to even; NaN stays NaN.
    fn from_f32(x: f32) -> Self;
    /// Exact.
    fn to_f32(self) -> f32;

    /// `dst[i] = src[i]` rounded; equal lengths.
    fn store_f32(src: &[f32], dst: &mut [Self]) {
        assert_eq!(src.len(), dst.len());
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s);
        }
    }
}

impl KvElem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn store_f32(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    // half's slice conversions use F16C where the CPU has it.
    fn store_f32(src: &[f32], dst: &mut [Self]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

impl KvElem for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<E: KvElem>(values: &[f32]) -> Vec<f32> {
        let mut stored = vec![E::from_f32(0.0); values.len()];
        E::store_f32(values, &mut stored);
        let back: Vec<f32> = stored.iter().map(|s| s.to_f32()).collect();
        // The slice paths and the scalar ones agree.
        for (s, v) in stored.iter().zip(values) {
            assert_eq!(s.to_f32().to_bits(), E::from_f32(*v).to_f32().to_bits());
        }
        back
    }

    #[test]
    fn values_round_to_nearest_in_each_type() {
        let values = [
            0.0,
            -0.0,
            1.0,
            -2.5,
            1.0 + 1.0 / 1024.0,
            1.0 + 1.0 / 128.0,
            3.0e4,
            1e-3,
        ];
        assert_eq!(round_trip::<f32>(&values), values);
        let h = round_trip::<f16>(&values);
        // f16 keeps 11 significant bits: 1 + 2^-10 exactly, 1e-3 within half an ulp.
        assert_eq!(h[4], 1.0 + 1.0 / 1024.0);
        assert!((h[7] - 1e-3).abs() <= 1e-3 * 2f32.powi(-11));
        let b = round_trip::<bf16>(&values);
        // bf16 keeps 8: 1 + 2^-10 rounds to 1, 1 + 2^-7 is kept; a tie goes to even.
        assert_eq!(b[4], 1.0);
        assert_eq!(b[5], 1.0 + 1.0 / 128.0);
        assert_eq!(round_trip::<bf16>(&[1.0 + 1.0 / 256.0])[0], 1.0);
        assert!((b[6] - 3.0e4).abs() <= 3.0e4 * 2f32.powi(-8));
        assert!(round_trip::<f16>(&[f32::NAN])[0].is_nan());
    }
}
