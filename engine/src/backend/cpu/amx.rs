//! The large-batch matrix product `out = x · Wᵀ` on AMX tiles, for bf16 weights: prefill and
//! batched decode on hosts with AMX-BF16 (Intel Sapphire Rapids and later).
//!
//! `TDPBF16PS` multiplies a tile of 16 rows × 32 bf16 by a tile of 16 pairs-of-rows × 16
//! columns into 16 × 16 f32 accumulators. The weight matrix, row-major `[n, k]` as stored,
//! is already in the first operand's layout, so weight tiles are loaded straight from the
//! (memory-mapped) checkpoint with a row stride of `k` elements: no weight packing at all.
//! The activations become the second operand, packed once per call in the pair-interleaved
//! ("VNNI") layout, 1 KiB per 16 rows × 32 depth. The product is thus `outᵀ`, 16 weight rows
//! × 16 activation rows per accumulator tile, transposed into `out` when a tile's depth is
//! complete.
//!
//! Numerics: each activation is carried as two bf16 values, `hi` (the value rounded to bf16)
//! and `lo` (the remainder rounded to bf16), and every depth tile is multiplied twice, once
//! per half, into the same f32 accumulators. `hi + lo` holds 16 significant bits (relative
//! error ≤ 2⁻¹⁷), so the products agree with the f32 kernels within their tolerance and a
//! sequence's logits barely move when its batch grows past the streaming kernel's sizes;
//! rounding the activations to bf16 once (PyTorch's bf16 matmul) moves the bf16 test
//! checkpoint's logits by up to 1 % of the largest. The second product halves the tiles'
//! peak rate, which is far above what the loads feed them (docs/benchmarks.md).
//!
//! Blocking: 2 × 2 accumulator tiles (32 weight rows × 32 activation rows) use tiles 0–3,
//! the two weight tiles 4–5, the two activation tiles 6–7. The depth is walked in blocks of
//! [`KC`] so that a pair of weight tiles' block (32 rows × `KC` bf16, 32 KiB) stays in L1
//! while every activation block passes over it; partial sums of a block are kept in a
//! per-task f32 buffer (in the tiles' own layout) and loaded back for the next block.
//!
//! [`super::linear`] decides when this path runs (bf16 weights, enough rows, tile-aligned
//! shapes); this file owns the packing, the tile configuration and the kernel. Everything
//! here requires AMX-BF16 + AMX-TILE with the process's permission to use the tile state,
//! and AVX-512 with AVX512-BF16 ([`super::isa::Isa::Amx`]); the caller checks it once.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use rayon::prelude::*;

use super::matrix::WeightMatrix;
use crate::weights::DType;

/// Weight rows per tile (a tile's rows) and activation rows per tile (its f32 columns).
const T: usize = 16;
/// Depth per tile: 32 bf16 = one 64-byte tile row.
const TK: usize = 32;
/// Depth per block (a multiple of [`TK`]): a weight tile pair's block is 32 × 512 × 2 =
/// 32 KiB, inside L1d.
const KC: usize = 512;
/// Weight rows per task unit: one pair of weight tiles.
const NU: usize = 2 * T;

/// The fewest activation rows this path takes: below it the streaming kernel, which keeps the
/// activations in f32, is as fast (decode is bound by reading the weights).
pub(super) const MIN_ROWS: usize = 12;

/// Whether the product of `rows` activation rows with `w` runs here.
pub(super) fn fits(rows: usize, w: &WeightMatrix<'_>) -> bool {
    w.dtype == DType::BF16
        && rows >= MIN_ROWS
        && w.rows.is_multiple_of(T)
        && w.cols.is_multiple_of(TK)
}

/// The tile configuration: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    const fn full() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            // Bytes 16..32: each tile's bytes per row (u16, little-endian); 48..56: its rows.
            c[16 + 2 * t] = 64;
            c[48 + t] = T as u8;
            t += 1;
        }
        TileConfig(c)
    }
}

static CONFIG: TileConfig = TileConfig::full();

