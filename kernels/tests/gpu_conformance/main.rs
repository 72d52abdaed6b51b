//! The backend conformance suite, CUDA against the CPU reference, on a GPU host
//! (scripts/gpu-check.sh). Every test is `#[ignore]`d, so `cargo test` on a machine without a
//! GPU lists them as ignored rather than passed; the GPU host runs them with `--ignored`, and
//! CI runs them with `--ignored` on pd-cuda-emu (scripts/cuda-check.sh) after checking the
//! kernels through NVRTC and ptxas.
//!
//! Teacher-forced: both backends see the same tokens (the CPU's greedy choice each step), so
//! one divergence cannot cascade. Per logits row ([`pd_engine::backend::conformance`]):
//! relative error ‖gpu − cpu‖ / ‖cpu‖ ≤ 1e-2 (bf16 tolerance), and the greedy token must be
//! equal wherever the CPU's top-2 margin is clear (above 4 × 1e-2 × the row's RMS).
#![cfg(feature = "cuda")]

mod attention;
mod blocks;
mod gemv;
mod import;
mod moe;
mod sampling;
mod stacked;

use pd_engine::backend::conformance::{argmax, compare_logits};
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::backend::{Backend, HostMatrix};
use pd_engine::executor::{ExecItem, Executor};
use pd_engine::model::{ModelFiles, ModelSource};
use pd_engine::weights::{Checkpoint, DType};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::CudaWeight;

const BLOCK: usize = 16;
const TOLERANCE: f64 = 1e-2;

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

/// Worst relative error over the rows, each within [`TOLERANCE`]; panics on a clear greedy
/// mismatch or a non-finite logit ([`compare_logits`]).
fn compare(what: &str, cpu: &HostMatrix, gpu: &HostMatrix) -> f64 {
    compare_logits(what, cpu, gpu, TOLERANCE)
}

fn conformance(model: &str, prompt_len: usize, steps: usize) {
    let files = files(model);
    let blocks = (prompt_len + steps).div_ceil(BLOCK) + 2;
    let gpu_backend = CudaBackend::open(0, 0.5).expect("cuda:0 opens");
    let mut gpu = executor(gpu_backend, &files, blocks);
    // The same KV cache type on both (auto on the GPU: the weights' type), so that blocks
    // move between them as they do between nodes: as stored.
    let kv_dtype = gpu.backend().kv_dtype();
    let mut cpu = executor(CpuBackend::with_kv_dtype(kv_dtype), &files, blocks);
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
    // storage reads back byte for byte (the transfer path between nodes of either kind).
    let n = cpu.block_bytes();
    assert_eq!(gpu.block_bytes(), n, "the same transfer layout");
    let (mut cb, mut gb) = (vec![0u8; n], vec![0u8; n]);
    cpu.read_block(0, &mut cb);
    gpu.read_block(0, &mut gb);
    let (c, g) = (widen(kv_dtype, &cb), widen(kv_dtype, &gb));
    let diff: f64 = c
        .iter()
        .zip(&g)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum();
    assert!((diff / norm).sqrt() <= TOLERANCE, "KV block 0 differs");
    let spare = blocks as u32 - 1;
    gpu.write_block(spare, &cb);
    gpu.read_block(spare, &mut gb);
    assert!(
        cb == gb,
        "write_block then read_block round-trips ({kv_dtype:?} storage)"
    );
    eprintln!(
        "{model}: {prompt_len} prompt tokens + {steps} steps, worst relative error {worst:.3e}"
    );
}

/// A block's bytes in the transfer layout, as f32 values.
fn widen(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytemuck::pod_collect_to_vec(bytes),
        DType::BF16 => bytemuck::pod_collect_to_vec::<u8, half::bf16>(bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect(),
        DType::F16 => bytemuck::pod_collect_to_vec::<u8, half::f16>(bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect(),
    }
}

/// A `[rows, cols]` 16-bit matrix of raw little-endian `data`, written as a real safetensors
/// file under `dir` and uploaded the way model weights are.
pub(crate) fn upload_matrix(
    gpu: &CudaBackend,
    dtype: DType,
    (rows, cols): (usize, usize),
    data: &[u8],
    dir: &std::path::Path,
) -> CudaWeight {
    use std::io::Write;
    let name = match dtype {
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        other => panic!("not a 16-bit type: {other:?}"),
    };
    let header = format!(
        r#"{{"w":{{"dtype":"{name}","shape":[{rows},{cols}],"data_offsets":[0,{}]}}}}"#,
        data.len()
    );
    let path = dir.join("model.safetensors");
    let mut file = std::fs::File::create(&path).expect("create");
    file.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| file.write_all(header.as_bytes()))
        .and_then(|()| file.write_all(data))
        .expect("write");
    drop(file);
    let ckpt = Checkpoint::open(dir).expect("checkpoint");
    let w = gpu
        .load_weight("w", ckpt.tensor("w", &[rows, cols]).expect("tensor"))
        .expect("upload");
    std::fs::remove_file(path).expect("remove");
    w
}

