//! `x · Wᵀ` on the CPU, reading weights in their stored dtype (bf16 / f16 / f32).
//!
//! Two paths:
//! - **Small batch** (decode, `rows ≤ SMALL_BATCH_MAX_ROWS`): memory-bandwidth bound for a
//!   few rows. Output rows are split into a few contiguous ranges run on rayon; each range is
//!   read as `OUT_BLOCK` long linear streams in lockstep (row t of each quarter together),
//!   every weight row streamed from memory once, converted to f32 per SIMD register and
//!   dotted with every activation row (register-blocked over activation rows × weight rows;
//!   a block's weight rows are re-read from L1 when the activations need more than one
//!   register group). AVX-512F, AVX2 + FMA + F16C, or portable code, chosen at run time.
//! - **Large batch** (prefill): output rows are cut into tiles whose f32 form fits in L2; each
//!   tile is converted into a small thread-local scratch (read in place for aligned f32
//!   weights) and multiplied with the `gemm` crate, single-threaded per tile, the tiles run
//!   on rayon. On AVX-512 the tile is converted straight into the packed layout of this
//!   crate's own kernel (`gemm512.rs`) instead, the activations packed once per call.
//!   The full weight is never converted in memory.
//!
//! The streaming path beats the tiled gemm up to a few dozen rows (measured on a 2-core
//! AVX2 machine: ~2.6× at 16 rows, ~1.5× at 48, about even at 64, gemm 1.3× ahead at 128),
//! hence the threshold.
//! Accumulation is f32 throughout (activations are never rounded to a narrower type).

use std::cell::RefCell;

use rayon::prelude::*;

use super::convert::{self, D_BF16, D_F16, D_F32, dcode};
use super::isa::Isa;
use super::matrix::WeightMatrix;
#[cfg(target_arch = "x86_64")]
use super::{amx, gemm512};
use crate::weights::DType;

/// Largest batch served by the streaming (decode) path; larger ones go to the tiled GEMM.
pub(super) const SMALL_BATCH_MAX_ROWS: usize = 48;
/// Weight rows per register block of the streaming path.
const OUT_BLOCK: usize = 4;
/// Streaming work (weight bytes × activation rows) below which one thread is cheaper.
const PAR_MIN_WORK: usize = 256 * 1024;
/// Tasks per rayon thread in the streaming path: a few large ones for balance.
const TASKS_PER_THREAD: usize = 4;
/// Bytes of converted f32 weight per GEMM tile (kept well inside a 2 MiB L2).
const TILE_BYTES: usize = 1024 * 1024;

/// `out[r][o] = sum_i x[r][i] * w[o][i]`: x is `[rows, w.cols]` row-major f32, out is `[rows, w.rows]`.
pub fn linear(x: &[f32], rows: usize, w: WeightMatrix<'_>, out: &mut [f32]) {
    linear_with(Isa::detect(), x, rows, w, out);
}

/// [`linear`] on an explicit instruction set (which must be available on this CPU).
pub(super) fn linear_with(isa: Isa, x: &[f32], rows: usize, w: WeightMatrix<'_>, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), rows * k, "linear: x is not [{rows}, {k}]");
    assert_eq!(out.len(), rows * n, "linear: out is not [{rows}, {n}]");
    assert_eq!(
        w.bytes.len(),
        n * k * w.dtype.size_in_bytes(),
        "linear: weight byte length"
    );
    assert!(isa.available(), "linear: {isa:?} not available on this CPU");
    if rows == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && amx::fits(rows, &w) {
        // SAFETY: `Isa::Amx` is available (asserted above): AMX-BF16, AMX-TILE and the
        // process's permission for the tile state.
        return unsafe { amx::linear(x, rows, w, out) };
    }
    let isa = isa.simd();
    if rows <= SMALL_BATCH_MAX_ROWS {
        small_batch(isa, x, rows, w, out);
    } else {
        large_batch(isa, x, rows, w, out);
    }
}

/// The output pointer shared by parallel tasks that write disjoint columns.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(*mut f32);
// SAFETY: tasks only write disjoint elements through it while the owning `&mut [f32]` is
// borrowed by the call that spawned them (rayon joins before that call returns).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}
impl OutPtr {
    pub(super) fn new(out: &mut [f32]) -> OutPtr {
        OutPtr(out.as_mut_ptr())
    }

