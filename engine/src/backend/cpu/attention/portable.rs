//! The portable attention kernels: 8-lane arrays the compiler vectorises as it can, for CPUs
//! without AVX2 + FMA (and off x86-64). Same blocking and same results, up to rounding, as
//! [`super::avx2`]; what they compute is documented on the functions of both.

use super::{EXP2_POLY, KEY_TILE, LANES, Lanes, ROW_BLOCK};
use crate::backend::cpu::KvElem;

/// Whether `mul_add` may be used: only where it is a native instruction of the baseline
/// target (on x86-64 without FMA it would be a library call per element).
const FMA: bool = cfg!(target_arch = "aarch64");

/// `a * b + c`, fused where the target has it.
#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `s[m][i] = q[m] · k_i` for every query vector m and key i of the tile, register-blocked
/// over [`ROW_BLOCK`] query vectors × 2 keys.
pub(super) fn scores<E: KvElem>(
    q: &[f32],
    hd: usize,
    queries: usize,
    keys: &[&[E]],
    s: &mut [f32],
) {
    let mut m = 0;
    while m < queries {
        // Blocks of 4, then one of 2 and one of 1 (a decode step has `group` vectors).
        let r = match queries - m {
            1 => {
                score_block::<1, E>(q, hd, m, keys, s);
                1
            }
            2 | 3 => {
                score_block::<2, E>(q, hd, m, keys, s);
                2
            }
            _ => {
                score_block::<ROW_BLOCK, E>(q, hd, m, keys, s);
                ROW_BLOCK
            }
        };
        m += r;
    }
}

/// [`scores`] for query vectors `m0..m0 + R`.
#[inline(always)]
fn score_block<const R: usize, E: KvElem>(
    q: &[f32],
    hd: usize,
    m0: usize,
    keys: &[&[E]],
    s: &mut [f32],
) {
    let qs: [&[f32]; R] = std::array::from_fn(|r| &q[(m0 + r) * hd..][..hd]);
    let full = hd / LANES * LANES;
    let mut i = 0;
    while i < keys.len() {
        let pair = keys.len() - i >= 2;
        let (k0, k1) = (keys[i], if pair { keys[i + 1] } else { keys[i] });
        let mut acc = [[[0.0f32; LANES]; 2]; R];
        let mut d = 0;
        while d < full {
            let a: Lanes = std::array::from_fn(|l| k0[d + l].to_f32());
            let b: Lanes = std::array::from_fn(|l| k1[d + l].to_f32());
            for r in 0..R {
                let x: &Lanes = qs[r][d..d + LANES].try_into().unwrap();
                for l in 0..LANES {
                    acc[r][0][l] = fma(x[l], a[l], acc[r][0][l]);
                    acc[r][1][l] = fma(x[l], b[l], acc[r][1][l]);
                }
            }
            d += LANES;
        }
        for r in 0..R {
            let mut dot = [hsum(&acc[r][0]), hsum(&acc[r][1])];
            for d in full..hd {
                dot[0] = fma(qs[r][d], k0[d].to_f32(), dot[0]);
                dot[1] = fma(qs[r][d], k1[d].to_f32(), dot[1]);
            }
            s[(m0 + r) * KEY_TILE + i] = dot[0];
            if pair {
                s[(m0 + r) * KEY_TILE + i + 1] = dot[1];
            }
        }
        i += if pair { 2 } else { 1 };
    }
}

/// Sum of the lanes, pairwise (the order the SIMD reduction uses).
#[inline(always)]
fn hsum(v: &Lanes) -> f32 {
    let a: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    (a[0] + a[2]) + (a[1] + a[3])
}

/// Fold one tile's scores of one query vector into its running softmax: `s` becomes the
/// tile's weights (0 for keys past `visible`), `o` and `sum` are rescaled to the new max.
pub(super) fn softmax_step(
    s: &mut [f32],
    visible: usize,
    max: &mut f32,
    sum: &mut f32,
    o: &mut [f32],
) {
    let s: &mut [f32; KEY_TILE] = s.try_into().unwrap();
    if visible == 0 {
        s.fill(0.0);
        return;
    }
    let mut tile_max = f32::NEG_INFINITY;
    for &x in &s[..visible] {
        tile_max = tile_max.max(x);
    }
    let new_max = max.max(tile_max);
    let mut weights = [0.0f32; KEY_TILE];
    for h in 0..2 {
        let mut x: Lanes = s[h * LANES..][..LANES].try_into().unwrap();
        for v in &mut x {
            *v -= new_max;
        }
        let e = exp2_lanes(x);
        weights[h * LANES..][..LANES].copy_from_slice(&e);
    }
    let mut tile_sum = 0.0;
    for (i, (dst, &w)) in s.iter_mut().zip(&weights).enumerate() {
        *dst = if i < visible { w } else { 0.0 };
        tile_sum += *dst;
    }
    if new_max > *max {
        // The first tile of a vector has max = -inf: its correction is 0 on an empty state.
        let correction = exp2_lanes([*max - new_max; LANES])[0];
        *sum *= correction;
        for x in o.iter_mut() {
            *x *= correction;
        }
        *max = new_max;
    }
    *sum += tile_sum;
}

