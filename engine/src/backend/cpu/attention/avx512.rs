//! The attention kernels in AVX-512 intrinsics (16 f32 lanes): a key tile's 16 scores are
//! one register, its softmax one masked vector operation, `exp2` the same polynomial as
//! [`super::avx2`] on 16 lanes. The products are register-blocked with 16 accumulators
//! ([`ROW_BLOCK`] query vectors × 4 keys or × 64 head dimensions, 2 × 8 or × 128, 1 × 8 or
//! × 128) out of the 32 vector registers.
//!
//! Cached K and V are read in their stored type and widened in registers ([`load16`]).
//!
//! Every function requires a CPU with AVX-512 F + BW + VL, AVX2, FMA and F16C
//! (`Isa::Avx512`); the caller checks it once. Slice lengths are asserted on entry, so the
//! pointer reads inside stay within them.

use std::arch::x86_64::*;

use super::{KEY_TILE, ROW_BLOCK};
use crate::backend::cpu::KvElem;
use crate::weights::DType;

/// f32 lanes of one register: exactly one key tile of scores.
const L: usize = 16;
const _: () = assert!(KEY_TILE == L);

/// Sixteen cached K or V values at `p`, widened to f32: a plain load for f32, the F16C
/// convert for f16, a 16-bit shift for bf16.
///
/// # Safety
/// AVX-512F; sixteen values readable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
    // SAFETY: the contract: 16 elements of E (64 or 32 bytes) are readable at `p`.
    unsafe {
        match E::DTYPE {
            DType::F32 => _mm512_loadu_ps(p.cast()),
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
        }
    }
}

/// `s[m][i] = q[m] · k_i` for query vectors `m < queries` (rows of `q`, `hd` each) and the
/// tile's keys (`keys.len() <= KEY_TILE`, `hd` each); `s` is `[queries, KEY_TILE]`.
///
/// # Safety
/// The CPU must have AVX-512 F + BW + VL, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn scores<E: KvElem>(
    q: &[f32],
    hd: usize,
    queries: usize,
    keys: &[&[E]],
    s: &mut [f32],
) {
    assert!(q.len() >= queries * hd && s.len() >= queries * KEY_TILE && keys.len() <= KEY_TILE);
    assert!(keys.iter().all(|k| k.len() == hd));
    let mut m = 0;
    // SAFETY: rows m..m+R of `q` and of `s` are in bounds (asserted above, m + R <= queries).
    unsafe {
        while m < queries {
            let (q, s) = (q.as_ptr().add(m * hd), s.as_mut_ptr().add(m * KEY_TILE));
            m += match queries - m {
                1 => score_rows::<1, 8, E>(q, hd, keys, s),
                2 | 3 => score_rows::<2, 8, E>(q, hd, keys, s),
                _ => score_rows::<ROW_BLOCK, 4, E>(q, hd, keys, s),
            };
        }
    }
}

/// [`scores`] for `R` query vectors at `q` (stride `hd`) over all the tile's keys, `K` keys
/// at a time and the rest one by one, writing rows at `s` (stride `KEY_TILE`). Returns `R`.
///
/// # Safety
/// As [`scores`]; `R * hd` f32 readable at `q`, `R * KEY_TILE` writable at `s`, every key `hd` long.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn score_rows<const R: usize, const K: usize, E: KvElem>(
    q: *const f32,
    hd: usize,
    keys: &[&[E]],
    s: *mut f32,
) -> usize {
    let mut i = 0;
    // SAFETY: forwarded contract; keys i..i + K (or i) exist, their scores go to columns < KEY_TILE.
    unsafe {
        while i + K <= keys.len() {
            score_block::<R, K, E>(q, hd, &keys[i..i + K], s.add(i));
            i += K;
        }
        while i < keys.len() {
            score_block::<R, 1, E>(q, hd, &keys[i..i + 1], s.add(i));
            i += 1;
        }
    }
    R
}