    /// A method (not a field access) so closures capture the whole `Send` wrapper.
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

// ---------------------------------------------------------------------------------------
// Small batch: streaming GEMV-like kernel.
// ---------------------------------------------------------------------------------------

fn small_batch(isa: Isa, x: &[f32], rows: usize, w: WeightMatrix<'_>, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let row_bytes = k * w.dtype.size_in_bytes();
    let threads = rayon::current_num_threads();
    let tasks = if n * row_bytes * rows < PAR_MIN_WORK || threads == 1 {
        1
    } else {
        threads * TASKS_PER_THREAD
    };
    let chunk = n.div_ceil(tasks).next_multiple_of(OUT_BLOCK);
    let tasks = n.div_ceil(chunk);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run = |t: usize| {
        let o0 = t * chunk;
        let o1 = (o0 + chunk).min(n);
        let wb = &w.bytes[o0 * row_bytes..o1 * row_bytes];
        // SAFETY: `x` is [rows, k] and `wb` holds rows o0..o1 of the weight (lengths asserted
        // in `linear_with`); the kernel writes out[r][o0..o1] for r < rows, inside `out`
        // ([rows, n]) and disjoint from every other task's columns; `isa` is available.
        unsafe {
            gemv_range(
                isa,
                w.dtype,
                x.as_ptr(),
                rows,
                k,
                wb,
                out_ptr.get().add(o0),
                n,
            )
        }
    };
    if tasks == 1 {
        run(0);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// out[r * out_stride + j] = x[r] · w[j] for r < rows, j < w.len() / (k * size).
///
/// # Safety
/// `isa` must be available; `x` must point to `rows * k` f32; `out` must be writable at
/// `r * out_stride + j` for every r, j above.
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_range(
    isa: Isa,
    dtype: DType,
    x: *const f32,
    rows: usize,
    k: usize,
    w: &[u8],
    out: *mut f32,
    out_stride: usize,
) {
    let nrows = w.len() / (k * dtype.size_in_bytes());
    let wp = w.as_ptr();
    // SAFETY: forwarded contract; the `x86` kernels need only the features `isa` names.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => match dcode(dtype) {
                D_F32 => k512::gemv::<D_F32>(x, rows, k, wp, nrows, out, out_stride),
                D_F16 => k512::gemv::<D_F16>(x, rows, k, wp, nrows, out, out_stride),
                _ => k512::gemv::<D_BF16>(x, rows, k, wp, nrows, out, out_stride),
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => match dcode(dtype) {
                D_F32 => k256::gemv::<D_F32>(x, rows, k, wp, nrows, out, out_stride),
                D_F16 => k256::gemv::<D_F16>(x, rows, k, wp, nrows, out, out_stride),
                _ => k256::gemv::<D_BF16>(x, rows, k, wp, nrows, out, out_stride),
            },
            _ => scalar_gemv(
                dtype,
                std::slice::from_raw_parts(x, rows * k),
                rows,
                k,
                w,
                out,
                out_stride,
            ),
        }
    }
}

/// Portable streaming kernel: one weight row converted into a row buffer, then dotted with
/// each activation row using lane-wise partial sums (auto-vectorised where possible).
///
/// # Safety
/// `out` must be writable at `r * out_stride + j` for r < rows, j < weight rows in `w`.
unsafe fn scalar_gemv(
    dtype: DType,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[u8],
    out: *mut f32,
    out_stride: usize,
) {
    const L: usize = 16;
    let row_bytes = k * dtype.size_in_bytes();
    let mut wrow = vec![0.0f32; k];
    for (j, wb) in w.chunks_exact(row_bytes).enumerate() {
        convert::to_f32_with(Isa::Portable, dtype, wb, &mut wrow);
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            let mut acc = [0.0f32; L];
            let mut xc = xr.chunks_exact(L);
            let mut wc = wrow.chunks_exact(L);
            for (a, b) in (&mut xc).zip(&mut wc) {
                // Plain multiply + add, not `mul_add`: without FMA hardware enabled at compile
                // time that is a libm call per element; this vectorises with baseline SIMD.
                for l in 0..L {
                    acc[l] += a[l] * b[l];
                }
            }
            let mut sum = acc.iter().sum::<f32>();
            for (a, b) in xc.remainder().iter().zip(wc.remainder()) {
                sum += a * b;
            }
            // SAFETY: the caller guarantees this element is writable.
            unsafe { *out.add(r * out_stride + j) = sum };
        }
    }
}

