//! The backend conformance suite, CUDA against the CPU reference, on a GPU host
//! (scripts/gpu-check.sh). Skipped with a message unless `PD_GPU_TESTS=1`, so CI machines
//! without a GPU pass it trivially; they check the kernels through NVRTC and ptxas instead.
//!
//! Teacher-forced: both backends see the same tokens (the CPU's greedy choice each step), so
//! one divergence cannot cascade. Per logits row: relative error ‖gpu − cpu‖ / ‖cpu‖ ≤ 1e-2
//! (bf16 tolerance), and the greedy token must be equal wherever the CPU's top-2 margin is
//! larger than twice the row's largest absolute difference.
#![cfg(feature = "cuda")]

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::backend::{Backend, HostMatrix};
use pd_engine::executor::{ExecItem, Executor};
use pd_engine::model::{ModelFiles, ModelSource};
use pd_kernels::CudaBackend;

const BLOCK: usize = 16;
const TOLERANCE: f64 = 1e-2;

fn enabled(test: &str) -> bool {
    let on = std::env::var("PD_GPU_TESTS").is_ok_and(|v| v == "1");
    if !on {
        eprintln!("skipped {test}: set PD_GPU_TESTS=1 on a machine with an NVIDIA GPU");
    }
    on
}

fn files(model: &str) -> ModelFiles {
    let dir = ModelSource::parse(model)
        .expect("model name")
        .resolve(&|_, _| {})
        .expect("model directory");
    ModelFiles::open(&dir).expect("model files")
}

fn executor<B: Backend>(backend: B, files: &ModelFiles, blocks: usize) -> Executor<B> {
    let model = files
        .load_weights(&backend, &mut |_, _| {})
        .expect("weights load");
    Executor::new(backend, model, BLOCK, blocks).expect("executor")
}

fn argmax(row: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0, best.1 - second)
}

/// Worst relative error over the rows; panics on a clear greedy mismatch or a NaN.
fn compare(what: &str, cpu: &HostMatrix, gpu: &HostMatrix) -> f64 {
    assert_eq!((cpu.rows, cpu.cols), (gpu.rows, gpu.cols), "{what}: shape");
    let mut worst: f64 = 0.0;
    for r in 0..cpu.rows {
        let (c, g) = (cpu.row(r), gpu.row(r));
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{what} row {r}: non-finite logits"
        );
        let diff: f64 = c.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let norm: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (diff / norm.max(1e-30)).sqrt();
        let max_abs = c
            .iter()
            .zip(g)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let (ci, margin) = argmax(c);
        let (gi, _) = argmax(g);
        if margin > 2.0 * max_abs {
            assert_eq!(
                ci, gi,
                "{what} row {r}: greedy token differs (margin {margin})"
            );
        }
        worst = worst.max(rel);
    }
    assert!(
        worst <= TOLERANCE,
        "{what}: relative error {worst:.3e} > {TOLERANCE}"
    );
    worst
}

fn conformance(model: &str, prompt_len: usize, steps: usize) {
    let files = files(model);
    let blocks = (prompt_len + steps).div_ceil(BLOCK) + 2;
    let mut cpu = executor(CpuBackend::new(), &files, blocks);
    let gpu_backend = CudaBackend::open(0, 0.5).expect("cuda:0 opens");
    let mut gpu = executor(gpu_backend, &files, blocks);
    let table: Vec<u32> = (0..blocks as u32 - 1).collect();
    let vocab = files.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| ((i * 7919 + 17) as u32) % vocab)
        .collect();

    let run = |items: &[ExecItem<'_>],
               cpu: &mut Executor<CpuBackend>,
               gpu: &mut Executor<CudaBackend>| {
        (cpu.execute(items).remove(0), gpu.execute(items).remove(0))
    };
    let prefill = [ExecItem {
        tokens: &prompt,
        start: 0,
        block_table: &table,
        all_logits: true,
    }];
    let (c, g) = run(&prefill, &mut cpu, &mut gpu);
    let mut worst = compare(&format!("{model} prefill"), &c, &g);
    let mut next = argmax(c.row(c.rows - 1)).0 as u32;
    for step in 0..steps {
        let tokens = [next];
        let decode = [ExecItem {
            tokens: &tokens,
            start: prompt_len + step,
            block_table: &table,
            all_logits: false,
        }];
        let (c, g) = run(&decode, &mut cpu, &mut gpu);
        worst = worst.max(compare(&format!("{model} decode step {step}"), &c, &g));
        next = argmax(c.row(0)).0 as u32;
    }

    // KV blocks: what the GPU computed matches the CPU's; a CPU block written into GPU
    // storage reads back bit for bit (the transfer path between nodes of either kind).
    let n = cpu.block_len();
    let (mut cb, mut gb) = (vec![0f32; n], vec![0f32; n]);
    cpu.read_block(0, &mut cb);
    gpu.read_block(0, &mut gb);
    let diff: f64 = cb
        .iter()
        .zip(&gb)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = cb.iter().map(|a| (*a as f64).powi(2)).sum();
    assert!((diff / norm).sqrt() <= TOLERANCE, "KV block 0 differs");
    let spare = blocks as u32 - 1;
    gpu.write_block(spare, &cb);
    gpu.read_block(spare, &mut gb);
    assert_eq!(cb, gb, "write_block then read_block round-trips exactly");
    eprintln!(
        "{model}: {prompt_len} prompt tokens + {steps} steps, worst relative error {worst:.3e}"
    );
}

#[test]
fn tiny_prefill_and_decode_match_the_cpu() {
    if enabled("tiny_prefill_and_decode_match_the_cpu") {
        conformance("synthetic:tiny", 40, 16);
    }
}

#[test]
fn tiny_long_context_uses_key_splits_and_matches_the_cpu() {
    // 600 keys over 2 KV heads: too few blocks to fill a GPU, so prefill and decode both run
    // split-K with the combine kernel.
    if enabled("tiny_long_context_uses_key_splits_and_matches_the_cpu") {
        conformance("synthetic:tiny", 600, 8);
    }
}

#[test]
fn qwen3_0_6b_shape_matches_the_cpu() {
    if enabled("qwen3_0_6b_shape_matches_the_cpu") {
        conformance("synthetic:qwen3-0.6b", 64, 8);
    }
}

#[test]
fn batched_sequences_match_the_cpu() {
    if !enabled("batched_sequences_match_the_cpu") {
        return;
    }
    let files = files("synthetic:tiny");
    let blocks = 3 * 4 + 1;
    let mut cpu = executor(CpuBackend::new(), &files, blocks);
    let mut gpu = executor(CudaBackend::open(0, 0.5).expect("cuda:0"), &files, blocks);
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (s * 4..s * 4 + 4).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            (0..20 + 7 * s)
                .map(|i| (i * 31 + s * 1000 + 5) % 150_000)
                .collect()
        })
        .collect();
    let items: Vec<ExecItem<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| ExecItem {
            tokens: p,
            start: 0,
            block_table: t,
            all_logits: false,
        })
        .collect();
    let c = cpu.execute(&items);
    let g = gpu.execute(&items);
    for (i, (c, g)) in c.iter().zip(&g).enumerate() {
        compare(&format!("batched sequence {i}"), c, g);
    }
}
