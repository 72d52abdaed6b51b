//! The attention kernels in AVX2 + FMA intrinsics (8 f32 lanes): the products register-
//! blocked with eight accumulators in every block ([`ROW_BLOCK`] query vectors × 2 keys or
//! × 16 head dimensions, 2 × 4 or × 32, 1 × 8 or × 64) so both FMA pipes stay busy, and
//! `exp2` as a polynomial on whole vectors. The compiler's own vectorisation of the portable kernels
//! ([`super::portable`]) spilled and used 128-bit operations, hence these.
//!
//! Cached K and V are read in their stored type and widened in registers ([`load8`]).
//!
//! Every function requires a CPU with AVX2, FMA and F16C, the matrix kernels' instruction set
//! (`Isa::Avx2`, whose horizontal sum it shares); the caller checks it once. Slice lengths
//! are asserted on entry, so the pointer reads inside stay within them.

use std::arch::x86_64::*;

use super::super::convert::avx2::hsum;
use super::{KEY_TILE, LANES, ROW_BLOCK};
use crate::backend::cpu::KvElem;
use crate::weights::DType;

/// Eight cached K or V values at `p`, widened to f32: a plain load for f32, F16C's convert
/// for f16, a 16-bit shift for bf16 (its bits are an f32's upper half). The branch is on a
/// constant of the type, so each instance compiles to one of the three.
///
/// # Safety
/// AVX2 + F16C; eight values readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<E: KvElem>(p: *const E) -> __m256 {
    // SAFETY: the contract: 8 elements of E (32 or 16 bytes) are readable at `p`.
    unsafe {
        match E::DTYPE {
            DType::F32 => _mm256_loadu_ps(p.cast()),
            DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            DType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
        }
    }
}

/// `s[m][i] = q[m] · k_i` for query vectors `m < queries` (rows of `q`, `hd` each) and the
/// tile's keys (`keys.len() <= KEY_TILE`, `hd` each); `s` is `[queries, KEY_TILE]`.
///
/// Blocks of [`ROW_BLOCK`] vectors × 2 keys, then (a decode step's GQA group of 2, or the
/// rest) 2 vectors × 4 keys and 1 × 8: always eight accumulators, so both FMA pipes have
/// independent chains to work on.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
                2 | 3 => score_rows::<2, 4, E>(q, hd, keys, s),
                _ => score_rows::<ROW_BLOCK, 2, E>(q, hd, keys, s),
            };
        }
    }
}

/// [`scores`] for `R` query vectors at `q` (stride `hd`) over all the tile's keys, `K` keys
/// at a time and the rest one by one, writing rows at `s` (stride `KEY_TILE`). Returns `R`.
///
/// # Safety
/// AVX2 + FMA + F16C; `R * hd` f32 readable at `q`, `R * KEY_TILE` writable at `s`, every key `hd` long.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
/// AVX2 + FMA + F16C; `R * hd` f32 readable at `q`, `keys.len() == K` keys of `hd`, the `R × K`
/// outputs writable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_block<const R: usize, const K: usize, E: KvElem>(
    q: *const f32,
    hd: usize,
    keys: &[&[E]],
    s: *mut f32,
) {
    let full = hd / LANES * LANES;
    let k: [*const E; K] = std::array::from_fn(|j| keys[j].as_ptr());
    // SAFETY: d + LANES <= full <= hd for the vector loads of q's rows and the keys; the tail
    // reads d < hd; writes go to the R × K outputs (contract).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); K]; R];
        let mut d = 0;
        while d < full {
            let kv: [__m256; K] = std::array::from_fn(|j| load8(k[j].add(d)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(q.add(r * hd + d));
                for (a, kj) in acc.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(x, *kj, *a);
                }
            }
            d += LANES;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                let mut dot = hsum(*a);
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
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn softmax_step(
    s: &mut [f32],
    visible: usize,
    max: &mut f32,
    sum: &mut f32,
    o: &mut [f32],
) {
    assert!(s.len() == KEY_TILE && visible <= KEY_TILE);
    // SAFETY: `s` holds exactly two vectors (asserted); `o` is read and written below its
    // length (vector loop to len / 8 * 8, scalar rest).
    unsafe {
        if visible == 0 {
            _mm256_storeu_ps(s.as_mut_ptr(), _mm256_setzero_ps());
            _mm256_storeu_ps(s.as_mut_ptr().add(LANES), _mm256_setzero_ps());
            return;
        }
        let limit = _mm256_set1_epi32(visible as i32);
        let lo_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let hi_idx = _mm256_add_epi32(lo_idx, _mm256_set1_epi32(LANES as i32));
        // Lanes at or past `visible` are masked: all ones where the key is visible.
        let lo_vis = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lo_idx));
        let hi_vis = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, hi_idx));
        let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
        let lo = _mm256_loadu_ps(s.as_ptr());
        let hi = _mm256_loadu_ps(s.as_ptr().add(LANES));
        let m = _mm256_max_ps(
            _mm256_blendv_ps(neg_inf, lo, lo_vis),
            _mm256_blendv_ps(neg_inf, hi, hi_vis),
        );
        let new_max = max.max(hmax(m));
        let nm = _mm256_set1_ps(new_max);
        let lo = _mm256_and_ps(exp2(_mm256_sub_ps(lo, nm)), lo_vis);
        let hi = _mm256_and_ps(exp2(_mm256_sub_ps(hi, nm)), hi_vis);
        _mm256_storeu_ps(s.as_mut_ptr(), lo);
        _mm256_storeu_ps(s.as_mut_ptr().add(LANES), hi);
        if new_max > *max {
            // The first tile of a vector has max = -inf: its correction is 0 on an empty state.
            let c = exp2(_mm256_set1_ps(*max - new_max));
            *sum *= _mm256_cvtss_f32(c);
            let n = o.len() / LANES * LANES;
            let p = o.as_mut_ptr();
            let mut d = 0;
            while d < n {
                _mm256_storeu_ps(p.add(d), _mm256_mul_ps(_mm256_loadu_ps(p.add(d)), c));
                d += LANES;
            }
            for x in &mut o[n..] {
                *x *= _mm256_cvtss_f32(c);
            }
            *max = new_max;
        }
        *sum += hsum(_mm256_add_ps(lo, hi));
    }
}