/// Streaming kernels for one x86 instruction set, generated from one template.
/// `$gmax` is the most activation rows per register group; each `$g => $o` arm says how
/// many weight rows (`$o`, dividing `OUT_BLOCK`) a group of `$g` rows is blocked with.
#[cfg(target_arch = "x86_64")]
macro_rules! stream_kernels {
    ($name:ident, $simd:ident, $feat:literal, $gmax:literal, [$($g:literal => $o:literal),+ $(,)?]) => {
        mod $name {
            use super::super::convert::$simd::{LANES, fmadd, hsum, load, load_x, zero};
            use super::super::convert::{dsize, read_scalar};
            use super::OUT_BLOCK;

            /// out[r * os + j * oj] = x[r] · w[j] for r < R, j < O; x rows are `k` apart,
            /// w rows `ws` bytes apart.
            ///
            /// # Safety
            /// CPU features; R rows of `k` f32 at `x`; O rows of `k` dtype-`D` elements at
            /// `w` (stride `ws`); `out` writable at the R × O positions.
            #[inline]
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn block<const D: u8, const R: usize, const O: usize>(
                x: *const f32,
                w: *const u8,
                ws: usize,
                k: usize,
                out: *mut f32,
                os: usize,
                oj: usize,
            ) {
                let es = dsize(D);
                let kv = k / LANES * LANES;
                let mut acc = [[zero(); O]; R];
                let mut i = 0;
                // SAFETY: the vector loop reads elements i..i + LANES ≤ kv ≤ k of each row and
                // the tail elements kv..k; writes are the R × O output positions (contract).
                unsafe {
                    while i < kv {
                        let mut wv = [zero(); O];
                        for (j, v) in wv.iter_mut().enumerate() {
                            *v = load::<D>(w.add(j * ws + i * es));
                        }
                        for (r, accr) in acc.iter_mut().enumerate() {
                            let xv = load_x(x.add(r * k + i));
                            for (a, v) in accr.iter_mut().zip(&wv) {
                                *a = fmadd(xv, *v, *a);
                            }
                        }
                        i += LANES;
                    }
                    for (r, accr) in acc.iter().enumerate() {
                        for (j, a) in accr.iter().enumerate() {
                            let mut sum = hsum(*a);
                            for t in kv..k {
                                sum += *x.add(r * k + t) * read_scalar::<D>(w.add(j * ws), t);
                            }
                            *out.add(r * os + j * oj) = sum;
                        }
                    }
                }
            }

            /// out[r * os + j] = x[r] · w[j] for r < rows, j < nrows (w rows are `k` elements).
            ///
            /// The rows are cut into `OUT_BLOCK` equal contiguous quarters and block `t`
            /// takes row `t` of each quarter, so the weight is read as `OUT_BLOCK` long
            /// linear streams in lockstep. (Blocks of adjacent rows make every short row a
            /// new interleaved stream the hardware prefetchers track badly: 2 KiB bf16 rows
            /// read 35–50 % slower that way than long ones; quarters read both alike.)
            ///
            /// # Safety
            /// CPU features; `rows * k` f32 at `x`; `nrows * k` dtype-`D` elements at `w`;
            /// `out` writable at every `r * os + j`.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn gemv<const D: u8>(
                x: *const f32,
                rows: usize,
                k: usize,
                w: *const u8,
                nrows: usize,
                out: *mut f32,
                os: usize,
            ) {
                let ws = k * dsize(D);
                let groups = rows.div_ceil($gmax);
                let q = nrows / OUT_BLOCK;
                // SAFETY: block t reads weight rows t + j * q < OUT_BLOCK * q ≤ nrows and the
                // leftover loop rows OUT_BLOCK * q..nrows; each group reads activation rows
                // r..r + g ≤ rows and writes their outputs for those weight rows only.
                unsafe {
                    for t in 0..q {
                        let (mut r, mut left) = (0, groups);
                        while r < rows {
                            // Balanced groups: 9 rows → 5 + 4, not 8 + 1.
                            let g = (rows - r).div_ceil(left);
                            let (xr, outr) = (x.add(r * k), out.add(r * os + t));
                            match g {
                                $($g => {
                                    let mut j = 0;
                                    while j < OUT_BLOCK {
                                        block::<D, $g, $o>(
                                            xr,
                                            w.add((t + j * q) * ws),
                                            q * ws,
                                            k,
                                            outr.add(j * q),
                                            os,
                                            q,
                                        );
                                        j += $o;
                                    }
                                })+
                                _ => unreachable!(),
                            }
                            r += g;
                            left -= 1;
                        }
                    }
                    for o in q * OUT_BLOCK..nrows {
                        let (mut r, mut left) = (0, groups);
                        while r < rows {
                            let g = (rows - r).div_ceil(left);
                            let (xr, outr) = (x.add(r * k), out.add(r * os + o));
                            match g {
                                $($g => block::<D, $g, 1>(xr, w.add(o * ws), ws, k, outr, os, 1),)+
                                _ => unreachable!(),
                            }
                            r += g;
                            left -= 1;
                        }
                    }
                }
            }
        }
    };
}