/// Scores of `R` query vectors at `q` (stride `hd`) against exactly `K` keys, written at `s`
/// (row stride `KEY_TILE`, `K` columns).
///
/// # Safety
/// As [`scores`]; `R * hd` f32 readable at `q`, `keys.len() == K` keys of `hd`, the `R × K`
/// outputs writable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn score_block<const R: usize, const K: usize, E: KvElem>(
    q: *const f32,
    hd: usize,
    keys: &[&[E]],
    s: *mut f32,
) {
    let full = hd / L * L;
    let k: [*const E; K] = std::array::from_fn(|j| keys[j].as_ptr());
    // SAFETY: d + L <= full <= hd for the vector loads of q's rows and the keys; the tail
    // reads d < hd; writes go to the R × K outputs (contract).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); K]; R];
        let mut d = 0;
        while d < full {
            let kv: [__m512; K] = std::array::from_fn(|j| load16(k[j].add(d)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(q.add(r * hd + d));
                for (a, kj) in acc.iter_mut().zip(&kv) {
                    *a = _mm512_fmadd_ps(x, *kj, *a);
                }
            }
            d += L;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                let mut dot = _mm512_reduce_add_ps(*a);
                for d in full..hd {
                    dot = (*q.add(r * hd + d)).mul_add((*k[j].add(d)).to_f32(), dot);
                }
                *s.add(r * KEY_TILE + j) = dot;
            }
        }
    }
}

/// Fold one tile's scores of one query vector (`s`, `KEY_TILE` base-2 exponents) into its
/// running softmax: `s` becomes the tile's weights (0 for keys at or past `visible`), `o`
/// (`hd` accumulators) and `sum` are rescaled to the new max.
///
/// # Safety
/// The CPU must have AVX-512 F + BW + VL, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn softmax_step(
    s: &mut [f32],
    visible: usize,
    max: &mut f32,
    sum: &mut f32,
    o: &mut [f32],
) {
    assert!(s.len() == KEY_TILE && visible <= KEY_TILE);
    // SAFETY: `s` holds exactly one vector (asserted); `o` is read and written below its
    // length (vector loop to len / 16 * 16, masked rest).
    unsafe {
        if visible == 0 {
            _mm512_storeu_ps(s.as_mut_ptr(), _mm512_setzero_ps());
            return;
        }
        // Lanes at or past `visible` are masked off.
        let vis: __mmask16 = if visible >= L {
            0xFFFF
        } else {
            ((1u32 << visible) - 1) as __mmask16
        };
        let x = _mm512_loadu_ps(s.as_ptr());
        let new_max = max.max(_mm512_mask_reduce_max_ps(vis, x));
        let w = _mm512_maskz_mov_ps(vis, exp2(_mm512_sub_ps(x, _mm512_set1_ps(new_max))));
        _mm512_storeu_ps(s.as_mut_ptr(), w);
        if new_max > *max {
            // The first tile of a vector has max = -inf: its correction is 0 on an empty state.
            let c = exp2(_mm512_set1_ps(*max - new_max));
            let cs = _mm512_cvtss_f32(c);
            *sum *= cs;
            let n = o.len() / L * L;
            let p = o.as_mut_ptr();
            let mut d = 0;
            while d < n {
                _mm512_storeu_ps(p.add(d), _mm512_mul_ps(_mm512_loadu_ps(p.add(d)), c));
                d += L;
            }
            for x in &mut o[n..] {
                *x *= cs;
            }
            *max = new_max;
        }
        *sum += _mm512_reduce_add_ps(w);
    }
}

/// `2^x` per lane for `x <= 0`, as [`super::avx2::exp2`] (same polynomial) on 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) fn exp2(x: __m512) -> __m512 {
    const ROUND: f32 = 12_582_912.0;
    let x = _mm512_max_ps(x, _mm512_set1_ps(-126.0));
    let round = _mm512_set1_ps(ROUND);
    let big = _mm512_add_ps(x, round);
    let f = _mm512_sub_ps(x, _mm512_sub_ps(big, round));
    let int = _mm512_sub_epi32(_mm512_castps_si512(big), _mm512_castps_si512(round));
    let mut p = _mm512_set1_ps(super::EXP2_POLY[6]);
    for &c in super::EXP2_POLY[..6].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
    let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(int, _mm512_set1_epi32(127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(scale))
}

