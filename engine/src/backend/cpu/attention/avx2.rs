//! The attention kernels in AVX2 + FMA intrinsics (8 f32 lanes): the products register-
//! blocked as [`ROW_BLOCK`] query vectors × 2 keys (scores) and × 16 head dimensions
//! (weighted values), eight accumulators each so both FMA pipes stay busy, and `exp2` as a
//! polynomial on whole vectors. The compiler's own vectorisation of the portable kernels
//! ([`super::portable`]) spilled and used 128-bit operations, hence these.
//!
//! Every function requires a CPU with AVX2 and FMA; the caller checks it once
//! ([`super::Isa`]). Slice lengths are asserted on entry, so the pointer reads inside stay
//! within them.

use std::arch::x86_64::*;

use super::{KEY_TILE, LANES, ROW_BLOCK};

/// `s[m][i] = q[m] · k_i` for query vectors `m < queries` (rows of `q`, `hd` each) and the
/// tile's keys (`keys.len() <= KEY_TILE`, `hd` each); `s` is `[queries, KEY_TILE]`.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores(q: &[f32], hd: usize, queries: usize, keys: &[&[f32]], s: &mut [f32]) {
    assert!(q.len() >= queries * hd && s.len() >= queries * KEY_TILE && keys.len() <= KEY_TILE);
    assert!(keys.iter().all(|k| k.len() == hd));
    let mut m = 0;
    // SAFETY: rows m..m+R of `q` and of `s` are in bounds (asserted above, m + R <= queries).
    unsafe {
        while m < queries {
            // Blocks of 4, then one of 2 and one of 1 (a decode step has `group` vectors).
            let r = match queries - m {
                1 => {
                    score_block::<1>(
                        q.as_ptr().add(m * hd),
                        hd,
                        keys,
                        s.as_mut_ptr().add(m * KEY_TILE),
                    );
                    1
                }
                2 | 3 => {
                    score_block::<2>(
                        q.as_ptr().add(m * hd),
                        hd,
                        keys,
                        s.as_mut_ptr().add(m * KEY_TILE),
                    );
                    2
                }
                _ => {
                    score_block::<ROW_BLOCK>(
                        q.as_ptr().add(m * hd),
                        hd,
                        keys,
                        s.as_mut_ptr().add(m * KEY_TILE),
                    );
                    ROW_BLOCK
                }
            };
            m += r;
        }
    }
}

