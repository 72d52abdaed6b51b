//! Per model: decode at batch 1, 8 and 64 (eager, graphs, GEMV kernels, PDL, key splits),
//! prefill, and the one-step decode `--profile-decode` puts under Nsight Compute.

use std::time::Instant;

use pd_engine::backend::graph::DecodeGraphs;
use pd_engine::executor::{ExecItem, Executor, ItemWants, NextToken};
use pd_engine::model::{ModelFiles, ModelSource};
use pd_engine::sampling::{DeviceSampling, SamplePlan};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::plan::MIN_KEYS_PER_SPLIT;
use pd_kernels::cuda::{GEMV_MAX_ROWS, SmallBatchLinear};
use serde_json::{Value, json};

use super::attention::bench_attention;
use super::transfer::bench_kv_transfer;
use super::{BLOCK, Sizes};

fn prompt(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729 + 17) as u32) % vocab)
        .collect()
}

/// A model on cuda:0: its files and an executor with `blocks` KV blocks.
fn open_model(
    model: &str,
    blocks: impl FnOnce(&ModelFiles) -> usize,
) -> (ModelFiles, Executor<CudaBackend>) {
    let dir = ModelSource::parse(model)
        .expect("model name")
        .resolve(&|_, _| {})
        .expect("model directory");
    let files = ModelFiles::open(&dir).expect("model files");
    let backend = CudaBackend::open(0, 0.9).expect("cuda:0");
    let weights = files
        .load_weights(&backend, &mut |_, _| {})
        .expect("weights");
    let blocks = blocks(&files);
    let exec = Executor::new(backend, weights, BLOCK, blocks).expect("executor");
    (files, exec)
}

/// `batch` sequences with a `context`-token prompt each in KV (blocks `s · per ..` for
/// sequence `s`), decoded one token per step with greedy tokens chosen on the device, as the
/// engine does.
struct DecodeBatch {
    tables: Vec<Vec<u32>>,
    tokens: Vec<[u32; 1]>,
    wants: Vec<ItemWants<'static>>,
    vocab: usize,
}

impl DecodeBatch {
    /// Prefills the prompts.
    fn new(exec: &mut Executor<CudaBackend>, batch: usize, context: usize, per: usize) -> Self {
        let vocab = exec.model().config().vocab_size;
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect())
            .collect();
        for (s, t) in tables.iter().enumerate() {
            exec.execute(&[ExecItem {
                tokens: &prompt(s, context, vocab as u32),
                start: 0,
                block_table: t,
                all_logits: false,
            }]);
        }
        Self {
            tables,
            tokens: (0..batch)
                .map(|s| [(s as u32 * 31 + 7) % vocab as u32])
                .collect(),
            wants: vec![
                ItemWants {
                    prompt: None,
                    next: NextToken::sample(Some(SamplePlan {
                        method: DeviceSampling::Greedy,
                        reshape: None,
                        top_logprobs: 0,
                    })),
                };
                batch
            ],
            vocab,
        }
    }

    /// One decode step writing every sequence's token at `position`.
    fn step(&self, exec: &mut Executor<CudaBackend>, position: usize) {
        let items: Vec<ExecItem<'_>> = self
            .tokens
            .iter()
            .zip(&self.tables)
            .map(|(tok, t)| ExecItem {
                tokens: tok,
                start: position,
                block_table: t,
                all_logits: false,
            })
            .collect();
        exec.execute_sampling(&items, &self.wants, self.vocab);
    }
}

