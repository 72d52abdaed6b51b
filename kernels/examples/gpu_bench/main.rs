//! The GPU benchmark of scripts/gpu-check.sh: this card's two ceilings (a device-to-device
//! copy and a large bf16 GEMM through cuBLAS), then per model decode tokens/s at batch 1, 8
//! and 64 with the fraction of the measured bandwidth reached, and prefill of 2,048 and 8,192
//! tokens with the fraction of the measured GEMM rate reached, and one layer's prefill
//! attention alone at those lengths on each kernel (f32 CUDA cores, tensor cores), and the KV
//! of a 2,048-token lease copied out of and into device memory in batches and one block at a
//! time (what a prefill node's lease and a decode node's import cost). Prints one table last
//! and writes every figure to OUT_DIR/gpu_bench.json, the table to OUT_DIR/table.txt.
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
//! inside a profiler range, for Nsight Compute to break down ([`profile_decode`]).
//!
//! `PD_GPU_BENCH_SMOKE=1` shrinks every size (a 4 MiB copy, a 128³ GEMM, 48 tokens of
//! context, 3 steps, prefills of 64 and 200 tokens): CI runs it on pd-cuda-emu (kernels/emu/)
//! so that the whole program has run before a GPU host runs it. Its figures mean nothing.

use std::fmt::Write as _;
use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr};
use pd_engine::backend::graph::DecodeGraphs;
use pd_engine::backend::{AttentionMeta, Backend, SeqAttention};
use pd_engine::config::ModelConfig;
use pd_engine::executor::{ExecItem, Executor};
use pd_engine::kv::KvLayout;
use pd_engine::kv::block_buffers::BlockBuffers;
use pd_engine::model::{ModelFiles, ModelSource};
use pd_engine::sampling::DeviceSampling;
use pd_engine::weights::DType;
use pd_kernels::CudaBackend;
use pd_kernels::cuda::gemm::{self, GemmType, Product};
use pd_kernels::cuda::plan::MIN_KEYS_PER_SPLIT;
use pd_kernels::cuda::{CudaTensor, GEMV_MAX_ROWS, SmallBatchLinear};
use serde_json::{Value, json};

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
            };
        }
        Self {
            copy_elems: 1 << 29, // f32 values: 2 GiB
            gemm: 8192,
            reps: 10,
            decode_context: 512,
            decode_steps: 32,
            prefill: [2048, 8192],
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

fn prompt(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729 + 17) as u32) % vocab)
        .collect()
}

/// One layer's causal prefill attention of `len` tokens at `config`'s head shape, on the f32
/// kernel (f32 output) and on the tensor cores (bf16 output): ms per call (median) and the
/// fraction of the GEMM rate `flops` its FLOPs reach (q·k and p·v over each row's prefix).
fn bench_attention(
    backend: &CudaBackend,
    config: &ModelConfig,
    len: usize,
    flops: f64,
    reps: usize,
) -> Vec<Value> {
    let layout = KvLayout {
        num_layers: 1,
        num_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        block_size: BLOCK,
        dtype: backend.kv_dtype(),
    };
    let blocks = len.div_ceil(BLOCK);
    let kv = backend.alloc_kv(&layout, blocks).expect("kv");
    let width = config.num_attention_heads * config.head_dim;
    let q = CudaTensor::new(
        len,
        width,
        backend
            .device()
            .stream
            .alloc_zeros(len * width)
            .expect("alloc"),
    );
    let meta = AttentionMeta {
        seqs: vec![SeqAttention {
            q_start: 0,
            q_len: len,
            context_len: len,
            block_table: (0..blocks as u32).collect(),
        }],
        num_heads: config.num_attention_heads,
        num_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        scale: (config.head_dim as f32).powf(-0.5),
    };
    let work = 4.0 * width as f64 * (len * (len + 1) / 2) as f64;
    let f32_ms = timed_ms(backend, reps, || {
        backend.paged_attention(&q, &kv, 0, &meta);
    });
    let mma_ms = timed_ms(backend, reps, || {
        backend.paged_attention_16bit(&q, &kv, 0, &meta, DType::BF16);
    });
    [("f32", f32_ms), ("mma", mma_ms)]
        .into_iter()
        .map(|(kernel, ms)| {
            json!({
                "tokens": len,
                "kernel": kernel,
                "ms": ms,
                "flops": work / (ms / 1e3),
                "gemm_fraction": work / (ms / 1e3) / flops,
            })
        })
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
    plans: Vec<Option<DeviceSampling>>,
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
            plans: vec![Some(DeviceSampling::Greedy); batch],
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
        exec.execute_sampling(&items, &self.plans, self.vocab);
    }
}

