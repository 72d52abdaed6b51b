//! The backend conformance suite, CUDA against the CPU reference, on a GPU host
//! (scripts/gpu-check.sh). Skipped with a message unless `PD_GPU_TESTS=1`, so CI machines
//! without a GPU pass it trivially; they check the kernels through NVRTC and ptxas instead.
//!
//! Teacher-forced: both backends see the same tokens (the CPU's greedy choice each step), so
//! one divergence cannot cascade. Per logits row ([`pd_engine::backend::conformance`]):
//! relative error ‖gpu − cpu‖ / ‖cpu‖ ≤ 1e-2 (bf16 tolerance), and the greedy token must be
//! equal wherever the CPU's top-2 margin is clear (above 4 × 1e-2 × the row's RMS).
#![cfg(feature = "cuda")]

mod attention;
mod gemv;
mod import;

use pd_engine::backend::conformance::{argmax, compare_logits};
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::backend::{Backend, HostMatrix, QkNormRope};
use pd_engine::executor::{ExecItem, Executor};
use pd_engine::kv::KvLayout;
use pd_engine::kv::block_buffers::BlockBuffers;
use pd_engine::model::{ModelFiles, ModelSource};
use pd_engine::weights::{Checkpoint, DType};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::{CudaTensor, CudaWeight};

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
fn tiny_prefill_and_decode_match_the_cpu() {
    if enabled("tiny_prefill_and_decode_match_the_cpu") {
        conformance("synthetic:tiny", 40, 16);
    }
}

