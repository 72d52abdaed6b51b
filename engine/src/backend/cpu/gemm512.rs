//! The large-batch (prefill) matrix product `out = x · Wᵀ` on AVX-512: a register-blocked
//! micro-kernel of [`MR`] activation rows × [`NR`] weight rows (24 accumulators of 16 lanes),
//! over operands packed so that its inner loop reads both sequentially.
//!
//! - The activations are packed once per call ([`pack_x_panel`]): panels of `MR` rows, depth-major,
//!   so the kernel broadcasts `MR` consecutive floats per step of depth.
//! - Each weight tile is converted from its stored dtype and packed in one pass
//!   ([`pack_w`]): panels of `NR` rows, depth-major, two 16-lane vectors per step.
//! - The depth is walked in blocks of [`KC`] so that a weight panel's block (32 KiB) stays in
//!   L1 while every activation panel of the task passes over it; the partial sums of later
//!   blocks are added to the output.
//!
//! [`super::linear`] decides when this path runs (AVX-512 hosts, batches above the streaming
//! threshold) and how the work is cut into tiles; this file owns only the packing and the
//! kernel. Everything here requires AVX-512 F + BW + VL with AVX2 + FMA + F16C
//! ([`super::isa::Isa::Avx512`]); the caller checks it once.

use std::arch::x86_64::*;

use super::convert::{self, dcode};
use crate::weights::DType;

/// Activation rows per micro-tile.
pub(super) const MR: usize = 12;
/// Weight rows (output columns) per micro-tile: two 16-lane vectors.
pub(super) const NR: usize = 32;
/// Depth per block: a weight panel's block is `KC * NR * 4` = 32 KiB.
const KC: usize = 256;

/// Length of `rows` activation rows of depth `k` packed panel by panel ([`pack_x_panel`]).
pub(super) fn packed_x_len(rows: usize, k: usize) -> usize {
    rows.div_ceil(MR) * MR * k
}

/// Pack panel `p` of `x` (`[rows, k]` row-major) into `dst` (`MR * k` f32): depth `d`, row
/// `i` at `d * MR + i`, i.e. `pack_x`'s layout is panel `p` at `p * MR * k`; rows past `rows`
/// are zero.
pub(super) fn pack_x_panel(x: &[f32], rows: usize, k: usize, p: usize, dst: &mut [f32]) {
    assert_eq!(x.len(), rows * k);
    assert_eq!(dst.len(), MR * k);
    for i in 0..MR {
        let r = p * MR + i;
        if r < rows {
            for (d, &v) in x[r * k..][..k].iter().enumerate() {
                dst[d * MR + i] = v;
            }
        } else {
            for d in 0..k {
                dst[d * MR + i] = 0.0;
            }
        }
    }
}

/// Length of `nt` weight rows of depth `k` packed by [`pack_w`].
pub(super) fn packed_w_len(nt: usize, k: usize) -> usize {
    nt.div_ceil(NR) * NR * k
}

/// Convert `nt` weight rows of `dtype` (`bytes`, row-major, `k` per row) to f32 and pack them
/// into `dst` (length [`packed_w_len`]): panel `q`, depth `d`, row `j` at `(q * k + d) * NR +
/// j`; rows past `nt` are zero. `row` is scratch of `k` f32.
///
/// # Safety
/// The CPU must have AVX-512 F + BW + VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn pack_w(
    dtype: DType,
    bytes: &[u8],
    nt: usize,
    k: usize,
    row: &mut [f32],
    dst: &mut [f32],
) {
    let es = dtype.size_in_bytes();
    assert!(bytes.len() >= nt * k * es && row.len() == k);
    assert_eq!(dst.len(), packed_w_len(nt, k));
    for (q, panel) in dst.chunks_exact_mut(NR * k).enumerate() {
        for j in 0..NR {
            let o = q * NR + j;
            if o >= nt {
                for d in 0..k {
                    panel[d * NR + j] = 0.0;
                }
                continue;
            }
            // SAFETY: the CPU has this module's features (the contract); row `o` < nt holds
            // `k` elements inside `bytes` (asserted) and `row` has exactly `k` slots.
            unsafe {
                convert::avx512::convert(
                    dcode(dtype),
                    bytes[o * k * es..].as_ptr(),
                    row.as_mut_ptr(),
                    k,
                )
            };
            for (d, &v) in row.iter().enumerate() {
                panel[d * NR + j] = v;
            }
        }
    }
}

