//! Stored-dtype → `f32` conversion, and the SIMD building blocks the matrix kernels share.
//!
//! Weights are little-endian bytes at any alignment (straight from the memory-mapped
//! checkpoint). bf16 → f32 is exact (a 16-bit shift), f16 → f32 is exact (F16C), f32 is a
//! copy. Three implementations are chosen at run time: AVX-512F, AVX2 + FMA + F16C, and a
//! portable scalar one (also the only one off x86-64).

use super::isa::Isa;
use crate::weights::DType;

/// Convert row-major elements of `src` (dtype per `dtype`, unaligned LE bytes) to f32 into
/// `dst` (`dst.len()` elements). `src` must hold at least `dst.len()` elements; bytes past
/// them are ignored.
pub fn to_f32(dtype: DType, src: &[u8], dst: &mut [f32]) {
    to_f32_with(Isa::detect(), dtype, src, dst);
}

/// [`to_f32`] on an explicit instruction set (which must be [`Isa::available`]).
pub(super) fn to_f32_with(isa: Isa, dtype: DType, src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    assert!(
        src.len() >= n * dtype.size_in_bytes(),
        "to_f32: {} source bytes for {n} {dtype} elements",
        src.len()
    );
    assert!(isa.available(), "to_f32: {isa:?} not available on this CPU");
    if n == 0 {
        return;
    }
    // A little-endian f32 source is a plain copy whatever the instruction set.
    #[cfg(target_endian = "little")]
    if dtype == DType::F32 {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(&src[..n * 4]);
        return;
    }
    match isa.simd() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` was asserted above, so the CPU has AVX-512F; `src` holds at
        // least `n` elements of `dtype` (asserted) and `dst` has exactly `n` slots.
        Isa::Avx512 => unsafe { avx512::convert(dcode(dtype), src.as_ptr(), dst.as_mut_ptr(), n) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 + FMA + F16C.
        Isa::Avx2 => unsafe { avx2::convert(dcode(dtype), src.as_ptr(), dst.as_mut_ptr(), n) },
        _ => scalar_convert(dtype, src, dst),
    }
}

/// Portable conversion of `dst.len()` elements.
fn scalar_convert(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
    }
}

/// Dtype as a const-generic code, so kernels monomorphise per dtype.
pub(super) const D_F32: u8 = 0;
pub(super) const D_F16: u8 = 1;
pub(super) const D_BF16: u8 = 2;

pub(super) fn dcode(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => D_F32,
        DType::F16 => D_F16,
        DType::BF16 => D_BF16,
    }
}

/// Bytes per element of a dtype code.
#[inline(always)]
pub(super) const fn dsize(d: u8) -> usize {
    if d == D_F32 { 4 } else { 2 }
}

/// Element `i` of the dtype-`D` buffer at `p`, as f32 (scalar tails of the SIMD kernels).
///
/// # Safety
/// `p + (i + 1) * dsize(D)` bytes must be readable.
#[inline(always)]
pub(super) unsafe fn read_scalar<const D: u8>(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees the element's bytes are readable; unaligned reads.
    unsafe {
        match D {
            D_F32 => f32::from_le_bytes(p.add(i * 4).cast::<[u8; 4]>().read()),
            D_F16 => {
                half::f16::from_bits(u16::from_le_bytes(p.add(i * 2).cast::<[u8; 2]>().read()))
                    .to_f32()
            }
            _ => f32::from_bits(
                (u16::from_le_bytes(p.add(i * 2).cast::<[u8; 2]>().read()) as u32) << 16,
            ),
        }
    }
}

/// One SIMD instruction set's primitives: vector type, loads that convert each stored dtype
/// to f32 lanes, FMA, horizontal sum, and a whole-buffer conversion. Both x86 modules are
/// generated from this one template so the matrix kernels (in `linear.rs`) can be too.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_module {
    (
        $name:ident, $feat:literal, $v:ty, $lanes:literal,
        zero: $zero:path, fmadd: $fmadd:path, loadu_ps: $loadu:path, storeu_ps: $storeu:path,
        load_f16: |$pf:ident| $load_f16:block, load_bf16: |$pb:ident| $load_bf16:block,
        hsum: |$hv:ident| $hsum:block $(,)?
    ) => {
        pub(super) mod $name {
            #[allow(unused_imports)]
            use std::arch::x86_64::*;

            use super::{D_F16, D_F32, dsize, read_scalar};

            /// f32 lanes per vector.
            pub(in super::super) const LANES: usize = $lanes;
            /// The vector type.
            pub(in super::super) type V = $v;

            #[inline]
            #[target_feature(enable = $feat)]
            pub(in super::super) fn zero() -> V {
                $zero()
            }

            /// `a * b + c`, fused.
            #[inline]
            #[target_feature(enable = $feat)]
            pub(in super::super) fn fmadd(a: V, b: V, c: V) -> V {
                $fmadd(a, b, c)
            }

            /// Sum of the lanes.
            #[inline]
            #[target_feature(enable = $feat)]
            pub(in super::super) fn hsum(v: V) -> f32 {
                let $hv = v;
                $hsum
            }

            /// `LANES` f32 from `p` (any alignment).
            ///
            /// # Safety
            /// `LANES` f32 at `p` must be readable.
            #[inline]
            #[target_feature(enable = $feat)]
            pub(in super::super) unsafe fn load_x(p: *const f32) -> V {
                // SAFETY: the caller guarantees `LANES` readable f32; the load is unaligned.
                unsafe { $loadu(p) }
            }

            /// `LANES` elements of dtype `D` at byte pointer `p` (any alignment), as f32.
            ///
            /// # Safety
            /// `LANES * dsize(D)` bytes at `p` must be readable.
            #[inline]
            #[target_feature(enable = $feat)]
            pub(in super::super) unsafe fn load<const D: u8>(p: *const u8) -> V {
                match D {
                    // SAFETY: the caller guarantees `LANES * 4` readable bytes; unaligned load.
                    D_F32 => unsafe { $loadu(p.cast::<f32>()) },
                    D_F16 => {
                        let $pf = p;
                        $load_f16
                    }
                    _ => {
                        let $pb = p;
                        $load_bf16
                    }
                }
            }

            /// Convert `n` elements of dtype code `d` at `src` into `dst`.
            ///
            /// # Safety
            /// The CPU must support this module's features; `n * dsize(d)` bytes at `src` must
            /// be readable and `n` f32 at `dst` writable.
            #[target_feature(enable = $feat)]
            pub(in super::super) unsafe fn convert(d: u8, src: *const u8, dst: *mut f32, n: usize) {
                // SAFETY: forwarded contract.
                unsafe {
                    match d {
                        D_F32 => convert_d::<D_F32>(src, dst, n),
                        D_F16 => convert_d::<D_F16>(src, dst, n),
                        _ => convert_d::<{ super::D_BF16 }>(src, dst, n),
                    }
                }
            }

            #[target_feature(enable = $feat)]
            unsafe fn convert_d<const D: u8>(src: *const u8, dst: *mut f32, n: usize) {
                let es = dsize(D);
                let nv = n / LANES * LANES;
                let mut i = 0;
                // SAFETY: `i + LANES <= n` in the vector loop and `i < n` in the tail, so every
                // read stays in the caller's `n * es` source bytes and every write in `dst[..n]`.
                unsafe {
                    while i + 4 * LANES <= nv {
                        let a = load::<D>(src.add(i * es));
                        let b = load::<D>(src.add((i + LANES) * es));
                        let c = load::<D>(src.add((i + 2 * LANES) * es));
                        let e = load::<D>(src.add((i + 3 * LANES) * es));
                        $storeu(dst.add(i), a);
                        $storeu(dst.add(i + LANES), b);
                        $storeu(dst.add(i + 2 * LANES), c);
                        $storeu(dst.add(i + 3 * LANES), e);
                        i += 4 * LANES;
                    }
                    while i < nv {
                        $storeu(dst.add(i), load::<D>(src.add(i * es)));
                        i += LANES;
                    }
                    while i < n {
                        *dst.add(i) = read_scalar::<D>(src, i);
                        i += 1;
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
simd_module!(
    avx512, "avx512f", __m512, 16,
    zero: _mm512_setzero_ps, fmadd: _mm512_fmadd_ps,
    loadu_ps: _mm512_loadu_ps, storeu_ps: _mm512_storeu_ps,
    load_f16: |p| {
        // SAFETY: 32 readable bytes at `p` (the `load` contract); unaligned 256-bit load.
        // `_mm512_cvtph_ps` is exact (every f16 is representable in f32).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    },
    load_bf16: |p| {
        // SAFETY: 32 readable bytes at `p`; zero-extend each u16 to u32 and shift it into the
        // high half: the bit pattern of the equal f32.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            )))
        }
    },
    hsum: |v| { _mm512_reduce_add_ps(v) },
);

#[cfg(target_arch = "x86_64")]
simd_module!(
    avx2, "avx2,fma,f16c", __m256, 8,
    zero: _mm256_setzero_ps, fmadd: _mm256_fmadd_ps,
    loadu_ps: _mm256_loadu_ps, storeu_ps: _mm256_storeu_ps,
    load_f16: |p| {
        // SAFETY: 16 readable bytes at `p` (the `load` contract); unaligned 128-bit load.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    },
    load_bf16: |p| {
        // SAFETY: 16 readable bytes at `p`; widen u16 → u32 and shift into the high half.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                p.cast(),
            ))))
        }
    },
    hsum: |v| {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    },
);

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// SplitMix64: deterministic test data without a dependency.
    pub(crate) struct Rng(u64);
    impl Rng {
        pub(crate) fn new(seed: u64) -> Self {
            Rng(seed)
        }
        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        pub(crate) fn unit(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// Random elements of `dtype` as LE bytes, plus their exact f32 values.
    pub(crate) fn random_weights(dtype: DType, n: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::with_capacity(n * dtype.size_in_bytes());
        let mut vals = Vec::with_capacity(n);
        for _ in 0..n {
            let v = rng.unit() * 2.0;
            match dtype {
                DType::F32 => {
                    bytes.extend_from_slice(&v.to_le_bytes());
                    vals.push(v);
                }
                DType::F16 => {
                    let h = half::f16::from_f32(v);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    vals.push(h.to_f32());
                }
                DType::BF16 => {
                    let h = half::bf16::from_f32(v);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    vals.push(h.to_f32());
                }
            }
        }
        (bytes, vals)
    }

    #[test]
    fn every_isa_converts_exactly_at_any_alignment() {
        let mut rng = Rng::new(7);
        for isa in Isa::all_available() {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for n in [0, 1, 2, 7, 8, 15, 16, 17, 63, 64, 65, 100, 1023] {
                    let (bytes, vals) = random_weights(dtype, n, &mut rng);
                    for offset in 0..3 {
                        let mut buf = vec![0xAAu8; offset];
                        buf.extend_from_slice(&bytes);
                        buf.extend_from_slice(&[0x55; 5]); // trailing bytes are ignored
                        let mut dst = vec![f32::NAN; n];
                        to_f32_with(isa, dtype, &buf[offset..], &mut dst);
                        assert_eq!(
                            dst.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            vals.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{isa:?} {dtype} n={n} offset={offset}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn special_values_convert_like_the_half_crate() {
        let bits: Vec<u16> = vec![
            0x0000, 0x8000, 0x0001, 0x03FF, 0x7C00, 0xFC00, 0x7E00, 0x3C00, 0x7F80, 0xFF80, 0x7FC0,
            0x0080, 0x3F80, 0xC2F7,
        ];
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        for isa in Isa::all_available() {
            let mut f16 = vec![0.0; bits.len()];
            let mut bf16 = vec![0.0; bits.len()];
            to_f32_with(isa, DType::F16, &bytes, &mut f16);
            to_f32_with(isa, DType::BF16, &bytes, &mut bf16);
            for (i, &b) in bits.iter().enumerate() {
                let want = half::f16::from_bits(b).to_f32();
                assert!(
                    want.to_bits() == f16[i].to_bits() || (want.is_nan() && f16[i].is_nan()),
                    "{isa:?} f16 {b:#x}"
                );
                assert_eq!(
                    half::bf16::from_bits(b).to_f32().to_bits(),
                    bf16[i].to_bits(),
                    "{isa:?} bf16 {b:#x}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "source bytes")]
    fn short_source_panics() {
        to_f32(DType::BF16, &[0u8; 5], &mut [0.0; 3]);
    }
}
