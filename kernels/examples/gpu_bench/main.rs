//! The GPU benchmark of scripts/gpu-check.sh: this card's two ceilings (a device-to-device
//! copy and a large bf16 GEMM through cuBLAS), then per model decode tokens/s at batch 1, 8
//! and 64 with the fraction of the measured bandwidth reached, and prefill of 2,048 and 8,192
//! tokens with the fraction of the measured GEMM rate reached, and one layer's prefill
//! attention alone at those lengths on each kernel (f32 CUDA cores, tensor cores), and the KV
//! of a 2,048-token lease copied out of and into device memory in batches and one block at a
//! time (what a prefill node's lease and a decode node's import cost); last, one Qwen3-30B-A3B
//! sparse layer alone, routed on the device against on the host ([`moe`]). Prints one table last,
//! with the GPU goals (docs/cuda.md) checked under it, and writes every figure to
//! OUT_DIR/gpu_bench.json, the table to OUT_DIR/table.txt, both after every model ([`report`]).
//!
//! Usage: `gpu_bench OUT_DIR [MODEL...]` (default: synthetic:qwen3-0.6b synthetic:qwen3-8b).
//! Decode steps choose greedy tokens on the device (as the engine does) and run twice: eager
//! launches, then replaying CUDA graphs (`--cuda-graphs on`); the "graphs" column is the
//! second's tokens/s, or why it fell back to eager launches. Batches of up to 8 run both
//! again with the linear layers through the `gemv16` kernels instead of cuBLAS
//! (`PD_CUDA_GEMV=kernel`): the "gemv kernel" and "+ graphs" columns, and with graphs
//! whose GEMV kernels are launched programmatically dependent (`PD_CUDA_PDL=on`): "+ PDL".
//! Those batches also run with graphs and key splits of at least 32, 64 and 128 keys
//! (default 256): a line each under the table.
//!
//! `gpu_bench --profile-decode MODEL cublas|kernel` instead runs one batch-1 decode step
//! inside a profiler range, for Nsight Compute to break down ([`model::profile_decode`]).
//!
//! `PD_GPU_BENCH_SMOKE=1` shrinks every size (a 4 MiB copy, a 128³ GEMM, 48 tokens of
//! context, 3 steps, prefills of 64 and 200 tokens, a MoE layer of 16 experts of width 64 with prefills of 160 and 200 rows): CI runs it on pd-cuda-emu (kernels/emu/)
//! so that the whole program has run before a GPU host runs it. Its figures mean nothing.

use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::SmallBatchLinear;
use pd_kernels::cuda::gemm::{self, GemmType, Product};

mod attention;
mod model;
mod moe;
mod report;
mod transfer;

use model::{bench_model, profile_decode};
use report::Ceilings;

const BLOCK: usize = 16;

const USAGE: &str =
    "usage: gpu_bench OUT_DIR [MODEL...] | gpu_bench --profile-decode MODEL cublas|kernel";

/// What the benchmark measures: the real sizes, or tiny ones that only run the code path.
struct Sizes {
    copy_elems: usize,
    gemm: usize,
    reps: usize,
    decode_context: usize,
    decode_steps: usize,
    prefill: [usize; 2],
    moe_layer: moe::MoeShape,
    /// Prefill-sized batches of the MoE layer (the grouped path: over 128 rows).
    moe_prefill: [usize; 2],
}

impl Sizes {
    fn from_env() -> Self {
        if std::env::var("PD_GPU_BENCH_SMOKE").is_ok_and(|v| v == "1") {
            return Self {
                copy_elems: 1 << 20,
                gemm: 128,
                reps: 2,
                decode_context: 48,
                decode_steps: 3,
                prefill: [64, 200],
                moe_layer: moe::MoeShape {
                    hidden: 256,
                    experts: 16,
                    inter: 64,
                    top_k: 4,
                },
                moe_prefill: [160, 200],
            };
        }
        Self {
            copy_elems: 1 << 29, // f32 values: 2 GiB
            gemm: 8192,
            reps: 10,
            decode_context: 512,
            decode_steps: 32,
            prefill: [2048, 8192],
            moe_layer: moe::QWEN3_30B_A3B,
            moe_prefill: [512, 2048],
        }
    }
}