fn bench_model(model: &str, bandwidth: f64, flops: f64, sizes: &Sizes) -> Value {
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
fn profile_decode(model: &str, linear: SmallBatchLinear, sizes: &Sizes) {
    let context = sizes.decode_context;
    let per = (context + PROFILED_STEPS + 2).div_ceil(BLOCK);
    let (_, mut exec) = open_model(model, |_| per);
    exec.backend().set_small_batch_linear(linear);
    let seqs = DecodeBatch::new(&mut exec, 1, context, per);
    seqs.step(&mut exec, context); // warm-up: first use of each kernel and cuBLAS path
    exec.backend().synchronize();
    let launches = exec.backend().kernel_launches();
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
        "profiled {PROFILED_STEPS} decode step(s) of {model} (batch 1, {context}-token context, linear layers through {linear:?}): {} kernel launches per step",
        (exec.backend().kernel_launches() - launches) / PROFILED_STEPS as u64
    );
}

/// A `len`-token lease's KV between device and host memory, as a prefill node copies it out
/// (`read_blocks` into the page-locked buffer `host_buffer` lends: batches of blocks per
/// gather kernel and copy; and the same into heap memory) and a decode node copies it in
/// (`write_blocks`, from the page-locked buffers its imports arrive in, and from heap memory),
/// against the same blocks one call per block (a launch, a copy and, out, a
/// synchronization each): median ms of `reps` and GB/s of each.
fn bench_kv_transfer(exec: &mut Executor<CudaBackend>, len: usize, reps: usize) -> Value {
    let blocks: Vec<u32> = (0..len.div_ceil(BLOCK) as u32).collect();
    let block_bytes = exec.block_bytes();
    let bytes = blocks.len() * block_bytes;
    let mut host = vec![0u8; bytes];
    // A call returns once its copies are done (read) or queued (write): each is timed to the
    // device's synchronization.
    let mut lent = exec.host_buffer(bytes);
    let out_batched = median_ms(reps, || {
        exec.read_blocks(&blocks, lent.as_bytes_mut());
        exec.backend().synchronize();
    });
    drop(lent);
    let out_batched_heap = median_ms(reps, || {
        exec.read_blocks(&blocks, &mut host);
        exec.backend().synchronize();
    });
    let out_single = median_ms(reps, || {
        for (&b, dst) in blocks.iter().zip(host.chunks_exact_mut(block_bytes)) {
            exec.read_block(b, dst);
        }
        exec.backend().synchronize();
    });
    let staged: Vec<Vec<u8>> = host.chunks_exact(block_bytes).map(<[u8]>::to_vec).collect();
    let src: Vec<&[u8]> = staged.iter().map(Vec::as_slice).collect();
    let in_batched = median_ms(reps, || {
        exec.write_blocks(&blocks, &src);
        exec.backend().synchronize();
    });
    // As a decode node's import arrives: one buffer per block from the engine's recycled
    // buffers, page-locked ones lent by the backend (`host_allocator`).
    let imports = BlockBuffers::with_allocator(block_bytes, bytes, exec.host_allocator());
    let received: Vec<_> = staged
        .iter()
        .map(|b| {
            let mut buf = imports.take();
            buf.as_bytes_mut().copy_from_slice(b);
            buf
        })
        .collect();
    let received_src: Vec<&[u8]> = received.iter().map(|b| b.as_bytes()).collect();
    let in_batched_pinned = median_ms(reps, || {
        exec.write_blocks(&blocks, &received_src);
        exec.backend().synchronize();
    });
    // The same buffers as a decode node's puller writes them: through the import stream
    // (`block_writer`), from another thread, beside the engine's stream.
    let writer = exec.block_writer().expect("an import writer");
    let in_import_stream = median_ms(reps, || {
        let write = writer();
        std::thread::scope(|s| {
            s.spawn(|| write(&blocks, &received_src));
        });
    });
    drop(received_src);
    drop(received);
    let in_single = median_ms(reps, || {
        for (&b, data) in blocks.iter().zip(&src) {
            exec.write_block(b, data);
        }
        exec.backend().synchronize();
    });
    // The copy alone, device -> host, into pageable and into page-locked memory: the link's
    // speed either way, without the gather kernel.
    let backend = exec.backend();
    let dev = backend.device();
    let device_bytes: CudaSlice<u8> = dev.stream.alloc_zeros(bytes.max(1)).expect("alloc");
    let pageable_ms = timed_ms(backend, reps, || {
        dev.stream
            .memcpy_dtoh(&device_bytes, &mut host[..])
            .expect("copy");
    });
    // SAFETY: written by the copies below before anything reads it. Flags 0: cached memory
    // (the default write-combined memory is slow for the CPU to read, as a lease is read).
    let mut pinned = unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }
        .expect("page-locked host memory");
    let pinned_ms = timed_ms(backend, reps, || {
        dev.stream
            .memcpy_dtoh(&device_bytes, &mut pinned)
            .expect("copy");
    });
    let gb_s = |ms: f64| bytes as f64 / (ms / 1e3) / 1e9;
    json!({
        "dtoh_pageable_gb_s": gb_s(pageable_ms),
        "dtoh_pinned_gb_s": gb_s(pinned_ms),
        "tokens": len,
        "blocks": blocks.len(),
        "bytes": bytes,
        "out_batched_ms": out_batched,
        "out_batched_heap_ms": out_batched_heap,
        "out_batched_heap_gb_s": gb_s(out_batched_heap),
        "out_per_block_ms": out_single,
        "in_batched_ms": in_batched,
        "in_per_block_ms": in_single,
        "out_batched_gb_s": gb_s(out_batched),
        "out_per_block_gb_s": gb_s(out_single),
        "in_batched_gb_s": gb_s(in_batched),
        "in_batched_pinned_ms": in_batched_pinned,
        "in_batched_pinned_gb_s": gb_s(in_batched_pinned),
        "in_import_stream_ms": in_import_stream,
        "in_import_stream_gb_s": gb_s(in_import_stream),
        "in_per_block_gb_s": gb_s(in_single),
    })
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
    let results: Vec<Value> = models
        .iter()
        .map(|m| {
            eprintln!("benchmarking {m}");
            bench_model(m, bandwidth, flops, &sizes)
        })
        .collect();
    let report = json!({
        "gpu": gpu,
        "copy_bytes_per_s": bandwidth,
        "bf16_gemm_flops": flops,
        "models": results,
    });
    std::fs::create_dir_all(&out).expect("out dir");
    let path = out.join("gpu_bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).expect("json")).expect("write");
    // The table, printed last (scripts/gpu-check.sh prints it again at its very end).
    let mut table = String::new();
    writeln!(
        table,
        "\n{gpu}: copy {:.0} GB/s (read + write), bf16 GEMM {:.0} TFLOP/s",
        bandwidth / 1e9,
        flops / 1e12
    )
    .expect("writing to a String");
    writeln!(
        table,
        "{:<22} {:<16} {:>12} {:>14} {:>10} {:>12} {:>12} {:>12}",
        "model", "phase", "tokens/s", "of ceiling", "graphs", "gemv kernel", "+ graphs", "+ PDL"
    )
    .expect("writing to a String");
    // A decode figure that may be absent: the graphs fell back, or the kernel takes no batch
    // this large.
    let maybe = |v: &Value, absent: &str| match v.as_f64() {
        Some(t) => format!("{t:.1}"),
        None => absent.to_string(),
    };
    for m in &results {
        let name = m["model"].as_str().unwrap_or("?");
        for d in m["decode"].as_array().into_iter().flatten() {
            writeln!(
                table,
                "{:<22} {:<16} {:>12.1} {:>13.1}% {:>10} {:>12} {:>12} {:>12}",
                name,
                format!("decode b={}", d["batch"]),
                d["tokens_per_s"].as_f64().unwrap_or(0.0),
                100.0 * d["bandwidth_fraction"].as_f64().unwrap_or(0.0),
                maybe(&d["graphs_tokens_per_s"], "failed"),
                maybe(&d["gemv_kernel_tokens_per_s"], "-"),
                maybe(&d["gemv_kernel_graphs_tokens_per_s"], "-"),
                maybe(&d["gemv_kernel_graphs_pdl_tokens_per_s"], "-"),
            )
            .expect("writing to a String");
        }
        for p in m["prefill"].as_array().into_iter().flatten() {
            writeln!(
                table,
                "{:<22} {:<16} {:>12.1} {:>13.1}% {:>10}",
                name,
                format!("prefill {}", p["tokens"]),
                p["tokens_per_s"].as_f64().unwrap_or(0.0),
                100.0 * p["gemm_fraction"].as_f64().unwrap_or(0.0),
                "-"
            )
            .expect("writing to a String");
        }
        for a in m["attention"].as_array().into_iter().flatten() {
            writeln!(
                table,
                "{:<22} {:<16} {:>12.1} {:>13.1}% {:>10}",
                name,
                format!(
                    "attn {} {}",
                    a["tokens"],
                    a["kernel"].as_str().unwrap_or("?")
                ),
                a["tokens"].as_f64().unwrap_or(0.0) / (a["ms"].as_f64().unwrap_or(1.0) / 1e3),
                100.0 * a["gemm_fraction"].as_f64().unwrap_or(0.0),
                "-"
            )
            .expect("writing to a String");
        }
    }
    for m in &results {
        let k = &m["kv_transfer"];
        writeln!(
        table,
            "{:<22} KV of a {}-token lease ({} blocks, {:.1} MB): device -> host {:.2} GB/s batched (page-locked, as a lease), {:.2} into heap memory, {:.2} one block at a time; host -> device {:.2} batched from page-locked import buffers ({:.2} through the import stream from another thread), {:.2} from heap memory, {:.2} one block at a time; the copy alone into pageable memory {:.2} GB/s, into page-locked {:.2}",
            m["model"].as_str().unwrap_or("?"),
            k["tokens"],
            k["blocks"],
            k["bytes"].as_f64().unwrap_or(0.0) / 1e6,
            k["out_batched_gb_s"].as_f64().unwrap_or(0.0),
            k["out_batched_heap_gb_s"].as_f64().unwrap_or(0.0),
            k["out_per_block_gb_s"].as_f64().unwrap_or(0.0),
            k["in_batched_pinned_gb_s"].as_f64().unwrap_or(0.0),
            k["in_import_stream_gb_s"].as_f64().unwrap_or(0.0),
            k["in_batched_gb_s"].as_f64().unwrap_or(0.0),
            k["in_per_block_gb_s"].as_f64().unwrap_or(0.0),
            k["dtoh_pageable_gb_s"].as_f64().unwrap_or(0.0),
            k["dtoh_pinned_gb_s"].as_f64().unwrap_or(0.0),
        )
        .expect("writing to a String");
    }
    for m in &results {
        for d in m["decode"].as_array().into_iter().flatten() {
            let Some(by) = d["graphs_tokens_per_s_by_min_keys_per_split"].as_object() else {
                continue;
            };
            if by.is_empty() {
                continue;
            }
            let mut cells: Vec<(usize, String)> = by
                .iter()
                .map(|(k, v)| (k.parse().unwrap_or(0), maybe(v, "failed")))
                .collect();
            cells.sort();
            let cells: Vec<String> = cells.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            writeln!(
                table,
                "{:<22} decode b={} with graphs, tokens/s by the least keys per split (default {MIN_KEYS_PER_SPLIT}): {}",
                m["model"].as_str().unwrap_or("?"),
                d["batch"],
                cells.join(", ")
            )
            .expect("writing to a String");
        }
    }
    writeln!(
        table,
        "(decode: fraction of the copy bandwidth, linear layers through cuBLAS; \"gemv kernel\": the same steps with PD_CUDA_GEMV=kernel, eager, with graphs, and with graphs and PD_CUDA_PDL=on; prefill: fraction of the GEMM rate, linear FLOPs only; attn: one layer's prefill attention alone, f32 CUDA cores or tensor cores, its FLOPs as a fraction of the GEMM rate; full results in {})",
        path.display()
    )
    .expect("writing to a String");
    print!("{table}");
    std::fs::write(out.join("table.txt"), &table).expect("write the table");
}