/// `out[r][o] = x[r] · w[o]` for the task's activation panels `panels` (of the packed `xp`)
/// and every row of one packed weight tile `wp` (`nt` rows, depth `k`). `out` points at the
/// tile's first column of row 0 (row stride `ldo`); only rows below `rows` are written.
///
/// # Safety
/// The CPU must have AVX-512 F + BW + VL, AVX2, FMA and F16C; `xp` and `wp` are packed as
/// [`pack_x_panel`] / [`pack_w`] with depth `k`; `out` is writable at `r * ldo + o` for every
/// `r < rows` in the panels and `o < nt`, and no other thread writes those elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_tile(
    xp: &[f32],
    panels: std::ops::Range<usize>,
    rows: usize,
    k: usize,
    wp: &[f32],
    nt: usize,
    out: *mut f32,
    ldo: usize,
) {
    assert!(panels.end * MR * k <= xp.len());
    assert!(wp.len() >= packed_w_len(nt, k));
    let wpanels = nt.div_ceil(NR);
    let mut d0 = 0;
    while d0 < k {
        let kc = KC.min(k - d0);
        for q in 0..wpanels {
            let cols = NR.min(nt - q * NR);
            let mask = (lane_mask(cols.min(16)), lane_mask(cols.saturating_sub(16)));
            let b = &wp[(q * k + d0) * NR..][..kc * NR];
            for p in panels.clone() {
                let valid = MR.min(rows.saturating_sub(p * MR));
                let a = &xp[(p * k + d0) * MR..][..kc * MR];
                // SAFETY: features per the contract; `a` and `b` hold `kc` steps of depth of
                // one panel each (sliced above); the outputs are rows p * MR.. p * MR + valid
                // (< rows) and columns q * NR + (lanes in `mask`) (< nt), writable (contract).
                unsafe {
                    micro(
                        a,
                        b,
                        out.add(p * MR * ldo + q * NR),
                        ldo,
                        valid,
                        mask,
                        d0 > 0,
                    )
                };
            }
        }
        d0 += kc;
    }
}

/// The lowest `n` of 16 lanes (`n <= 16`).
#[inline]
fn lane_mask(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// One micro-tile: `c[i][j] (+)= Σ_d a[d][i] · b[d][j]` over the depth block (`a` is
/// `[kc, MR]`, `b` is `[kc, NR]`), rows `i < rows` and columns in `mask` written to `c`
/// (row stride `ldc`), added to what is there when `accumulate`.
///
/// # Safety
/// The CPU features of this module; `c` writable (and readable when `accumulate`) at the
/// written positions.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn micro(
    a: &[f32],
    b: &[f32],
    c: *mut f32,
    ldc: usize,
    rows: usize,
    mask: (__mmask16, __mmask16),
    accumulate: bool,
) {
    let kc = b.len() / NR;
    debug_assert_eq!(a.len(), kc * MR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    // SAFETY: step d reads a[d * MR..][..MR] and b[d * NR..][..NR], d < kc (lengths above);
    // the stores touch rows < rows and the masked columns only (contract).
    unsafe {
        for d in 0..kc {
            let b0 = _mm512_loadu_ps(bp.add(d * NR));
            let b1 = _mm512_loadu_ps(bp.add(d * NR + 16));
            for (i, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*ap.add(d * MR + i));
                acc[0] = _mm512_fmadd_ps(x, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(x, b1, acc[1]);
            }
        }
        for (i, acc) in acc.iter().enumerate().take(rows) {
            let row = c.add(i * ldc);
            for (h, (&v, m)) in acc.iter().zip([mask.0, mask.1]).enumerate() {
                if m == 0 {
                    continue;
                }
                let p = row.add(h * 16);
                let v = if accumulate {
                    _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, p))
                } else {
                    v
                };
                _mm512_mask_storeu_ps(p, m, v);
            }
        }
    }
}