/// Median ms of `reps` calls of `run` (which waits for its own work), after one warm-up call.
fn median_ms(reps: usize, mut run: impl FnMut()) -> f64 {
    run();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// [`median_ms`] of `f` with the device synchronized after each call.
fn timed_ms(backend: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    median_ms(reps, || {
        f();
        backend.synchronize();
    })
}

/// Bytes read plus written per second by a 2 GiB device-to-device copy (median of 10).
fn copy_bandwidth(backend: &CudaBackend, sizes: &Sizes) -> f64 {
    let dev = backend.device();
    let n = sizes.copy_elems;
    let src: CudaSlice<f32> = dev.stream.alloc_zeros(n).expect("alloc");
    let mut dst: CudaSlice<f32> = dev.stream.alloc_zeros(n).expect("alloc");
    let ms = timed_ms(backend, sizes.reps, || {
        dev.stream.memcpy_dtod(&src, &mut dst).expect("copy");
    });
    2.0 * (n * 4) as f64 / (ms / 1e3)
}

/// FLOP/s of an 8192³ bf16 GEMM with f32 accumulation on random data (median of 10).
fn gemm_rate(backend: &CudaBackend, sizes: &Sizes) -> f64 {
    let dev = backend.device();
    let m = sizes.gemm;
    // Random bf16 patterns in [-1, 1): exponent bits fixed, mantissa and sign varied.
    let host: Vec<u16> = (0..m * m)
        .map(|i| {
            let r = (i as u32).wrapping_mul(2_654_435_761) >> 9;
            0x3f00 | (r as u16 & 0x80ff)
        })
        .collect();
    let a = dev.stream.clone_htod(&host).expect("upload");
    let b = dev.stream.clone_htod(&host).expect("upload");
    let c: CudaSlice<f32> = dev.stream.alloc_zeros(m * m).expect("alloc");
    // Addresses of buffers that outlive every GEMM below.
    let (ap, bp, cp) = (
        a.device_ptr(&dev.stream).0,
        b.device_ptr(&dev.stream).0,
        c.device_ptr(&dev.stream).0,
    );
    let ms = timed_ms(backend, sizes.reps, || {
        gemm::linear(
            dev,
            &Product {
                ty: GemmType::BF16,
                x: ap,
                rows: m,
                w: bp,
                n: m,
                k: m,
                out: cp,
                accumulate: false,
            },
        );
    });
    2.0 * (m * m * m) as f64 / (ms / 1e3)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let first = args.next().expect(USAGE);
    if first == "--profile-decode" {
        let model = args.next().expect(USAGE);
        let linear = match args.next().as_deref() {
            Some("cublas") => SmallBatchLinear::Cublas,
            Some("kernel") => SmallBatchLinear::Kernel,
            _ => {
                eprintln!("{USAGE}");
                std::process::exit(2);
            }
        };
        profile_decode(&model, linear, &Sizes::from_env());
        return;
    }
    let out = std::path::PathBuf::from(first);
    let mut models: Vec<String> = args.collect();
    if models.is_empty() {
        models = vec!["synthetic:qwen3-0.6b".into(), "synthetic:qwen3-8b".into()];
    }
    let backend = CudaBackend::open(0, 0.9).unwrap_or_else(|e| panic!("{e}"));
    let gpu = backend.device().name.clone();
    let sizes = Sizes::from_env();
    let bandwidth = copy_bandwidth(&backend, &sizes);
    let flops = gemm_rate(&backend, &sizes);
    eprintln!(
        "copy {:.0} GB/s, bf16 GEMM {:.0} TFLOP/s",
        bandwidth / 1e9,
        flops / 1e12
    );
    drop(backend);
    let ceilings = Ceilings {
        gpu,
        bandwidth,
        flops,
    };
    let mut results = Vec::new();
    for m in &models {
        eprintln!("benchmarking {m}");
        results.push(bench_model(m, bandwidth, flops, &sizes));
        // After every model, so that a run the GPU host's time limit cuts short still
        // leaves the models it finished.
        report::write(&out, &ceilings, &results, None);
    }
    eprintln!("benchmarking one Qwen3-MoE sparse layer");
    let moe = moe::bench_moe_layer(bandwidth, flops, &sizes);
    print!("{}", report::write(&out, &ceilings, &results, Some(&moe)));
}
