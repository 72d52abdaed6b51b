//! Throughput of the CPU backend's `linear` (`cargo bench -p pd-engine --bench linear`).
//!
//! The machines are shared and noisy, so every timed pass is paired with a baseline run
//! right after it, and the median of the per-pair ratios is what to read:
//! - decode (rows = 1 and 16): GB/s of weight bytes read, cycling through enough copies of
//!   the matrix (≥ 256 MiB) that it comes from memory, not cache — as in a real forward
//!   pass, which touches every layer once per step — against a plain read of as many bytes
//!   (summing a u64 buffer on all threads, each reading 4 streams at once like the kernel);
//! - prefill (rows = 512): GFLOP/s against an f32 FMA-peak loop.
//!
//! Arguments not starting with `-` filter the cases by substring (e.g. `bfloat16`, `r=1 `,
//! `lm_head`). `PD_CPU_ISA=avx2` (or `portable`) measures a fallback kernel instead of the
//! best one the CPU has.

use std::hint::black_box;
use std::time::{Duration, Instant};

mod baseline;

use baseline::{READ_STREAMS, Timing, case_filter, fma_peak, paired, read_bandwidth, read_pass};
use pd_engine::backend::cpu::WeightMatrix;
use pd_engine::backend::cpu::linear::linear;
use pd_engine::weights::DType;

/// Decode matrices are cycled through at least this many bytes of copies.
const COLD_BYTES: usize = 256 << 20;
/// Size of the read-bandwidth baseline buffer.
const BASELINE_BYTES: usize = 512 << 20;
/// Each case runs at least this long (after one warm-up pass).
const MIN_TIME: Duration = Duration::from_millis(700);

/// Qwen3-0.6B projection shapes `[out, in]`.
const DECODE_SHAPES: [(&str, usize, usize); 4] = [
    ("gate/up [3072x1024]", 3072, 1024),
    ("down [1024x3072]", 1024, 3072),
    ("q [2048x1024]", 2048, 1024),
    ("lm_head [151936x1024]", 151_936, 1024),
];
const PREFILL_SHAPES: [(&str, usize, usize); 3] = [
    ("gate/up [3072x1024]", 3072, 1024),
    ("down [1024x3072]", 1024, 3072),
    ("q [2048x1024]", 2048, 1024),
];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn random_matrix(dtype: DType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(n * k * dtype.size_in_bytes());
    for _ in 0..n * k {
        let v = rng.unit() * 0.05;
        match dtype {
            DType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => bytes.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            DType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    bytes
}

/// What each timed pass is paired with: a plain-read pass over as many bytes (decode), or a
/// short FMA-peak run (prefill).
#[derive(Clone, Copy)]
enum Baseline<'a> {
    Read(&'a [u64]),
    Fma,
}

fn time_calls(
    mats: &[Vec<u8>],
    dtype: DType,
    n: usize,
    k: usize,
    rows: usize,
    baseline: Baseline<'_>,
) -> Timing {
    let mut rng = Rng(0x1234_5678);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.unit()).collect();
    let mut out = vec![0.0f32; rows * n];
    let bytes = n * k * dtype.size_in_bytes();
    let flop = 2.0 * (rows * n * k) as f64;
    let pass = || {
        let t = Instant::now();
        for m in mats {
            linear(&x, rows, WeightMatrix::new(dtype, n, k, m), &mut out);
            black_box(&mut out);
        }
        t.elapsed().as_secs_f64() / mats.len() as f64
    };
    match baseline {
        Baseline::Read(buf) => {
            let b = &buf[..(bytes * mats.len() / 8).min(buf.len())];
            paired(MIN_TIME, bytes as f64, pass, || {
                (b.len() * 8) as f64 / read_pass(b, READ_STREAMS) / 1e9
            })
        }
        Baseline::Fma => paired(MIN_TIME, flop, pass, || fma_peak(3_000_000, 1)),
    }
}

fn main() {
    let wanted = case_filter();
    let threads = rayon::current_num_threads();
    println!("linear bench: {threads} rayon threads");

    let baseline_buf: Vec<u64> = (0..BASELINE_BYTES / 8).map(|i| i as u64).collect();
    let bw1s = read_bandwidth(&baseline_buf, 1);
    let bw0 = read_bandwidth(&baseline_buf, READ_STREAMS);
    println!(
        "read bandwidth (sum of a {} MiB u64 buffer, {threads} threads): {bw1s:.1} GB/s with one \
         stream per thread, {bw0:.1} GB/s with {READ_STREAMS} streams per thread\n",
        BASELINE_BYTES >> 20
    );

    let dtypes = [DType::BF16, DType::F16, DType::F32];
    println!(
        "decode: weight GB/s (median / best); plain-read GB/s ({READ_STREAMS} streams per thread) \
         measured right after each pass; median ratio of the two"
    );
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for dtype in dtypes {
        for (name, n, k) in DECODE_SHAPES {
            let labels: Vec<(usize, String)> = [1, 16]
                .into_iter()
                .map(|rows| (rows, format!("{dtype:>8} {name:<22} r={rows:<3}")))
                .filter(|(_, l)| wanted(l))
                .collect();
            if labels.is_empty() {
                continue;
            }
            let bytes = n * k * dtype.size_in_bytes();
            let first = random_matrix(dtype, n, k, &mut rng);
            let copies = COLD_BYTES.div_ceil(bytes);
            let mats: Vec<Vec<u8>> = (0..copies).map(|_| first.clone()).collect();
            for (rows, label) in labels {
                let t = time_calls(&mats, dtype, n, k, rows, Baseline::Read(&baseline_buf));
                let (gbm, gbb) = (
                    bytes as f64 / t.median_s / 1e9,
                    bytes as f64 / t.best_s / 1e9,
                );
                println!(
                    "{label} {gbm:6.1} / {gbb:6.1} GB/s  read {:5.1} GB/s  {:5.1} %  \
                     ({:.3} ms/call, {:.1} GFLOP/s)",
                    t.baseline,
                    100.0 * t.ratio,
                    t.median_s * 1e3,
                    2.0 * (rows * n * k) as f64 / t.median_s / 1e9
                );
            }
        }
    }

    let peak = fma_peak(20_000_000, 3);
    println!(
        "\nprefill: GFLOP/s (median / best); f32 FMA peak ({threads} threads) measured right \
         after each pass; median ratio of the two (start: {peak:.0} GFLOP/s)"
    );
    for dtype in dtypes {
        for (name, n, k) in PREFILL_SHAPES {
            let rows = 512;
            let label = format!("{dtype:>8} {name:<22} r={rows:<3}");
            if !wanted(&label) {
                continue;
            }
            let mats = vec![random_matrix(dtype, n, k, &mut rng)];
            let t = time_calls(&mats, dtype, n, k, rows, Baseline::Fma);
            let (med, best) = (t.median_s, t.best_s);
            let flop = 2.0 * (rows * n * k) as f64;
            println!(
                "{label} {:6.1} / {:6.1} GFLOP/s  peak {:5.0} GFLOP/s  {:5.1} %  \
                 ({:.2} ms/call, {:.0} rows/s)",
                flop / med / 1e9,
                flop / best / 1e9,
                t.baseline,
                100.0 * t.ratio,
                med * 1e3,
                rows as f64 / med
            );
        }
    }

    let bw1 = read_bandwidth(&baseline_buf, READ_STREAMS);
    let peak1 = fma_peak(20_000_000, 3);
    println!(
        "\nat the end: read bandwidth {bw1:.1} GB/s (start {bw0:.1}), FMA peak {peak1:.0} GFLOP/s (start {peak:.0})"
    );
}
