//! Throughput of the CPU backend's paged attention (`cargo bench -p pd-engine --bench
//! attention`), one layer at a time with Qwen3's head shapes (head_dim 128, 8 KV heads;
//! 16 query heads for 0.6B, 32 for 8B), KV blocks of 16 tokens scattered over the cache.
//!
//! Every timed pass is paired with a baseline run right after it and the median of the
//! per-pair ratios is what to read (the machines are shared and noisy):
//! - prefill (one causal prompt of 512 or 2,048 tokens): GFLOP/s (4 · head_dim FLOP per
//!   query head and visible key) against an f32 FMA-peak loop;
//! - decode (one new token per sequence over a long context): GB/s of K and V read, cycling
//!   through enough layers (≥ 256 MiB) that they come from memory as in a forward pass,
//!   against a plain read of as many bytes.
//!
//! Every case runs with the KV cache in f32, f16 and bf16 (`--kv-cache-dtype`): decode's
//! bytes are the cache's own, so 16-bit reads half.
//!
//! Arguments not starting with `-` filter the cases by substring (e.g. `prefill`, `0.6b`,
//! `f16`).
//! `PD_CPU_ISA=portable` (or `avx2`) measures that kernel instead of the best one the CPU has;
//! `PD_BENCH_LAYERS=1` keeps a decode case's K/V in cache (compute alone, not memory).

use std::hint::black_box;
use std::time::{Duration, Instant};

mod baseline;

use baseline::{READ_STREAMS, Timing, case_filter, fma_peak, paired, read_bandwidth, read_pass};
use half::{bf16, f16};
use pd_engine::backend::cpu::attention::paged_attention;
use pd_engine::backend::cpu::{CpuKvLayers, CpuKvStorage, CpuLayerKv, CpuTensor, KvElem};
use pd_engine::backend::{AttentionMeta, SeqAttention};
use pd_engine::kv::KvLayout;
use pd_engine::weights::DType;

/// Decode layers are cycled through at least this many bytes of K and V.
const COLD_BYTES: usize = 256 << 20;
const BASELINE_BYTES: usize = 512 << 20;
/// Each case runs at least this long (after one warm-up pass).
const MIN_TIME: Duration = Duration::from_millis(700);
const HEAD_DIM: usize = 128;
const KV_HEADS: usize = 8;
const BLOCK: usize = 16;

/// (label, query heads) of the two Qwen3 shapes measured.
const MODELS: [(&str, usize); 2] = [("0.6b", 16), ("8b", 32)];

/// Values in [-1, 1) from a xorshift stream.
fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// KV cache types measured, with their labels.
const DTYPES: [(&str, DType); 3] = [
    ("f32", DType::F32),
    ("f16", DType::F16),
    ("bf16", DType::BF16),
];

/// `layers` layers of `len` random K and V values each, stored as `E`.
fn random_layers<E: KvElem>(layers: usize, len: usize) -> Vec<CpuLayerKv<E>> {
    (0..layers)
        .map(|l| {
            let mut x = CpuLayerKv::<E>::filled(len, 0.0).unwrap();
            E::store_f32(&fill(len, 3 + l as u64), x.k.range_mut(0..len));
            E::store_f32(&fill(len, 5 + l as u64), x.v.range_mut(0..len));
            x
        })
        .collect()
}

/// `layers` layers of KV in `dtype` for `seqs` sequences of `ctx` tokens each, every
/// sequence's blocks taken backwards from the end of the pool so block ids and positions
/// never line up.
fn cache(layers: usize, seqs: usize, ctx: usize, dtype: DType) -> (CpuKvStorage, Vec<Vec<u32>>) {
    let blocks_per_seq = ctx.div_ceil(BLOCK);
    let num_blocks = seqs * blocks_per_seq;
    let layout = KvLayout {
        num_layers: layers,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: BLOCK,
        dtype,
    };
    let len = num_blocks * BLOCK * layout.token_width();
    let layers = match dtype {
        DType::F32 => CpuKvLayers::F32(random_layers(layers, len)),
        DType::F16 => CpuKvLayers::F16(random_layers::<f16>(layers, len)),
        DType::BF16 => CpuKvLayers::Bf16(random_layers::<bf16>(layers, len)),
    };
    let tables = (0..seqs)
        .map(|s| {
            (0..blocks_per_seq)
                .map(|b| (num_blocks - 1 - (b * seqs + s)) as u32)
                .collect()
        })
        .collect();
    (
        CpuKvStorage {
            layout,
            num_blocks,
            layers,
        },
        tables,
    )
}