thread_local! {
    /// The calling thread's packed activations (taken out while a call uses them).
    static XPACK: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// Partial sums of the calling rayon thread's current weight tile pair.
    static ACC: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Pack activation rows `rb * 16..` (a block of 16; rows past `rows` are zero) of `x`
/// (`[rows, k]` f32) into `dst` as two bf16 halves per value: `hi` = x rounded to bf16 and
/// `lo` = (x − hi) rounded to bf16, so `hi + lo` carries 16 significant bits. Depth tile
/// `kb` holds the `hi` tile then the `lo` tile, each 1 KiB in the second operand's layout:
/// pair `p`, row `j`, element `e` at `p * 32 + j * 2 + e`.
///
/// # Safety
/// The CPU must have AVX-512 F and AVX512-BF16; `k` is a multiple of 32 and `dst` holds
/// `2 * 16 * k` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_x_block(x: &[f32], rows: usize, k: usize, rb: usize, dst: &mut [u16]) {
    assert!(k.is_multiple_of(TK) && dst.len() == 2 * T * k && x.len() == rows * k);
    // Lane p of a row's 16 pairs goes to tile row p: 16 u32 apart.
    let index = _mm512_setr_epi32(
        0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240,
    );
    let base = dst.as_mut_ptr() as *mut u32;
    for j in 0..T {
        let r = rb * T + j;
        for kb in 0..k / TK {
            // SAFETY: elements kb * 32..kb * 32 + 32 of row r < rows lie in `x`; the scatters
            // write u32 j + 16 p (p < 16) of the two 256-u32 tiles of depth tile kb, inside
            // `dst` (2 * 16 * k u16 = k / 32 * 512 u32).
            unsafe {
                let (hi, lo) = if r < rows {
                    let src = x.as_ptr().add(r * k + kb * TK);
                    let (a, b) = (_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)));
                    // 16-bit lanes 0..16 are a's values, 16..32 b's: as u32 lanes, lane p
                    // is the pair (x[2p], x[2p + 1]) of the 32 values.
                    let hi: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
                    let lo = _mm512_cvtne2ps_pbh(
                        _mm512_sub_ps(b, widen(_mm512_extracti64x4_epi64::<1>(hi))),
                        _mm512_sub_ps(a, widen(_mm512_castsi512_si256(hi))),
                    );
                    (hi, std::mem::transmute::<__m512bh, __m512i>(lo))
                } else {
                    (_mm512_setzero_si512(), _mm512_setzero_si512())
                };
                let tile = base.add(kb * 2 * 256 + j);
                _mm512_i32scatter_epi32::<4>(tile as *mut _, index, hi);
                _mm512_i32scatter_epi32::<4>(tile.add(256) as *mut _, index, lo);
            }
        }
    }
}

/// 16 bf16 values to f32: a shift into the high half of each 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn widen(v: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// `out[r][o] = sum_i x[r][i] * w[o][i]` on AMX: x is `[rows, w.cols]` f32, out `[rows,
/// w.rows]`, `w` bf16 with [`fits`] true.
///
/// # Safety
/// The CPU must have AMX-BF16 and AMX-TILE and the process the kernel's permission for the
/// tile data state ([`super::isa::Isa::Amx`] available).
pub(super) unsafe fn linear(x: &[f32], rows: usize, w: WeightMatrix<'_>, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert!(fits(rows, &w), "amx::linear: shape not tile-aligned");
    assert_eq!(x.len(), rows * k);
    assert_eq!(out.len(), rows * n);
    assert_eq!(w.bytes.len(), n * k * 2);
    let rblocks = rows.div_ceil(T);

    // Taken out of the thread-local, so a nested call on this thread (work stealing) finds
    // it empty instead of borrowed.
    let mut xp = XPACK.take();
    xp.resize(rblocks * 2 * T * k, 0);
    xp.par_chunks_mut(2 * T * k)
        .enumerate()
        // SAFETY: AVX-512 with AVX512-BF16 is part of `Isa::Amx` (the contract); `k` is a
        // multiple of 32 (`fits`) and each chunk is one block's 2 * 16 * k values.
        .for_each(|(rb, dst)| unsafe { pack_x_block(x, rows, k, rb, dst) });

    // Tasks: runs of weight tile pairs (the last unit may be a single tile), a few per thread.
    let units = n.div_ceil(NU);
    let threads = rayon::current_num_threads();
    let per_task = units.div_ceil(4 * threads).max(1);
    let tasks = units.div_ceil(per_task);
    let out_ptr = super::linear::OutPtr::new(out);
    let run = |t: usize| {
        let u0 = t * per_task;
        let u1 = (u0 + per_task).min(units);
        ACC.with_borrow_mut(|acc| {
            acc.resize(rblocks * 2 * T * T, 0.0);
            // SAFETY: AMX is usable (the contract). Rows u0 * NU.. of the weight lie in
            // `w.bytes` (n * k bf16, asserted; n is a multiple of 16 and a unit's second tile
            // exists only when its rows do); `xp` holds `rblocks` packed blocks of depth `k`;
            // `acc` has room for `rblocks` pairs of 16 × 16 f32 tiles; this task writes
            // columns u0 * NU..min(u1 * NU, n) of `out` ([rows, n]), disjoint from other tasks.
            unsafe {
                asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
                for u in u0..u1 {
                    let o0 = u * NU;
                    let pair = o0 + NU <= n;
                    unit(&w, o0, pair, &xp, rows, k, acc, out_ptr.get(), n);
                }
                asm!("tilerelease", options(nostack, nomem));
            }
        });
    };
    if tasks == 1 || threads == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
    XPACK.set(xp);
}