pub(crate) fn bench_model(model: &str, bandwidth: f64, flops: f64, sizes: &Sizes) -> Value {
    let (decode_context, decode_steps) = (sizes.decode_context, sizes.decode_steps);
    let max_batch = 64;
    // Eager steps, then as many with graphs (plus their warm-up / capture step).
    let decode_len = decode_context + 2 * decode_steps + 2;
    let per = decode_len.div_ceil(BLOCK);
    let (files, mut exec) = open_model(model, |_| {
        max_batch * per + decode_len.max(sizes.prefill[1]).div_ceil(BLOCK)
    });
    let weight_bytes = exec.model().weight_bytes_per_step() as f64;
    let linear_flops_per_token = 2.0 * weight_bytes / files.config.dtype.size_in_bytes() as f64;
    let vocab = files.config.vocab_size as u32;
    let max_model_len = files.config.max_position_embeddings;

    let mut decode = Vec::new();
    for batch in [1usize, 8, 64] {
        let seqs = DecodeBatch::new(&mut exec, batch, decode_context, per);
        // Seconds per step of `decode_steps` steps from position `first`, after one warm-up
        // step (which captures the graph when graphs are on).
        let timed_steps = |exec: &mut Executor<CudaBackend>, first: usize| {
            seqs.step(exec, first);
            let t = Instant::now();
            for i in 1..=decode_steps {
                seqs.step(exec, first + i);
            }
            t.elapsed().as_secs_f64() / decode_steps as f64
        };
        // Eager and with graphs, through cuBLAS and (for batches they take) through the
        // gemv16 kernels (`PD_CUDA_GEMV=kernel`), those also with graphs and programmatic
        // dependent launch (`PD_CUDA_PDL=on`); every run starts at the same position, so all
        // read the same context. None where graphs fell back to eager launches.
        let mut run = |linear: SmallBatchLinear, graphs: bool, pdl: bool, min_keys: usize| {
            exec.backend().set_small_batch_linear(linear);
            exec.backend().set_programmatic_launch(pdl);
            exec.backend().set_min_keys_per_split(min_keys);
            exec.set_decode_graphs(
                graphs.then(|| DecodeGraphs::new(max_batch, max_model_len, BLOCK)),
            );
            let secs = timed_steps(&mut exec, decode_context);
            let ok = !graphs || exec.backend().decode_graphs_captured() > 0;
            exec.set_decode_graphs(None);
            ok.then_some(secs)
        };
        let default_min = MIN_KEYS_PER_SPLIT;
        let secs = run(SmallBatchLinear::Cublas, false, false, default_min).expect("eager steps");
        let graph_secs = run(SmallBatchLinear::Cublas, true, false, default_min);
        let (kernel_secs, kernel_graph_secs, kernel_pdl_secs) = if batch <= GEMV_MAX_ROWS {
            (
                run(SmallBatchLinear::Kernel, false, false, default_min),
                run(SmallBatchLinear::Kernel, true, false, default_min),
                run(SmallBatchLinear::Kernel, true, true, default_min),
            )
        } else {
            (None, None, None)
        };
        // Decode attention is latency-bound at small batches: graphs again (cuBLAS) with
        // finer key splits than the default, to choose `MIN_KEYS_PER_SPLIT` by.
        let mut by_min_keys = serde_json::Map::new();
        if batch <= GEMV_MAX_ROWS {
            for min_keys in [32usize, 64, 128] {
                let secs = run(SmallBatchLinear::Cublas, true, false, min_keys);
                by_min_keys.insert(min_keys.to_string(), json!(secs.map(|t| batch as f64 / t)));
            }
            by_min_keys.insert(
                default_min.to_string(),
                json!(graph_secs.map(|t| batch as f64 / t)),
            );
        }
        exec.backend()
            .set_small_batch_linear(SmallBatchLinear::Cublas);
        exec.backend().set_programmatic_launch(false);
        exec.backend().set_min_keys_per_split(default_min);
        // Bytes of one step: every weight once plus each sequence's K and V, as stored
        // (`--kv-cache-dtype auto`: the model's dtype).
        let kv_bytes = (batch * (decode_context + decode_steps / 2)) as f64
            * (2 * files.config.num_hidden_layers
                * files.config.num_key_value_heads
                * files.config.head_dim
                * exec.backend().kv_dtype().size_in_bytes()) as f64;
        decode.push(json!({
            "batch": batch,
            "step_ms": secs * 1e3,
            "tokens_per_s": batch as f64 / secs,
            "bandwidth_fraction": (weight_bytes + kv_bytes) / secs / bandwidth,
            "graphs_tokens_per_s": graph_secs.map(|t| batch as f64 / t),
            "graphs_bandwidth_fraction": graph_secs.map(|t| (weight_bytes + kv_bytes) / t / bandwidth),
            "gemv_kernel_tokens_per_s": kernel_secs.map(|t| batch as f64 / t),
            "gemv_kernel_bandwidth_fraction": kernel_secs.map(|t| (weight_bytes + kv_bytes) / t / bandwidth),
            "gemv_kernel_graphs_tokens_per_s": kernel_graph_secs.map(|t| batch as f64 / t),
            "gemv_kernel_graphs_bandwidth_fraction": kernel_graph_secs.map(|t| (weight_bytes + kv_bytes) / t / bandwidth),
            "gemv_kernel_graphs_pdl_tokens_per_s": kernel_pdl_secs.map(|t| batch as f64 / t),
            "gemv_kernel_graphs_pdl_bandwidth_fraction": kernel_pdl_secs.map(|t| (weight_bytes + kv_bytes) / t / bandwidth),
            "graphs_tokens_per_s_by_min_keys_per_split": by_min_keys,
        }));
    }

    let mut prefill = Vec::new();
    for len in sizes.prefill {
        let table: Vec<u32> = (0..len.div_ceil(BLOCK) as u32).collect();
        let p = prompt(999, len, vocab);
        let mut run = || {
            exec.execute(&[ExecItem {
                tokens: &p,
                start: 0,
                block_table: &table,
                all_logits: false,
            }]);
        };
        run(); // warm-up
        let t = Instant::now();
        run();
        let secs = t.elapsed().as_secs_f64();
        prefill.push(json!({
            "tokens": len,
            "ms": secs * 1e3,
            "tokens_per_s": len as f64 / secs,
            // Linear layers only (attention FLOPs not counted): the GEMM share of the step.
            "gemm_fraction": linear_flops_per_token * len as f64 / secs / flops,
        }));
    }
    let attention: Vec<Value> = sizes
        .prefill
        .iter()
        .flat_map(|&len| bench_attention(exec.backend(), &files.config, len, flops, sizes.reps))
        .collect();
    let kv_transfer = bench_kv_transfer(&mut exec, sizes.prefill[0], sizes.reps);
    json!({
        "model": model,
        "decode": decode,
        "prefill": prefill,
        "attention": attention,
        "kv_transfer": kv_transfer,
    })
}