#[test]
fn tiny_long_context_uses_key_splits_and_matches_the_cpu() {
    // 600 keys over 2 KV heads: too few blocks to fill a GPU, so prefill and decode both run
    // split-K, merged by the last split to finish.
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

/// A block's worth of seeded bytes, different for every `seed`.
fn pattern(seed: usize, len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (seed as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Leases, host-tier spills and imports move many blocks per call: a batch larger than one
/// staging batch of the Qwen3-0.6B shape (36 blocks in bf16, 18 in f32) lands where it is
/// written and reads back byte for byte in any order, repeats included, and agrees with
/// the one-block calls.
#[test]
fn kv_blocks_move_in_batches_byte_for_byte() {
    if !enabled("kv_blocks_move_in_batches_byte_for_byte") {
        return;
    }
    let files = files("synthetic:qwen3-0.6b");
    let n = 40;
    for dtype in [DType::BF16, DType::F32] {
        let gpu = CudaBackend::open_with(0, 0.5, Some(dtype)).expect("cuda:0 opens");
        let layout = KvLayout::new(&files.config, BLOCK, dtype).expect("layout");
        let mut kv = gpu.alloc_kv(&layout, n).expect("KV storage");
        let bytes = layout.block_bytes();
        let sources: Vec<Vec<u8>> = (0..n).map(|b| pattern(b, bytes)).collect();
        // Source b goes to block (b * 7) % n: the ids of one batch are not consecutive.
        let ids: Vec<u32> = (0..n).map(|b| ((b * 7) % n) as u32).collect();
        let src: Vec<&[u8]> = sources.iter().map(Vec::as_slice).collect();
        gpu.write_blocks(&mut kv, &ids, &src);

        let order: Vec<usize> = (0..n).rev().chain([3, 3]).collect();
        let read_ids: Vec<u32> = order.iter().map(|&b| ids[b]).collect();
        let mut out = vec![0u8; read_ids.len() * bytes];
        gpu.read_blocks(&kv, &read_ids, &mut out);
        for (i, &b) in order.iter().enumerate() {
            assert!(
                out[i * bytes..(i + 1) * bytes] == sources[b][..],
                "{dtype:?}: block {} (read {i} of the batch) holds what was written to it",
                ids[b]
            );
        }

        let mut one = vec![0u8; bytes];
        gpu.read_block(&kv, ids[5], &mut one);
        assert!(one == sources[5], "{dtype:?}: read_block agrees");
        gpu.write_block(&mut kv, ids[5], &sources[6]);
        gpu.read_blocks(&kv, &[ids[4], ids[5]], &mut out[..2 * bytes]);
        assert!(
            out[..bytes] == sources[4][..] && out[bytes..2 * bytes] == sources[6][..],
            "{dtype:?}: write_block replaced one block and no other"
        );
    }
}

/// A GPU prefill node's lease is copied into page-locked memory lent from a pool
/// (`Backend::host_buffer`): the same bytes as a copy into heap memory, readable and
/// returned from another thread (an exporter's), and lent again to the next lease instead of
/// pinning more.
#[test]
fn leases_land_in_reused_page_locked_buffers() {
    if !enabled("leases_land_in_reused_page_locked_buffers") {
        return;
    }
    let n = 40;
    let (gpu, mut kv, bytes) = bf16_kv(n);
    let sources: Vec<Vec<u8>> = (0..n).map(|b| pattern(100 + b, bytes)).collect();
    let ids: Vec<u32> = (0..n as u32).collect();
    let src: Vec<&[u8]> = sources.iter().map(Vec::as_slice).collect();
    gpu.write_blocks(&mut kv, &ids, &src);
    let lease: Vec<u32> = (0..n as u32).rev().collect();
    let mut heap = vec![0u8; n * bytes];
    gpu.read_blocks(&kv, &lease, &mut heap);

    assert_eq!(gpu.pinned_usage(), (0, 0), "nothing pinned before a lease");
    let mut buffer = gpu.host_buffer(n * bytes);
    let (lent, _) = gpu.pinned_usage();
    assert!(
        lent >= n * bytes,
        "the lease's buffer is page-locked ({lent} bytes lent)"
    );
    gpu.read_blocks(&kv, &lease, buffer.as_bytes_mut());
    let reader = std::thread::spawn(move || {
        assert!(
            buffer.as_bytes() == &heap[..],
            "the same bytes as into heap memory"
        );
        drop(buffer);
    });
    reader.join().expect("the reader thread");
    assert_eq!(
        gpu.pinned_usage(),
        (0, lent),
        "returned, and kept for the next lease"
    );
    let again = gpu.host_buffer(n * bytes - bytes);
    assert_eq!(
        gpu.pinned_usage(),
        (lent, 0),
        "a slightly shorter lease reuses it"
    );
    drop(again);
}

/// The host tier restores blocks through one page-locked batch buffer (`Backend::host_buffer`),
/// refilled for the next batch as soon as `write_blocks` returns: a copy still reading it
/// then would land the next batch's bytes in this batch's blocks.
#[test]
fn blocks_written_from_a_refilled_page_locked_buffer_keep_their_bytes() {
    if !enabled("blocks_written_from_a_refilled_page_locked_buffer_keep_their_bytes") {
        return;
    }
    let (n, batches) = (36, 3);
    let (gpu, mut kv, bytes) = bf16_kv(n * batches);
    let mut buffer = gpu.host_buffer(n * bytes);
    for batch in 0..batches {
        let buf = buffer.as_bytes_mut();
        for (b, dst) in buf.chunks_exact_mut(bytes).enumerate() {
            dst.copy_from_slice(&pattern(1000 * batch + b, bytes));
        }
        let ids: Vec<u32> = (0..n).map(|b| (batch * n + b) as u32).collect();
        let src: Vec<&[u8]> = buffer.as_bytes().chunks_exact(bytes).collect();
        gpu.write_blocks(&mut kv, &ids, &src);
    }
    // Overwrite the buffer once more, as the tier does for the next restore.
    buffer.as_bytes_mut().fill(0xA5);
    let mut out = vec![0u8; bytes];
    for batch in 0..batches {
        for b in 0..n {
            gpu.read_block(&kv, (batch * n + b) as u32, &mut out);
            assert!(
                out == pattern(1000 * batch + b, bytes),
                "block {b} of batch {batch} holds its own bytes, not a later batch's"
            );
        }
    }
}

/// A GPU decode node receives imported blocks straight into page-locked buffers
/// (`Backend::host_allocator`, through the engine's `BlockBuffers`), lent on the importer's
/// thread, not the engine's: they are page-locked, their blocks land where `write_blocks` puts
/// them, and given back they serve the next import without pinning more.
#[test]
fn imports_arrive_in_page_locked_buffers_lent_on_another_thread() {
    if !enabled("imports_arrive_in_page_locked_buffers_lent_on_another_thread") {
        return;
    }
    let n = 40;
    let (gpu, mut kv, bytes) = bf16_kv(n);
    let buffers = BlockBuffers::with_allocator(bytes, 1 << 30, gpu.host_allocator());
    let receive = |seed: usize| {
        let buffers = buffers.clone();
        std::thread::spawn(move || {
            (0..n)
                .map(|b| {
                    let mut buf = buffers.take();
                    buf.as_bytes_mut()
                        .copy_from_slice(&pattern(seed + b, bytes));
                    buf
                })
                .collect::<Vec<_>>()
        })
        .join()
        .expect("the importer's thread")
    };
    let mut first_lent = 0;
    for (round, seed) in [(0, 500), (1, 900)] {
        let got = receive(seed);
        let (lent, _) = gpu.pinned_usage();
        assert!(
            lent >= n * bytes,
            "round {round}: import buffers are page-locked ({lent} bytes lent)"
        );
        if round == 0 {
            first_lent = lent;
        } else {
            assert_eq!(lent, first_lent, "round 1 reused round 0's buffers");
        }
        let ids: Vec<u32> = (0..n as u32).rev().collect();
        let src: Vec<&[u8]> = got.iter().map(|b| b.as_bytes()).collect();
        gpu.write_blocks(&mut kv, &ids, &src);
        buffers.give_all(got);
        let mut out = vec![0u8; bytes];
        for (b, &id) in ids.iter().enumerate() {
            gpu.read_block(&kv, id, &mut out);
            assert!(
                out == pattern(seed + b, bytes),
                "round {round}: block {id} holds import buffer {b}"
            );
        }
    }
    assert_eq!(buffers.spare(), n, "all given back and kept");
}

/// cuda:0 with `blocks` blocks of Qwen3-0.6B's KV in bf16, and the bytes of one block.
fn bf16_kv(blocks: usize) -> (CudaBackend, pd_kernels::cuda::CudaKvStorage, usize) {
    let files = files("synthetic:qwen3-0.6b");
    let gpu = CudaBackend::open_with(0, 0.5, Some(DType::BF16)).expect("cuda:0 opens");
    let layout = KvLayout::new(&files.config, BLOCK, DType::BF16).expect("layout");
    let kv = gpu.alloc_kv(&layout, blocks).expect("KV storage");
    (gpu, kv, layout.block_bytes())
}

/// Bit-exact equality of two device tensors (copied to the host).
fn assert_same(what: &str, gpu: &CudaBackend, a: &CudaTensor, b: &CudaTensor) {
    let (a, b) = (gpu.to_host(a), gpu.to_host(b));
    assert_eq!((a.rows, a.cols), (b.rows, b.cols), "{what}: shape");
    assert!(a.data.iter().all(|v| v.is_finite()), "{what}: non-finite");
    assert!(
        a.data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "{what}: the two differ (stacked and one-by-one weights, or fused and separate ops)"
    );
}

/// Layer 0's projections `parts` (name, rows) of `cols` columns, uploaded side by side
/// (`load_stacked`) and one by one.
fn stacked_and_single<const N: usize>(
    gpu: &CudaBackend,
    ckpt: &Checkpoint,
    parts: [(&str, usize); N],
    cols: usize,
) -> ([CudaWeight; N], [CudaWeight; N]) {
    let names = parts.map(|(what, _)| format!("model.layers.0.{what}.weight"));
    let view = |i: usize| ckpt.tensor(&names[i], &[parts[i].1, cols]).expect("tensor");
    let stacked = gpu
        .load_stacked(std::array::from_fn(|i| (names[i].as_str(), view(i))))
        .expect("upload");
    let single = std::array::from_fn(|i| gpu.load_weight(&names[i], view(i)).expect("upload"));
    (stacked, single)
}

/// Layer 0's q/k/v and gate/up projections, each uploaded side by side and one by one
/// ([`stacked_and_single`]).
struct Layer0Projections {
    stacked_qkv: [CudaWeight; 3],
    single_qkv: [CudaWeight; 3],
    stacked_mlp: [CudaWeight; 2],
    single_mlp: [CudaWeight; 2],
}

fn layer0_projections(
    gpu: &CudaBackend,
    ckpt: &Checkpoint,
    c: &pd_engine::config::ModelConfig,
) -> Layer0Projections {
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let (stacked_qkv, single_qkv) = stacked_and_single(
        gpu,
        ckpt,
        [
            ("self_attn.q_proj", q),
            ("self_attn.k_proj", kv),
            ("self_attn.v_proj", kv),
        ],
        c.hidden_size,
    );
    let (stacked_mlp, single_mlp) = stacked_and_single(
        gpu,
        ckpt,
        [
            ("mlp.gate_proj", c.intermediate_size),
            ("mlp.up_proj", c.intermediate_size),
        ],
        c.hidden_size,
    );
    Layer0Projections {
        stacked_qkv,
        single_qkv,
        stacked_mlp,
        single_mlp,
    }
}

/// q/k/v and gate/up uploaded side by side (`load_stacked`: one GEMM, its columns split into
/// views) give bit for bit the products of the same matrices uploaded one by one (one GEMM
/// each), and the ops that read those views (q/k norm + RoPE, SiLU-and-multiply and the down
/// projection, the host copy) read the right columns of the right rows.
#[test]
fn stacked_projections_equal_one_by_one() {
    if !enabled("stacked_projections_equal_one_by_one") {
        return;
    }
    for model in ["synthetic:tiny", "synthetic:qwen3-0.6b"] {
        let files = files(model);
        let c = &files.config;
        let ckpt = Checkpoint::open(&files.dir).expect("checkpoint");
        let gpu = CudaBackend::open(0, 0.5).expect("cuda:0");
        let h = c.hidden_size;
        let Layer0Projections {
            stacked_qkv,
            single_qkv,
            stacked_mlp,
            single_mlp,
        } = layer0_projections(&gpu, &ckpt, c);
        let load = |what: &str, shape: &[usize]| {
            let n = format!("model.layers.0.{what}.weight");
            gpu.load_weight(&n, ckpt.tensor(&n, shape).expect("tensor"))
                .expect("upload")
        };
        let norm = load("input_layernorm", &[h]);
        let (q_norm, k_norm) = (
            load("self_attn.q_norm", &[c.head_dim]),
            load("self_attn.k_norm", &[c.head_dim]),
        );
        let down = load("mlp.down_proj", &[h, c.intermediate_size]);

        let rows = 5;
        let mut state = 11u64;
        let host: Vec<f32> = (0..rows * h).map(|_| unit(&mut state) as f32).collect();
        let x = || {
            CudaTensor::new(
                rows,
                h,
                gpu.device().stream.clone_htod(&host).expect("upload"),
            )
        };
        let eps = c.rms_norm_eps;
        let positions: Vec<u32> = (0..rows as u32).map(|r| 3 * r).collect();

        let a = gpu.norm_linear_shared(&x(), &norm, h, eps, stacked_qkv.each_ref());
        let b = gpu.norm_linear_shared(&x(), &norm, h, eps, single_qkv.each_ref());
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            assert_same(&format!("{model} {what}"), &gpu, &a[i], &b[i]);
        }
        let norm_rope = QkNormRope {
            q_norm: &q_norm,
            k_norm: &k_norm,
            positions: &positions,
            head_dim: c.head_dim,
            eps,
            theta: c.rope_theta,
        };
        let qk = |t: &[CudaTensor; 3]| gpu.qk_norm_rope(&t[0], &t[1], &norm_rope);
        let ((aq, ak), (bq, bk)) = (qk(&a), qk(&b));
        assert_same(&format!("{model} q after norm + RoPE"), &gpu, &aq, &bq);
        assert_same(&format!("{model} k after norm + RoPE"), &gpu, &ak, &bk);

        let [ag, au] = gpu.linear_shared(&x(), stacked_mlp.each_ref());
        let [bg, bu] = gpu.linear_shared(&x(), single_mlp.each_ref());
        assert_same(&format!("{model} gate"), &gpu, &ag, &bg);
        assert_same(&format!("{model} up"), &gpu, &au, &bu);
        let (mut ax, mut bx) = (x(), x());
        gpu.silu_mul_linear_add(&mut ax, &ag, &au, &down);
        gpu.silu_mul_linear_add(&mut bx, &bg, &bu, &down);
        assert_same(
            &format!("{model} residual + down(silu(gate) * up)"),
            &gpu,
            &ax,
            &bx,
        );
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

/// Deterministic values in [0, 1) without an RNG crate (SplitMix64).
fn unit(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

/// Logits rows that exercise the sampler's edge cases: spread, peaked, heavily tied (ties at
/// the k-th place), NaN / -inf holes, ±0 ties, all -inf, and a +inf.
fn sampling_rows(vocab: usize) -> Vec<Vec<f32>> {
    let mut s = 42u64;
    let mut rows = Vec::new();
    for kind in 0..9 {
        let mut row: Vec<f32> = (0..vocab)
            .map(|_| (unit(&mut s) * 16.0 - 8.0) as f32)
            .collect();
        match kind {
            1 => row[vocab / 3] = 30.0,
            2 => row.iter_mut().for_each(|x| *x = (*x * 0.5).round()),
            3 => row.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0),
            4 => {
                for i in (0..vocab).step_by(17) {
                    row[i] = if i % 2 == 0 {
                        f32::NAN
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
            5 => {
                row.iter_mut().for_each(|x| *x = x.min(-1.0));
                row[7] = -0.0;
                row[3] = 0.0;
                row[vocab - 1] = -0.0;
            }
            6 => row.fill(f32::NEG_INFINITY),
            7 => row[11] = f32::INFINITY,
            _ => {}
        }
        rows.push(row);
    }
    rows
}

#[test]
fn sampling_on_the_device_chooses_the_cpu_backends_tokens() {
    use pd_engine::backend::cpu::CpuTensor;
    use pd_engine::sampling::{DeviceSampleRow, DeviceSampling};
    use pd_kernels::cuda::CudaTensor;

    if !enabled("sampling_on_the_device_chooses_the_cpu_backends_tokens") {
        return;
    }
    let vocab = 151_936;
    let rows = sampling_rows(vocab);
    let data: Vec<f32> = rows.concat();
    let cpu_logits = CpuTensor::from_vec(rows.len(), vocab, data.clone());
    let gpu = CudaBackend::open(0, 0.5).expect("cuda:0");
    let gpu_logits = CudaTensor::new(
        rows.len(),
        vocab,
        gpu.device().stream.clone_htod(&data).expect("upload"),
    );
    let mut s = 7u64;
    let mut requests = Vec::new();
    for row in 0..rows.len() {
        requests.push(DeviceSampleRow {
            row,
            method: DeviceSampling::Greedy,
        });
        for k in [1u32, 2, 20, 64] {
            for (t, top_p) in [(0.7f32, 1.0f32), (1.5, 0.9), (0.05, 0.3), (1.0, 1e-6)] {
                requests.push(DeviceSampleRow {
                    row,
                    method: DeviceSampling::TopK {
                        k,
                        inv_temperature: 1.0 / t,
                        top_p,
                        uniform: unit(&mut s),
                    },
                });
            }
        }
    }
    let cpu = CpuBackend::new();
    for limit in [vocab, 151_669] {
        let c = cpu.sample(&cpu_logits, &requests, limit);
        let g = gpu.sample(&gpu_logits, &requests, limit);
        for ((req, c), g) in requests.iter().zip(&c).zip(&g) {
            assert_eq!(
                (c.token_id, c.used_draw),
                (g.token_id, g.used_draw),
                "{req:?} limit {limit}"
            );
            let same = c.logprob == g.logprob
                || (c.logprob.is_nan() && g.logprob.is_nan())
                || (c.logprob - g.logprob).abs() <= 1e-4;
            assert!(same, "{req:?}: logprob {} vs {}", c.logprob, g.logprob);
        }
    }
}

#[test]
fn executor_sampling_on_the_device_equals_host_sampling_of_the_same_logits() {
    use pd_engine::executor::StepOutput;
    use pd_engine::sampling::{Sampler, SamplingParams};

    if !enabled("executor_sampling_on_the_device_equals_host_sampling_of_the_same_logits") {
        return;
    }
    let files = files("synthetic:tiny");
    let params = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            ..Default::default()
        },
    ];
    let steps = 12;
    let run = |on_device: bool| -> Vec<Vec<u32>> {
        let blocks = 2 * 4 + 1;
        let mut gpu = executor(CudaBackend::open(0, 0.5).expect("cuda:0"), &files, blocks);
        let tables: Vec<Vec<u32>> = (0..2u32).map(|s| (s * 4..s * 4 + 4).collect()).collect();
        let mut tokens: Vec<Vec<u32>> = (0..2u32)
            .map(|s| (0..10).map(|i| (i * 97 + s * 13 + 1) % 150_000).collect())
            .collect();
        let mut samplers: Vec<Sampler> = params.iter().map(|p| Sampler::new(p, 5)).collect();
        let mut computed = [0usize; 2];
        for _ in 0..steps {
            let items: Vec<ExecItem<'_>> = (0..2)
                .map(|i| ExecItem {
                    tokens: &tokens[i][computed[i]..],
                    start: computed[i],
                    block_table: &tables[i],
                    all_logits: false,
                })
                .collect();
            let outs: Vec<StepOutput> = if on_device {
                let plans: Vec<_> = samplers.iter().map(|s| s.device_plan()).collect();
                gpu.execute_sampling(&items, &plans, usize::MAX)
            } else {
                gpu.execute(&items)
                    .into_iter()
                    .map(StepOutput::Logits)
                    .collect()
            };
            for (i, out) in outs.into_iter().enumerate() {
                computed[i] = tokens[i].len();
                let t = match out {
                    StepOutput::Sampled(s) => samplers[i].accept(s),
                    StepOutput::Logits(m) => {
                        assert!(!on_device, "both requests qualify for the device");
                        samplers[i].sample(m.row(0), &[], &[])
                    }
                };
                tokens[i].push(t.token_id);
            }
        }
        tokens
    };
    assert_eq!(run(false), run(true));
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
    for step in 0..13 {
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
}

#[test]
fn decode_graphs_match_eager_decode() {
    if enabled("decode_graphs_match_eager_decode") {
        graphs_match_eager("synthetic:tiny", [9, 14, 19], 4);
        graphs_match_eager("synthetic:qwen3-0.6b", [9, 14, 19], 4);
        // Graphs shaped for 2,048 keys (8 key splits) over contexts of ~300, ~40 and ~10:
        // each sequence is split as its own length asks (2 splits, 1, 1), as eagerly.
        graphs_match_eager("synthetic:tiny", [300, 40, 9], 128);
    }
}