/// `o[m] += Σ_i p[m][i] · v_i` for query vectors `m < queries` (`o` is `[queries, hd]`, `p`
/// is `[queries, KEY_TILE]`) over the tile's values (`values.len() <= KEY_TILE`, `hd` each).
///
/// # Safety
/// The CPU must have AVX-512 F + BW + VL, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn weighted_values<E: KvElem>(
    p: &[f32],
    values: &[&[E]],
    hd: usize,
    queries: usize,
    o: &mut [f32],
) {
    assert!(o.len() >= queries * hd && p.len() >= queries * KEY_TILE && values.len() <= KEY_TILE);
    assert!(values.iter().all(|v| v.len() == hd));
    let mut m = 0;
    // SAFETY: rows m..m+R of `p` and `o` are in bounds (asserted above, m + R <= queries).
    unsafe {
        while m < queries {
            let (p, o) = (p.as_ptr().add(m * KEY_TILE), o.as_mut_ptr().add(m * hd));
            m += match queries - m {
                1 => value_rows::<1, 8, E>(p, values, hd, o),
                2 | 3 => value_rows::<2, 8, E>(p, values, hd, o),
                _ => value_rows::<ROW_BLOCK, 4, E>(p, values, hd, o),
            };
        }
    }
}

/// [`weighted_values`] for `R` query vectors (weights at `p`, stride `KEY_TILE`; outputs at
/// `o`, stride `hd`): `C` vectors of the head dimension at a time, then one, then the scalar
/// rest. Returns `R`.
///
/// # Safety
/// As [`weighted_values`]; `R * KEY_TILE` f32 readable at `p`, `R * hd` read-writable at `o`,
/// every value `hd` long.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn value_rows<const R: usize, const C: usize, E: KvElem>(
    p: *const f32,
    values: &[&[E]],
    hd: usize,
    o: *mut f32,
) -> usize {
    let mut d = 0;
    // SAFETY: each block covers columns d..d + C * L <= hd (then d + L <= hd); the scalar
    // rest stays below hd; weights are read at i < values.len() <= KEY_TILE.
    unsafe {
        while d + C * L <= hd {
            value_block::<R, C, E>(p, values, hd, o, d);
            d += C * L;
        }
        while d + L <= hd {
            value_block::<R, 1, E>(p, values, hd, o, d);
            d += L;
        }
        for d in d..hd {
            for r in 0..R {
                let mut acc = *o.add(r * hd + d);
                for (i, v) in values.iter().enumerate() {
                    acc = (*p.add(r * KEY_TILE + i)).mul_add(v[d].to_f32(), acc);
                }
                *o.add(r * hd + d) = acc;
            }
        }
    }
    R
}

/// Columns `d..d + C * L` of `R` output rows: `o[r] += Σ_i p[r][i] · v_i`.
///
/// # Safety
/// As [`weighted_values`]; `d + C * L <= hd`; `R * KEY_TILE` f32 readable at `p`, `R * hd`
/// read-writable at `o`, every value `hd` long.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn value_block<const R: usize, const C: usize, E: KvElem>(
    p: *const f32,
    values: &[&[E]],
    hd: usize,
    o: *mut f32,
    d: usize,
) {
    // SAFETY: the contract bounds every access.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(o.add(r * hd + d + c * L));
            }
        }
        for (i, v) in values.iter().enumerate() {
            let vv: [__m512; C] = std::array::from_fn(|c| load16(v.as_ptr().add(d + c * L)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*p.add(r * KEY_TILE + i));
                for (a, vc) in acc.iter_mut().zip(&vv) {
                    *a = _mm512_fmadd_ps(x, *vc, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.add(r * hd + d + c * L), *a);
            }
        }
    }
}