/// Largest of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// `2^x` per lane for `x <= 0`, as [`super::portable`]'s `exp2_lanes` (same polynomial).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp2(x: __m256) -> __m256 {
    const ROUND: f32 = 12_582_912.0;
    let x = _mm256_max_ps(x, _mm256_set1_ps(-126.0));
    let round = _mm256_set1_ps(ROUND);
    let big = _mm256_add_ps(x, round);
    let f = _mm256_sub_ps(x, _mm256_sub_ps(big, round));
    let int = _mm256_sub_epi32(_mm256_castps_si256(big), _mm256_castps_si256(round));
    let mut p = _mm256_set1_ps(super::EXP2_POLY[6]);
    for &c in super::EXP2_POLY[..6].iter().rev() {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0));
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(int, _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(scale))
}

/// `o[m] += Σ_i p[m][i] · v_i` for query vectors `m < queries` (`o` is `[queries, hd]`, `p`
/// is `[queries, KEY_TILE]`) over the tile's values (`values.len() <= KEY_TILE`, `hd` each).
///
/// Blocks of [`ROW_BLOCK`] vectors × 16 dimensions, then 2 × 32 and 1 × 64: eight
/// accumulators, as in [`scores`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
                2 | 3 => value_rows::<2, 4, E>(p, values, hd, o),
                _ => value_rows::<ROW_BLOCK, 2, E>(p, values, hd, o),
            };
        }
    }
}

/// [`weighted_values`] for `R` query vectors (weights at `p`, stride `KEY_TILE`; outputs at
/// `o`, stride `hd`): `C` lane groups of the head dimension at a time, then one, then the
/// scalar rest. Returns `R`.
///
/// # Safety
/// AVX2 + FMA + F16C; `R * KEY_TILE` f32 readable at `p`, `R * hd` read-writable at `o`, every value
/// `hd` long.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_rows<const R: usize, const C: usize, E: KvElem>(
    p: *const f32,
    values: &[&[E]],
    hd: usize,
    o: *mut f32,
) -> usize {
    let mut d = 0;
    // SAFETY: each block covers columns d..d + C * LANES <= hd (then d + LANES <= hd); the
    // scalar rest stays below hd; weights are read at i < values.len() <= KEY_TILE.
    unsafe {
        while d + C * LANES <= hd {
            value_block::<R, C, E>(p, values, hd, o, d);
            d += C * LANES;
        }
        while d + LANES <= hd {
            value_block::<R, 1, E>(p, values, hd, o, d);
            d += LANES;
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

/// Columns `d..d + C * LANES` of `R` output rows: `o[r] += Σ_i p[r][i] · v_i`.
///
/// # Safety
/// AVX2 + FMA + F16C; `d + C * LANES <= hd`; `R * KEY_TILE` f32 readable at `p`, `R * hd`
/// read-writable at `o`, every value `hd` long.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_block<const R: usize, const C: usize, E: KvElem>(
    p: *const f32,
    values: &[&[E]],
    hd: usize,
    o: *mut f32,
    d: usize,
) {
    // SAFETY: the contract bounds every access.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(o.add(r * hd + d + c * LANES));
            }
        }
        for (i, v) in values.iter().enumerate() {
            let vv: [__m256; C] = std::array::from_fn(|c| load8(v.as_ptr().add(d + c * LANES)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*p.add(r * KEY_TILE + i));
                for (a, vc) in acc.iter_mut().zip(&vv) {
                    *a = _mm256_fmadd_ps(x, *vc, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(r * hd + d + c * LANES), *a);
            }
        }
    }
}