/// `o[m] += Σ_i p[m][i] · v_i` over the tile, register-blocked over [`ROW_BLOCK`] query
/// vectors × 2 lane groups of the head dimension.
pub(super) fn weighted_values<E: KvElem>(
    p: &[f32],
    values: &[&[E]],
    hd: usize,
    queries: usize,
    o: &mut [f32],
) {
    let mut m = 0;
    while m < queries {
        // Blocks of 4, then one of 2 and one of 1 (a decode step has `group` vectors).
        let r = match queries - m {
            1 => {
                value_block::<1, E>(p, values, hd, m, o);
                1
            }
            2 | 3 => {
                value_block::<2, E>(p, values, hd, m, o);
                2
            }
            _ => {
                value_block::<ROW_BLOCK, E>(p, values, hd, m, o);
                ROW_BLOCK
            }
        };
        m += r;
    }
}

/// [`weighted_values`] for query vectors `m0..m0 + R`.
#[inline(always)]
fn value_block<const R: usize, E: KvElem>(
    p: &[f32],
    values: &[&[E]],
    hd: usize,
    m0: usize,
    o: &mut [f32],
) {
    let w: [&[f32]; R] = std::array::from_fn(|r| &p[(m0 + r) * KEY_TILE..][..KEY_TILE]);
    let mut d = 0;
    while d + 2 * LANES <= hd {
        let mut acc = [[[0.0f32; LANES]; 2]; R];
        for r in 0..R {
            for h in 0..2 {
                acc[r][h].copy_from_slice(&o[(m0 + r) * hd + d + h * LANES..][..LANES]);
            }
        }
        for (i, v) in values.iter().enumerate() {
            let a: Lanes = std::array::from_fn(|l| v[d + l].to_f32());
            let b: Lanes = std::array::from_fn(|l| v[d + LANES + l].to_f32());
            for r in 0..R {
                let x = w[r][i];
                for l in 0..LANES {
                    acc[r][0][l] = fma(x, a[l], acc[r][0][l]);
                    acc[r][1][l] = fma(x, b[l], acc[r][1][l]);
                }
            }
        }
        for r in 0..R {
            for h in 0..2 {
                o[(m0 + r) * hd + d + h * LANES..][..LANES].copy_from_slice(&acc[r][h]);
            }
        }
        d += 2 * LANES;
    }
    // Head dims that are not a multiple of 16 (none of Qwen3's): the rest one at a time.
    for d in d..hd {
        for r in 0..R {
            let mut acc = o[(m0 + r) * hd + d];
            for (i, v) in values.iter().enumerate() {
                acc = fma(w[r][i], v[d].to_f32(), acc);
            }
            o[(m0 + r) * hd + d] = acc;
        }
    }
}

/// `2^x` per lane for `x <= 0` (larger inputs are not needed here and not supported).
/// Inputs below -126 give `2^-126` (≈ 1.2e-38), which is 0 for a softmax weight; relative
/// error ≤ 2e-7 otherwise ([`EXP2_POLY`] on the fraction in [-0.5, 0.5]).
#[inline(always)]
pub(super) fn exp2_lanes(x: Lanes) -> Lanes {
    // Adding 1.5 · 2^23 rounds to an integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let mut r = [0.0f32; LANES];
    for l in 0..LANES {
        let x = x[l].max(-126.0);
        let big = x + ROUND;
        let n = big - ROUND;
        let f = x - n;
        let int = (big.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
        let mut p = EXP2_POLY[6];
        for c in EXP2_POLY[..6].iter().rev() {
            p = p * f + c;
        }
        p = p * f + 1.0;
        r[l] = p * f32::from_bits(((int + 127) << 23) as u32);
    }
    r
}