/// Decode steps `--profile-decode` runs inside the profiler's range.
const PROFILED_STEPS: usize = 1;

/// `gpu_bench --profile-decode MODEL cublas|kernel`, run under Nsight Compute by
/// scripts/gpu-check.sh: a batch-1 decode step of MODEL after a 512-token context, eager, the
/// linear layers through cuBLAS or the `gemv16` kernels (`PD_CUDA_GEMV`). Only that step
/// lies between `cuProfilerStart` and `cuProfilerStop` (`ncu --profile-from-start off`), so
/// ncu's per-kernel summary says where a step's time goes. Prints the kernel launches this
/// backend issued per step (cuBLAS's own not counted).
pub(crate) fn profile_decode(model: &str, linear: SmallBatchLinear, sizes: &Sizes) {
    let context = sizes.decode_context;
    let per = (context + PROFILED_STEPS + 2).div_ceil(BLOCK);
    let (_, mut exec) = open_model(model, |_| per);
    exec.backend().set_small_batch_linear(linear);
    let seqs = DecodeBatch::new(&mut exec, 1, context, per);
    seqs.step(&mut exec, context); // warm-up: first use of each kernel and cuBLAS path
    exec.backend().synchronize();
    let launches = exec.backend().kernel_launches();
    let allocations = exec.backend().stream_allocations();
    let programmatic = exec.backend().programmatic_launches();
    let stream = &exec.backend().device().stream;
    stream.context().bind_to_thread().expect("bind the context");
    // SAFETY: plain driver calls on the bound context; they only mark the profiled range.
    unsafe { cudarc::driver::sys::cuProfilerStart() }
        .result()
        .expect("cuProfilerStart");
    for i in 1..=PROFILED_STEPS {
        seqs.step(&mut exec, context + i);
    }
    exec.backend().synchronize();
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::cuProfilerStop() }
        .result()
        .expect("cuProfilerStop");
    println!(
        "profiled {PROFILED_STEPS} decode step(s) of {model} (batch 1, {context}-token context, linear layers through {linear:?}): {} kernel launches ({} programmatically dependent) and {} stream-ordered allocations per step",
        (exec.backend().kernel_launches() - launches) / PROFILED_STEPS as u64,
        (exec.backend().programmatic_launches() - programmatic) / PROFILED_STEPS as u64,
        (exec.backend().stream_allocations() - allocations) / PROFILED_STEPS as u64
    );
}