// 32 zmm registers, but groups of at most 4 activation rows × 4 weight rows (16 accumulators):
// each activation vector then feeds 4 FMAs. Groups of 8 rows × 2 weight rows ran 16 rows at
// 0.3–0.8 of this FLOP rate (Zen 5): activation rows `k` floats apart do not stay in L1
// between blocks, and 8 × 2 loads twice as many of them per FMA (docs/benchmarks.md).
#[cfg(target_arch = "x86_64")]
stream_kernels!(k512, avx512, "avx512f", 4, [1 => 4, 2 => 4, 3 => 4, 4 => 4]);
// 16 ymm registers: up to 8 accumulators + O weight vectors + one activation vector.
#[cfg(target_arch = "x86_64")]
stream_kernels!(k256, avx2, "avx2,fma,f16c", 4, [1 => 4, 2 => 4, 3 => 2, 4 => 2]);

// ---------------------------------------------------------------------------------------
// Large batch: tiled conversion + gemm.
// ---------------------------------------------------------------------------------------

thread_local! {
    /// Converted weight tile of the calling rayon thread (at most `TILE_BYTES` + a row).
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn large_batch(isa: Isa, x: &[f32], rows: usize, w: WeightMatrix<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        return large_batch_512(x, rows, w, out);
    }
    let (n, k) = (w.rows, w.cols);
    let es = w.dtype.size_in_bytes();
    let threads = rayon::current_num_threads();
    // Output rows per tile: the converted tile fits `TILE_BYTES`, a multiple of 16, and
    // there are at least two tiles per thread when the matrix allows it.
    let tile = (TILE_BYTES / (k * 4)).min(n.div_ceil(2 * threads)).max(1);
    let tile = if tile >= 16 { tile / 16 * 16 } else { tile };
    let ntiles = n.div_ceil(tile);
    // Too few tiles for the threads (narrow outputs): also split the activation rows.
    let row_parts = (2 * threads)
        .div_ceil(ntiles)
        .clamp(1, rows.div_ceil(64).max(1));
    let row_chunk = rows.div_ceil(row_parts);
    let row_parts = rows.div_ceil(row_chunk);
    let direct: Option<&[f32]> = if w.dtype == DType::F32 && cfg!(target_endian = "little") {
        bytemuck::try_cast_slice(w.bytes).ok()
    } else {
        None
    };
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run = |task: usize| {
        let (t, p) = (task / row_parts, task % row_parts);
        let (o0, nt) = (t * tile, tile.min(n - t * tile));
        let (r0, m) = (p * row_chunk, row_chunk.min(rows - p * row_chunk));
        let mul = |wt: &[f32]| {
            debug_assert_eq!(wt.len(), nt * k);
            // SAFETY: lhs = x rows r0..r0 + m ([m, k], row stride k) lie in `x`; rhs[i][j] =
            // wt[j * k + i] ([k, nt]) lies in `wt`; dst = out[r0.., o0..o0 + nt] with row
            // stride n lies in `out` ([rows, n]) and no other task writes those elements.
            // read_dst = false, so dst is only written (dst = 1.0 * lhs · rhs).
            unsafe {
                gemm::gemm(
                    m,
                    nt,
                    k,
                    out_ptr.get().add(r0 * n + o0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr().add(r0 * k),
                    1,
                    k as isize,
                    wt.as_ptr(),
                    k as isize,
                    1,
                    0.0f32,
                    1.0f32,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            }
        };
        match direct {
            Some(all) => mul(&all[o0 * k..(o0 + nt) * k]),
            None => TILE.with(|cell| {
                let mut buf = cell.borrow_mut();
                if buf.len() < nt * k {
                    buf.resize(nt * k, 0.0);
                }
                let dst = &mut buf[..nt * k];
                convert::to_f32_with(isa, w.dtype, &w.bytes[o0 * k * es..(o0 + nt) * k * es], dst);
                mul(dst);
            }),
        }
    };
    let tasks = ntiles * row_parts;
    if tasks == 1 || threads == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The calling thread's packed activations (taken out while a call uses them).
    static XPACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Packed weight tile and a row of scratch of the calling rayon thread.
    static WPACK: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// [`large_batch`] on AVX-512 with this crate's kernel ([`gemm512`]): the activations packed
/// once, then tiles of `gemm512::NR`-aligned weight rows (converted and packed per task, at
/// most `TILE_BYTES`) × ranges of activation panels, run on rayon.
#[cfg(target_arch = "x86_64")]
fn large_batch_512(x: &[f32], rows: usize, w: WeightMatrix<'_>, out: &mut [f32]) {
    use gemm512::{MR, NR};
    let (n, k) = (w.rows, w.cols);
    let es = w.dtype.size_in_bytes();
    let threads = rayon::current_num_threads();
    let tile = (TILE_BYTES / (k * 4))
        .min(n.div_ceil(2 * threads))
        .max(1)
        .next_multiple_of(NR);
    let ntiles = n.div_ceil(tile);
    let xpanels = rows.div_ceil(MR);
    // Too few tiles for the threads (narrow outputs): also split the activation panels.
    let parts = (2 * threads)
        .div_ceil(ntiles)
        .clamp(1, rows.div_ceil(64).max(1));
    let chunk = xpanels.div_ceil(parts);
    let parts = xpanels.div_ceil(chunk);

    // Taken out of the thread-local, so a nested call on this thread (work stealing) finds
    // it empty instead of borrowed.
    let mut xp = XPACK.take();
    xp.resize(gemm512::packed_x_len(rows, k), 0.0);
    xp.par_chunks_mut(MR * k)
        .with_min_len(8)
        .enumerate()
        .for_each(|(p, dst)| gemm512::pack_x_panel(x, rows, k, p, dst));

    let out_ptr = OutPtr(out.as_mut_ptr());
    let run = |task: usize| {
        let (t, p) = (task / parts, task % parts);
        let (o0, nt) = (t * tile, tile.min(n - t * tile));
        let panels = p * chunk..((p + 1) * chunk).min(xpanels);
        WPACK.with_borrow_mut(|(wp, row)| {
            wp.resize(gemm512::packed_w_len(nt, k), 0.0);
            row.resize(k, 0.0);
            // SAFETY: `Isa::Avx512` is available (asserted by `linear_with`); the tile's rows
            // o0..o0 + nt lie in the weight (its byte length asserted there); `row` has `k`
            // slots and `wp` the packed tile's length. The product writes rows of `panels`
            // below `rows` and columns o0..o0 + nt of `out` ([rows, n]): this task's alone.
            unsafe {
                gemm512::pack_w(
                    w.dtype,
                    &w.bytes[o0 * k * es..(o0 + nt) * k * es],
                    nt,
                    k,
                    row,
                    wp,
                );
                gemm512::gemm_tile(&xp, panels, rows, k, wp, nt, out_ptr.get().add(o0), n);
            }
        });
    };
    let tasks = ntiles * parts;
    if tasks == 1 || threads == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
    XPACK.set(xp);
}

#[cfg(test)]
mod tests;
