//! Baselines the CPU kernel benchmarks pair their timings with, measured in the same run:
//! a plain read of memory (for bandwidth-bound kernels) and an FMA-peak loop (for
//! compute-bound ones). Shared by `linear` and `attention`.

#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// Sequential streams each thread reads at once in the paired baseline: as many as the
/// decode kernel walks (it reads `OUT_BLOCK` = 4 distant weight rows in lockstep). On some
/// machines one stream per core cannot reach the memory bandwidth: only a baseline with the
/// same memory-level parallelism is a fair ceiling.
pub const READ_STREAMS: usize = 4;

/// Sum of `c` read as `streams` equal sub-slices in lockstep, 512 bytes of each at a time.
pub fn sum_streams(c: &[u64], streams: usize) -> u64 {
    const B: usize = 64;
    let len = c.len() / streams / B * B;
    let mut acc = 0u64;
    for blk in (0..len).step_by(B) {
        for s in 0..streams {
            let part = &c[s * len + blk..s * len + blk + B];
            acc = acc.wrapping_add(part.iter().fold(0u64, |a, &b| a.wrapping_add(b)));
        }
    }
    acc
}

/// Seconds to sum `buf` on all rayon threads, each chunk as `streams` streams.
pub fn read_pass(buf: &[u64], streams: usize) -> f64 {
    let chunk = buf.len().div_ceil(rayon::current_num_threads() * 4);
    let t = Instant::now();
    let s: u64 = buf
        .par_chunks(chunk)
        .map(|c| sum_streams(c, streams))
        .reduce(|| 0, u64::wrapping_add);
    black_box(s);
    t.elapsed().as_secs_f64()
}

/// Read bandwidth of summing `buf` (GB/s, best of several passes).
pub fn read_bandwidth(buf: &[u64], streams: usize) -> f64 {
    let best = (0..6)
        .map(|_| read_pass(buf, streams))
        .fold(f64::MAX, f64::min);
    (buf.len() * 8) as f64 / best / 1e9
}

/// Peak f32 FMA throughput on all rayon threads (GFLOP/s, best of several runs): a register-
/// only loop of independent FMA chains on the widest vectors this CPU has.
pub fn fma_peak(iters: usize, runs: usize) -> f64 {
    let threads = rayon::current_num_threads();
    let mut best = f64::MAX;
    let mut flop_per_iter = 0.0;
    for _ in 0..runs {
        let t = Instant::now();
        let (f, _) = rayon::broadcast(|_| fma_loop(iters))
            .into_iter()
            .fold((0.0, 0.0), |a, b| (b.0, a.1 + b.1));
        flop_per_iter = f;
        best = best.min(t.elapsed().as_secs_f64());
    }
    flop_per_iter * (iters * threads) as f64 / best / 1e9
}

/// Runs `iters` iterations of independent FMA chains; returns (flop per iteration, a sum
/// that keeps the work alive).
pub fn fma_loop(iters: usize) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected just above.
            return (12.0 * 16.0 * 2.0, unsafe { x86::fma512(iters) });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA were detected just above.
            return (10.0 * 8.0 * 2.0, unsafe { x86::fma256(iters) });
        }
    }
    let mut acc = [0.0f32; 8];
    for _ in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(0.999, 0.001);
        }
    }
    (16.0, black_box(acc).iter().sum())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma512(iters: usize) -> f32 {
        let (m, a) = (_mm512_set1_ps(0.999), _mm512_set1_ps(0.001));
        let mut acc = [_mm512_setzero_ps(); 12];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm512_fmadd_ps(*v, m, a);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma256(iters: usize) -> f32 {
        let (m, a) = (_mm256_set1_ps(0.999), _mm256_set1_ps(0.001));
        let mut acc = [_mm256_setzero_ps(); 10];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm256_fmadd_ps(*v, m, a);
            }
        }
        let mut out = [0.0f32; 8];
        for v in acc {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` holds 8 f32; unaligned store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
            for (o, l) in out.iter_mut().zip(lanes) {
                *o += l;
            }
        }
        out.iter().sum()
    }
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Timing of one case: seconds per pass (median and best), the baseline's median (GB/s or
/// GFLOP/s) and the median ratio of the case's rate to it.
pub struct Timing {
    pub median_s: f64,
    pub best_s: f64,
    pub baseline: f64,
    pub ratio: f64,
}

/// Time `pass` (seconds per unit of `work`) for at least `min_time` and 5 passes after one
/// warm-up, each followed by one run of `baseline` (its rate). Pairing each pass with a
/// baseline run right after it, and taking the median of the per-pair ratios of `work` per
/// second (in 1e9) to the baseline's rate, keeps the ratio meaningful on a shared machine
/// whose load changes during the run.
pub fn paired(
    min_time: Duration,
    work: f64,
    mut pass: impl FnMut() -> f64,
    mut baseline: impl FnMut() -> f64,
) -> Timing {
    pass();
    let (mut times, mut bases, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    while start.elapsed() < min_time || times.len() < 5 {
        let t = pass();
        let base = baseline();
        times.push(t);
        bases.push(base);
        ratios.push(work / t / 1e9 / base);
    }
    let best_s = times.iter().copied().fold(f64::MAX, f64::min);
    Timing {
        median_s: median(&mut times),
        best_s,
        baseline: median(&mut bases),
        ratio: median(&mut ratios),
    }
}

/// The command line's case filters: arguments not starting with `-` (cargo bench passes
/// `--bench`); a case runs when there are none or its label contains one.
pub fn case_filter() -> impl Fn(&str) -> bool {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    move |label| filters.is_empty() || filters.iter().any(|f| label.contains(f.as_str()))
}