/// [`scores`] for `R` query vectors at `q` (stride `hd`), writing rows at `s` (stride
/// `KEY_TILE`).
///
/// # Safety
/// AVX2 + FMA; `R * hd` f32 readable at `q`, `R * KEY_TILE` writable at `s`, every key `hd` long.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn score_block<const R: usize>(q: *const f32, hd: usize, keys: &[&[f32]], s: *mut f32) {
    let full = hd / LANES * LANES;
    let mut i = 0;
    while i < keys.len() {
        let pair = keys.len() - i >= 2;
        let k0 = keys[i].as_ptr();
        let k1 = if pair { keys[i + 1].as_ptr() } else { k0 };
        // SAFETY: d + LANES <= full <= hd for the vector loads of q's rows and both keys; the
        // tail reads d < hd; writes go to s[r * KEY_TILE + i (+1)] with i + 1 < KEY_TILE.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let mut d = 0;
            while d < full {
                let a = _mm256_loadu_ps(k0.add(d));
                let b = _mm256_loadu_ps(k1.add(d));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(q.add(r * hd + d));
                    acc[0] = _mm256_fmadd_ps(x, a, acc[0]);
                    acc[1] = _mm256_fmadd_ps(x, b, acc[1]);
                }
                d += LANES;
            }
            for (r, acc) in acc.iter().enumerate() {
                let mut dot = [hsum(acc[0]), hsum(acc[1])];
                for d in full..hd {
                    let x = *q.add(r * hd + d);
                    dot[0] = x.mul_add(*k0.add(d), dot[0]);
                    dot[1] = x.mul_add(*k1.add(d), dot[1]);
                }
                *s.add(r * KEY_TILE + i) = dot[0];
                if pair {
                    *s.add(r * KEY_TILE + i + 1) = dot[1];
                }
            }
        }
        i += if pair { 2 } else { 1 };
    }
}

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// Fold one tile's scores of one query vector (`s`, `KEY_TILE` base-2 exponents) into its
/// running softmax: `s` becomes the tile's weights (0 for keys at or past `visible`), `o`
/// (`hd` accumulators) and `sum` are rescaled to the new max.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
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
#[target_feature(enable = "avx2,fma")]
fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// `2^x` per lane for `x <= 0`, as [`super::portable`]'s `exp2_lanes` (same polynomial).
#[inline]
#[target_feature(enable = "avx2,fma")]
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
/// # Safety
/// The CPU must have AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_values(
    p: &[f32],
    values: &[&[f32]],
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
            // Blocks of 4, then one of 2 and one of 1 (a decode step has `group` vectors).
            let r = match queries - m {
                1 => {
                    value_block::<1>(
                        p.as_ptr().add(m * KEY_TILE),
                        values,
                        hd,
                        o.as_mut_ptr().add(m * hd),
                    );
                    1
                }
                2 | 3 => {
                    value_block::<2>(
                        p.as_ptr().add(m * KEY_TILE),
                        values,
                        hd,
                        o.as_mut_ptr().add(m * hd),
                    );
                    2
                }
                _ => {
                    value_block::<ROW_BLOCK>(
                        p.as_ptr().add(m * KEY_TILE),
                        values,
                        hd,
                        o.as_mut_ptr().add(m * hd),
                    );
                    ROW_BLOCK
                }
            };
            m += r;
        }
    }
}

/// [`weighted_values`] for `R` query vectors: weights at `p` (stride `KEY_TILE`), outputs at
/// `o` (stride `hd`).
///
/// # Safety
/// AVX2 + FMA; `R * KEY_TILE` f32 readable at `p`, `R * hd` read-writable at `o`, every value
/// `hd` long.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn value_block<const R: usize>(p: *const f32, values: &[&[f32]], hd: usize, o: *mut f32) {
    let mut d = 0;
    // SAFETY: vector accesses cover d..d + 16 <= hd (then d..d + 8 <= hd) of each output row
    // and value; the scalar rest stays below hd; weights are read at i < values.len() <= KEY_TILE.
    unsafe {
        while d + 2 * LANES <= hd {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[0] = _mm256_loadu_ps(o.add(r * hd + d));
                acc[1] = _mm256_loadu_ps(o.add(r * hd + d + LANES));
            }
            for (i, v) in values.iter().enumerate() {
                let a = _mm256_loadu_ps(v.as_ptr().add(d));
                let b = _mm256_loadu_ps(v.as_ptr().add(d + LANES));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*p.add(r * KEY_TILE + i));
                    acc[0] = _mm256_fmadd_ps(x, a, acc[0]);
                    acc[1] = _mm256_fmadd_ps(x, b, acc[1]);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(r * hd + d), acc[0]);
                _mm256_storeu_ps(o.add(r * hd + d + LANES), acc[1]);
            }
            d += 2 * LANES;
        }
        if d + LANES <= hd {
            let mut acc = [_mm256_setzero_ps(); R];
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_loadu_ps(o.add(r * hd + d));
            }
            for (i, v) in values.iter().enumerate() {
                let a = _mm256_loadu_ps(v.as_ptr().add(d));
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*p.add(r * KEY_TILE + i)), a, *acc);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(r * hd + d), *acc);
            }
            d += LANES;
        }
        for d in d..hd {
            for r in 0..R {
                let mut acc = *o.add(r * hd + d);
                for (i, v) in values.iter().enumerate() {
                    acc = (*p.add(r * KEY_TILE + i)).mul_add(v[d], acc);
                }
                *o.add(r * hd + d) = acc;
            }
        }
    }
}
