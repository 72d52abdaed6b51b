//! One layer's prefill attention alone, on each kernel, against the GEMM rate.

use pd_engine::backend::{AttentionMeta, Backend, SeqAttention};
use pd_engine::config::ModelConfig;
use pd_engine::kv::KvLayout;
use pd_engine::weights::DType;
use pd_kernels::CudaBackend;
use pd_kernels::cuda::CudaTensor;
use serde_json::{Value, json};

use super::{BLOCK, timed_ms};

/// One layer's causal prefill attention of `len` tokens at `config`'s head shape, on the f32
/// kernel (f32 output) and on the tensor cores (bf16 output): ms per call (median) and the
/// fraction of the GEMM rate `flops` its FLOPs reach (q·k and p·v over each row's prefix).
pub(crate) fn bench_attention(
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
