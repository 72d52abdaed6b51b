//! `pdctl bench-model`: prefill and decode throughput of one model on the CPU backend, beside
//! the machine's memory-read bandwidth measured in the same run, so the result is a fraction
//! of the bandwidth floor rather than a bare number on a noisy shared machine.

use std::time::Instant;

use clap::Args;
use pd_engine::backend::cpu::{CpuBackend, CpuFeatures, isa};
use pd_engine::cli::KvCacheDtype;
use pd_engine::generate::{Runner, Sequence, StepItem};
use pd_engine::kv::{DEFAULT_BLOCK_SIZE, KvLayout};
use rayon::prelude::*;
use serde_json::json;

#[derive(Debug, Args)]
pub struct BenchModelArgs {
    /// Model directory or `synthetic:NAME`.
    #[arg(long, env = "PD_MODEL", default_value = "synthetic:qwen3-0.6b")]
    model: String,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Decode batch sizes to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16])]
    batch: Vec<usize>,
    /// Context length of each sequence before the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// How the KV cache is stored (`auto` is f32 on the CPU): 16-bit reads half the bytes.
    #[arg(long, default_value_t = KvCacheDtype::Auto)]
    kv_cache_dtype: KvCacheDtype,
    /// Repetitions of each measurement; the best is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Best-of-`repeat` read bandwidth (bytes/s) summing a buffer far larger than the caches
/// with every rayon thread, as the decode kernels read weights.
pub fn read_bandwidth(bytes: usize, repeat: usize) -> f64 {
    let words = bytes / 8;
    let buf: Vec<u64> = (0..words as u64)
        .into_par_iter()
        .map(|i| i.wrapping_mul(0x9E37))
        .collect();
    let mut best = 0.0f64;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max(bytes as f64 / dt);
    }
    best
}

pub fn run(args: BenchModelArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.prompt_len > 0, "--prompt-len must be > 0");
    anyhow::ensure!(args.decode_steps > 0, "--decode-steps must be > 0");
    anyhow::ensure!(
        !args.batch.is_empty() && !args.batch.contains(&0),
        "--batch sizes must be > 0"
    );
    let files = crate::load::open(&args.model)?;
    let model = crate::load::weights(&files)?;
    let weight_bytes = model.weight_bytes_per_step();
    let kv_dtype = args.kv_cache_dtype.on_cpu();
    // The kernels' instruction set: `PD_CPU_ISA`, else the best this host has.
    let backend = CpuBackend::from_env(kv_dtype)?;
    let cpu_isa = backend.isa();
    // K and V of one token, all layers, as the CPU backend stores them: what a decode step
    // reads per token of each sequence's context besides the weights.
    let layout = KvLayout::new(&files.config, DEFAULT_BLOCK_SIZE, kv_dtype)?;
    let kv_bytes_per_token = layout.block_bytes() / DEFAULT_BLOCK_SIZE;
    let vocab = files.config.vocab_size as u32;
    let max_batch = *args.batch.iter().max().expect("non-empty");
    let per_seq = args.prompt_len.max(args.decode_context + args.decode_steps);
    let blocks = max_batch * per_seq.div_ceil(DEFAULT_BLOCK_SIZE) + 1;
    let mut runner = Runner::new(backend, model, DEFAULT_BLOCK_SIZE, blocks)?;
    let threads = rayon::current_num_threads();

    let bandwidth_before = read_bandwidth(1 << 30, args.repeat);

    // Deterministic pseudo-random prompts.
    let prompt = |seed: usize, len: usize| -> Vec<u32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104_729 + 17) as u32) % vocab)
            .collect()
    };

    // Prefill: one prompt of prompt_len tokens in one forward pass.
    let mut prefill_best = 0.0f64;
    for r in 0..args.repeat.max(1) {
        let mut seq = Sequence::new(prompt(r, args.prompt_len));
        let t = Instant::now();
        runner.step(&mut [StepItem {
            seq: &mut seq,
            count: args.prompt_len,
            all_logits: false,
        }])?;
        let dt = t.elapsed().as_secs_f64();
        runner.release(&mut seq);
        prefill_best = prefill_best.max(args.prompt_len as f64 / dt);
    }

    let mut decode = Vec::new();
    for &batch in &args.batch {
        let mut seqs: Vec<Sequence> = (0..batch)
            .map(|b| Sequence::new(prompt(100 + b, args.decode_context)))
            .collect();
        for seq in seqs.iter_mut() {
            let n = seq.tokens.len();
            runner.step(&mut [StepItem {
                seq,
                count: n,
                all_logits: false,
            }])?;
        }
        let (mut best_step, mut best_context) = (f64::INFINITY, 0);
        for step in 0..args.decode_steps {
            for (b, seq) in seqs.iter_mut().enumerate() {
                seq.tokens.push(((step * 31 + b * 7) as u32) % vocab);
            }
            let mut items: Vec<StepItem<'_>> = seqs
                .iter_mut()
                .map(|seq| StepItem {
                    seq,
                    count: 1,
                    all_logits: false,
                })
                .collect();
            let t = Instant::now();
            runner.step(&mut items)?;
            let dt = t.elapsed().as_secs_f64();
            if dt < best_step {
                (best_step, best_context) = (dt, args.decode_context + step + 1);
            }
        }
        for seq in seqs.iter_mut() {
            runner.release(seq);
        }
        let tok_s = batch as f64 / best_step;
        let effective = weight_bytes as f64 / best_step;
        let kv_bytes = batch * best_context * kv_bytes_per_token;
        decode.push((batch, tok_s, effective, kv_bytes as f64 / best_step));
    }
    let bandwidth_after = read_bandwidth(1 << 30, args.repeat);
    let bandwidth = bandwidth_before.max(bandwidth_after);

    if args.json {
        let out = json!({
            "model": args.model,
            "dtype": files.config.dtype.torch_name(),
            "kv_cache_dtype": kv_dtype.torch_name(),
            "threads": threads,
            "cpu_isa": cpu_isa.name(),
            "cpu_isa_best": isa::Isa::best().name(),
            "cpu_flags": CpuFeatures::host().names(),
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "weight_bytes_per_step": weight_bytes,
            "prefill": {"prompt_len": args.prompt_len, "tokens_per_s": prefill_best},
            "decode": decode.iter().map(|(b, t, e, kv)| json!({
                "batch": b, "tokens_per_s": t,
                "weight_read_gb_s": e / 1e9, "fraction_of_bandwidth": e / bandwidth,
                "kv_read_gb_s": kv / 1e9,
                "fraction_of_bandwidth_with_kv": (e + kv) / bandwidth,
            })).collect::<Vec<_>>(),
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "model            {} ({}, KV cache {}, {} threads)",
        args.model, files.config.dtype, kv_dtype, threads
    );
    println!("CPU kernels      {}", isa::describe(cpu_isa));
    println!(
        "memory read      {:.1} GB/s (best of before/after, 1 GiB buffer)",
        bandwidth / 1e9
    );
    println!("weights / step   {:.1} MB", weight_bytes as f64 / 1e6);
    println!(
        "prefill          {:.1} tokens/s (prompt {})",
        prefill_best, args.prompt_len
    );
    for (batch, tok_s, effective, kv) in decode {
        println!(
            "decode batch {:<3} {:.1} tokens/s  weights read at {:.1} GB/s = {:.0} % of bandwidth \
             ({:.0} % with the KV cache's {:.1} GB/s)",
            batch,
            tok_s,
            effective / 1e9,
            100.0 * effective / bandwidth,
            100.0 * (effective + kv) / bandwidth,
            kv / 1e9
        );
    }
    Ok(())
}