/// One weight unit (rows `o0..o0 + 32`, or `o0..o0 + 16` when `!pair`) against every
/// activation block, depth block by depth block, then transposed into `out`.
///
/// # Safety
/// As the body of [`linear`]'s task, with the tile configuration loaded.
#[allow(clippy::too_many_arguments)]
unsafe fn unit(
    w: &WeightMatrix<'_>,
    o0: usize,
    pair: bool,
    xp: &[u16],
    rows: usize,
    k: usize,
    acc: &mut [f32],
    out: *mut f32,
    n: usize,
) {
    let rblocks = rows.div_ceil(T);
    let wrow = k * 2; // weight row stride in bytes
    let w0 = w.bytes.as_ptr().wrapping_add(o0 * wrow);
    let w1 = w0.wrapping_add(T * wrow);
    let accp = acc.as_mut_ptr();
    let mut kc0 = 0;
    while kc0 < k {
        let kc1 = (kc0 + KC).min(k);
        let first = kc0 == 0;
        let mut rb = 0;
        while rb < rblocks {
            let two = rb + 1 < rblocks;
            // Accumulators of (weight tile a, activation tile b) at acc[(rb + b) * 2 + a].
            let c = |a: usize, b: usize| accp.wrapping_add(((rb + b) * 2 + a) * T * T);
            let x0 = xp.as_ptr().wrapping_add(rb * 2 * T * k);
            let x1 = x0.wrapping_add(2 * T * k);
            // SAFETY: the pointers stay inside `w.bytes` (rows o0..o0 + 16, + 32 if `pair`,
            // depth < k), `xp` (blocks rb, rb + 1 if `two`) and `acc` (pairs of tiles of blocks
            // rb, rb + 1); the caller loaded the tile configuration.
            unsafe {
                if first {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        options(nostack, nomem)
                    );
                } else {
                    load_acc(c(0, 0), 0);
                    load_acc(c(1, 0), 1);
                    if two {
                        load_acc(c(0, 1), 2);
                        load_acc(c(1, 1), 3);
                    }
                }
                let mut kk = kc0;
                while kk < kc1 {
                    // Depth tile kk / 32: weights at byte kk * 2 of each row; the activation
                    // block's hi tile at u16 kk * 32, its lo tile 1 KiB further.
                    let (a0, a1) = (w0.add(kk * 2), w1.add(kk * 2));
                    let (h0, h1) = (
                        x0.add(kk * 2 * T) as *const u8,
                        x1.add(kk * 2 * T) as *const u8,
                    );
                    asm!(
                        "tileloadd tmm4, [{a} + {sa} * 1]",
                        "tileloadd tmm6, [{h} + {s} * 1]",
                        a = in(reg) a0, h = in(reg) h0, sa = in(reg) wrow, s = in(reg) 64usize,
                        options(nostack, readonly),
                    );
                    if pair {
                        asm!("tileloadd tmm5, [{a} + {sa} * 1]", a = in(reg) a1, sa = in(reg) wrow,
                            options(nostack, readonly));
                    }
                    if two {
                        asm!("tileloadd tmm7, [{h} + {s} * 1]", h = in(reg) h1, s = in(reg) 64usize,
                            options(nostack, readonly));
                    }
                    products(pair, two);
                    asm!("tileloadd tmm6, [{l} + {s} * 1]", l = in(reg) h0.add(1024), s = in(reg) 64usize,
                        options(nostack, readonly));
                    if two {
                        asm!("tileloadd tmm7, [{l} + {s} * 1]", l = in(reg) h1.add(1024), s = in(reg) 64usize,
                            options(nostack, readonly));
                    }
                    products(pair, two);
                    kk += TK;
                }
                store_acc(c(0, 0), 0);
                store_acc(c(1, 0), 1);
                if two {
                    store_acc(c(0, 1), 2);
                    store_acc(c(1, 1), 3);
                }
            }
            rb += if two { 2 } else { 1 };
        }
        kc0 = kc1;
    }
    // Transpose: accumulator (a, rb) element [i][j] is out[rb * 16 + j][o0 + a * 16 + i].
    let tiles = if pair { 2 } else { 1 };
    for rb in 0..rblocks {
        for j in 0..T.min(rows - rb * T) {
            let r = rb * T + j;
            for a in 0..tiles {
                let tile = &acc[(rb * 2 + a) * T * T..][..T * T];
                for i in 0..T {
                    // SAFETY: r < rows and o0 + a * 16 + i < n: inside `out` ([rows, n]), in
                    // this task's columns.
                    unsafe { *out.add(r * n + o0 + a * T + i) = tile[i * T + j] };
                }
            }
        }
    }
}