/// One layer call per pass, cycling through the cache's layers; `work` per call.
fn time_case(
    kv: &CpuKvStorage,
    q: &CpuTensor,
    meta: &AttentionMeta,
    work: f64,
    baseline: impl FnMut() -> f64,
) -> Timing {
    let layers = kv.layers.len();
    let pass = || {
        let t = Instant::now();
        for l in 0..layers {
            black_box(paged_attention(q, kv, l, meta));
        }
        t.elapsed().as_secs_f64() / layers as f64
    };
    paired(MIN_TIME, work, pass, baseline)
}

fn main() {
    let wanted = case_filter();
    let threads = rayon::current_num_threads();
    println!(
        "attention bench: {threads} rayon threads, head_dim {HEAD_DIM}, {KV_HEADS} KV heads, blocks of {BLOCK}"
    );

    let peak = fma_peak(20_000_000, 3);
    println!(
        "\nprefill: GFLOP/s (median / best); f32 FMA peak measured right after each pass; median ratio (start: {peak:.0} GFLOP/s)"
    );
    for (model, heads) in MODELS {
        for len in [512, 2048] {
            for (dname, dtype) in DTYPES {
                let label = format!("prefill {model:<4} {len:>5} tokens {dname:<4}");
                if !wanted(&label) {
                    continue;
                }
                let (kv, tables) = cache(1, 1, len, dtype);
                let meta = AttentionMeta {
                    seqs: vec![SeqAttention {
                        q_start: 0,
                        q_len: len,
                        context_len: len,
                        block_table: tables[0].clone(),
                    }],
                    num_heads: heads,
                    num_kv_heads: KV_HEADS,
                    head_dim: HEAD_DIM,
                    scale: 1.0 / (HEAD_DIM as f32).sqrt(),
                };
                let q = CpuTensor::from_vec(len, heads * HEAD_DIM, fill(len * heads * HEAD_DIM, 7));
                let flop = 4.0 * (HEAD_DIM * heads) as f64 * (len * (len + 1) / 2) as f64;
                let t = time_case(&kv, &q, &meta, flop, || fma_peak(3_000_000, 1));
                let (med, best, base, ratio) = (t.median_s, t.best_s, t.baseline, t.ratio);
                println!(
                    "{label} {:6.1} / {:6.1} GFLOP/s  peak {base:5.0}  {:5.1} %  ({:.2} ms/layer)",
                    flop / med / 1e9,
                    flop / best / 1e9,
                    100.0 * ratio,
                    med * 1e3
                );
            }
        }
    }

    let buf: Vec<u64> = (0..BASELINE_BYTES / 8).map(|i| i as u64).collect();
    let bw = read_bandwidth(&buf, READ_STREAMS);
    println!(
        "\ndecode: KV GB/s (median / best); plain read of as many bytes right after each pass; median ratio (start: {bw:.1} GB/s)"
    );
    for (model, heads) in MODELS {
        for (batch, ctx) in [(1, 1024), (1, 4096), (16, 1024)] {
            for (dname, dtype) in DTYPES {
                let label =
                    format!("decode  {model:<4} batch {batch:>2} context {ctx:>5} {dname:<4}");
                if !wanted(&label) {
                    continue;
                }
                let bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * dtype.size_in_bytes();
                let layers = std::env::var("PD_BENCH_LAYERS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(COLD_BYTES.div_ceil(bytes).max(2));
                let (kv, tables) = cache(layers, batch, ctx, dtype);
                let meta = AttentionMeta {
                    seqs: (0..batch)
                        .map(|s| SeqAttention {
                            q_start: s,
                            q_len: 1,
                            context_len: ctx,
                            block_table: tables[s].clone(),
                        })
                        .collect(),
                    num_heads: heads,
                    num_kv_heads: KV_HEADS,
                    head_dim: HEAD_DIM,
                    scale: 1.0 / (HEAD_DIM as f32).sqrt(),
                };
                let q =
                    CpuTensor::from_vec(batch, heads * HEAD_DIM, fill(batch * heads * HEAD_DIM, 9));
                let read = &buf[..(bytes * layers / 8).min(buf.len())];
                let baseline = || (read.len() * 8) as f64 / read_pass(read, READ_STREAMS) / 1e9;
                let t = time_case(&kv, &q, &meta, bytes as f64, baseline);
                let (med, best, base, ratio) = (t.median_s, t.best_s, t.baseline, t.ratio);
                println!(
                    "{label} {:6.1} / {:6.1} GB/s  read {base:5.1}  {:5.1} %  ({:.3} ms/layer)",
                    bytes as f64 / med / 1e9,
                    bytes as f64 / best / 1e9,
                    100.0 * ratio,
                    med * 1e3
                );
            }
        }
    }
    println!(
        "\nat the end: read bandwidth {:.1} GB/s (start {bw:.1}), FMA peak {:.0} GFLOP/s (start {peak:.0})",
        read_bandwidth(&buf, READ_STREAMS),
        fma_peak(20_000_000, 3)
    );
}