/// `values` as a KV cache of `dtype` stores them (rounded to nearest even), in bytes.
pub(crate) fn narrow(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(values).to_vec(),
        DType::BF16 => {
            let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        DType::F16 => {
            let v: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn tiny_prefill_and_decode_match_the_cpu() {
    conformance("synthetic:tiny", 40, 16);
}

/// Qwen3-MoE, next to a dense layer: a 40-token prefill and decode steps routed on the device
/// and streamed (`moe.cu`), and a 300-token prefill through the grouped path.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn tiny_moe_prefill_and_decode_match_the_cpu() {
    conformance("synthetic:tiny-moe", 40, 16);
    conformance("synthetic:tiny-moe", 300, 2);
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn tiny_long_context_uses_key_splits_and_matches_the_cpu() {
    // 600 keys over 2 KV heads: too few blocks to fill a GPU, so prefill and decode both run
    // split-K, merged by the last split to finish.
    conformance("synthetic:tiny", 600, 8);
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn qwen3_0_6b_shape_matches_the_cpu() {
    conformance("synthetic:qwen3-0.6b", 64, 8);
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn batched_sequences_match_the_cpu() {
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

/// Deterministic values in [0, 1) without an RNG crate (SplitMix64).
fn unit(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

/// Decode through captured CUDA graphs gives the logits of eager decode: a batch of 3 (the
/// bucket of 4 has a padding row) with prompts of `prompts` tokens, 12 steps, the graph
/// replayed from the second step on; graphs for contexts up to `per` blocks.
fn graphs_match_eager(model: &str, prompts: [u32; 3], per: usize) {
    use pd_engine::backend::graph::DecodeGraphs;

    let files = files(model);
    let blocks = 3 * per + 1;
    let mut eager = executor(CudaBackend::open(0, 0.4).expect("cuda:0"), &files, blocks);
    let mut graphs = executor(CudaBackend::open(0, 0.4).expect("cuda:0"), &files, blocks);
    graphs.set_decode_graphs(Some(DecodeGraphs::new(8, per * BLOCK, BLOCK)));
    let tables: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (s * per as u32..(s + 1) * per as u32).collect())
        .collect();
    let vocab = files.config.vocab_size as u32;
    let mut tokens: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            (0..prompts[s as usize])
                .map(|i| (i * 613 + s * 7 + 3) % vocab)
                .collect()
        })
        .collect();
    let mut computed = [0usize; 3];
    // Stream-ordered allocations per step, eager and through graphs.
    let mut allocated = Vec::new();
    for step in 0..13 {
        let before = [&eager, &graphs].map(|e| e.backend().stream_allocations());
        let items: Vec<ExecItem<'_>> = (0..3)
            .map(|i| ExecItem {
                tokens: &tokens[i][computed[i]..],
                start: computed[i],
                block_table: &tables[i],
                all_logits: false,
            })
            .collect();
        let e = eager.execute(&items);
        let g = graphs.execute(&items);
        let after = [&eager, &graphs].map(|e| e.backend().stream_allocations());
        allocated.push([after[0] - before[0], after[1] - before[1]]);
        for (i, (e, g)) in e.iter().zip(&g).enumerate() {
            compare(&format!("{model} graphs step {step} sequence {i}"), e, g);
        }
        for i in 0..3 {
            computed[i] = tokens[i].len();
            tokens[i].push(argmax(e[i].row(0)).0 as u32);
        }
    }
    assert_eq!(
        graphs.backend().decode_graphs_captured(),
        1,
        "the bucket of 4 was captured (not an eager fallback)"
    );
    // Buffers are recycled: from the third step on (the first decode step warms the eager
    // pool and captures the graph) no step allocates on the stream, and the graph took
    // every buffer from the graph pool (no memory nodes between its kernels).
    assert!(
        allocated[..2].iter().all(|a| a[0] > 0),
        "the first steps allocate: {allocated:?}"
    );
    assert!(
        allocated[3..].iter().all(|a| *a == [0, 0]),
        "steady decode steps allocate nothing, [eager, graphs] per step: {allocated:?}"
    );
    assert_eq!(graphs.backend().decode_graph_allocations(), 0);
    assert!(
        graphs.backend().pooled_bytes().1 > 0,
        "the graph pool holds its buffers"
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn decode_graphs_match_eager_decode() {
    graphs_match_eager("synthetic:tiny", [9, 14, 19], 4);
    graphs_match_eager("synthetic:qwen3-0.6b", [9, 14, 19], 4);
    // Graphs shaped for 2,048 keys (8 key splits) over contexts of ~300, ~40 and ~10:
    // each sequence is split as its own length asks (2 splits, 1, 1), as eagerly.
    graphs_match_eager("synthetic:tiny", [300, 40, 9], 128);
}