/// The products of one half (hi or lo) of a depth tile: accumulator `2b + a` += weight tile
/// `4 + a` × activation tile `6 + b`, for the weight tiles and activation blocks present.
///
/// # Safety
/// The tile configuration is loaded and the operand tiles hold this step's values.
#[inline(always)]
unsafe fn products(pair: bool, two: bool) {
    // SAFETY: register-only tile instructions (the contract).
    unsafe {
        match (pair, two) {
            (true, true) => asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm5, tmm6",
                "tdpbf16ps tmm2, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem)
            ),
            (true, false) => asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm5, tmm6",
                options(nostack, nomem)
            ),
            (false, true) => asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm2, tmm4, tmm7",
                options(nostack, nomem)
            ),
            (false, false) => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
        }
    }
}

/// Load accumulator tile `t` (0..4) from 16 × 16 f32 at `src`.
///
/// # Safety
/// `src` points to 1 KiB of f32; the tile configuration is loaded.
#[inline(always)]
unsafe fn load_acc(src: *mut f32, t: usize) {
    // SAFETY: forwarded contract; the tile number is a constant of the template.
    unsafe {
        match t {
            0 => {
                asm!("tileloadd tmm0, [{p} + {s} * 1]", p = in(reg) src, s = in(reg) 64usize, options(nostack, readonly))
            }
            1 => {
                asm!("tileloadd tmm1, [{p} + {s} * 1]", p = in(reg) src, s = in(reg) 64usize, options(nostack, readonly))
            }
            2 => {
                asm!("tileloadd tmm2, [{p} + {s} * 1]", p = in(reg) src, s = in(reg) 64usize, options(nostack, readonly))
            }
            _ => {
                asm!("tileloadd tmm3, [{p} + {s} * 1]", p = in(reg) src, s = in(reg) 64usize, options(nostack, readonly))
            }
        }
    }
}

/// Store accumulator tile `t` (0..4) into 16 × 16 f32 at `dst`.
///
/// # Safety
/// `dst` points to 1 KiB of writable f32 nothing else reads meanwhile; the tile
/// configuration is loaded.
#[inline(always)]
unsafe fn store_acc(dst: *mut f32, t: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        match t {
            0 => {
                asm!("tilestored [{p} + {s} * 1], tmm0", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            1 => {
                asm!("tilestored [{p} + {s} * 1], tmm1", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            2 => {
                asm!("tilestored [{p} + {s} * 1], tmm2", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            _ => {
                asm!("tilestored [{p} + {s} * 1], tmm3", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
        }
    }
}

/// Ask Linux for this process's permission to use the AMX tile data state (a one-time,
/// process-wide request, Linux 5.16 and later). `false` when the kernel refuses.
pub(super) fn request_permission() -> bool {
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): values from the kernel's uapi.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments; it touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}
