//! Causal grouped-query attention over a paged KV cache on the CPU.
//!
//! One task per (query row, head): it walks the sequence's block table up to the row's own
//! position with an online (streaming) softmax, so no score buffer the size of the context
//! is needed and every task is independent. Keys and values of this step must already be
//! written into the cache.

use rayon::prelude::*;

use super::{CpuKvStorage, CpuTensor};
use crate::backend::AttentionMeta;

/// Largest head_dim the CPU kernel accepts (accumulator kept on the stack).
pub const MAX_HEAD_DIM: usize = 512;

pub(super) fn paged_attention(
    q: &CpuTensor,
    kv: &CpuKvStorage,
    layer: usize,
    meta: &AttentionMeta,
) -> CpuTensor {
    let hd = meta.head_dim;
    assert!(hd <= MAX_HEAD_DIM);
    assert_eq!(q.cols, meta.num_heads * hd);
    let group = meta.num_heads / meta.num_kv_heads;
    let bs = kv.layout.block_size;
    let width = kv.layout.token_width();
    let store = &kv.layers[layer];

    // Which sequence and absolute position each query row belongs to.
    let mut row_seq = vec![(0usize, 0usize); q.rows];
    for (s, seq) in meta.seqs.iter().enumerate() {
        for r in 0..seq.q_len {
            row_seq[seq.q_start + r] = (s, seq.context_len - seq.q_len + r);
        }
    }

    let mut out = CpuTensor::zeros(q.rows, q.cols);
    out.data
        .par_chunks_mut(hd)
        .enumerate()
        .with_min_len(4)
        .for_each(|(idx, out_head)| {
            let row = idx / meta.num_heads;
            let head = idx % meta.num_heads;
            let kv_head = head / group;
            let (s, pos) = row_seq[row];
            let table = &meta.seqs[s].block_table;
            let qv = &q.data[row * q.cols + head * hd..row * q.cols + (head + 1) * hd];

            let mut acc = [0.0f32; MAX_HEAD_DIM];
            let acc = &mut acc[..hd];
            let mut max = f32::NEG_INFINITY;
            let mut sum = 0.0f32;
            for t in 0..=pos {
                let slot = table[t / bs] as usize * bs + t % bs;
                let at = slot * width + kv_head * hd;
                let k = store.k.range(at..at + hd);
                let score = dot(qv, k) * meta.scale;
                let v = store.v.range(at..at + hd);
                if score > max {
                    let correction = (max - score).exp();
                    sum *= correction;
                    for a in acc.iter_mut() {
                        *a *= correction;
                    }
                    max = score;
                }
                let w = (score - max).exp();
                sum += w;
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += w * x;
                }
            }
            let inv = 1.0 / sum;
            for (o, a) in out_head.iter_mut().zip(acc.iter()) {
                *o = a * inv;
            }
        });
    out
}

/// Dot product with eight independent accumulators so the compiler vectorises it.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] += a[i * 8 + j] * b[i * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::super::KvArena;
    use super::*;
    use crate::backend::SeqAttention;
    use crate::kv::KvLayout;
    use proptest::prelude::*;

    /// Plain attention over contiguous K/V: the reference paged attention must equal.
    #[allow(clippy::too_many_arguments)]
    fn contiguous(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        ctx: usize,
        q_len: usize,
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) -> Vec<f32> {
        let group = heads / kv_heads;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0.0f32; q_len * heads * hd];
        for r in 0..q_len {
            let pos = ctx - q_len + r;
            for h in 0..heads {
                let kh = h / group;
                let qv = &q[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let kk = &k[(t * kv_heads + kh) * hd..(t * kv_heads + kh + 1) * hd];
                        qv.iter()
                            .zip(kk)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let val: f64 = (0..=pos)
                        .map(|t| e[t] / z * v[(t * kv_heads + kh) * hd + d] as f64)
                        .sum();
                    out[(r * heads + h) * hd + d] = val as f32;
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn paged_equals_contiguous(
            ctx in 1usize..70,
            q_frac in 0.0f64..1.0,
            kv_heads in 1usize..3,
            group in 1usize..4,
            hd_half in 1usize..9,
            block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
            seed in any::<u64>(),
        ) {
            let hd = hd_half * 2;
            let heads = kv_heads * group;
            let q_len = 1 + ((ctx - 1) as f64 * q_frac) as usize;
            let mut state = seed | 1;
            let mut rnd = || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 };
            let q: Vec<f32> = (0..q_len * heads * hd).map(|_| rnd()).collect();
            let k: Vec<f32> = (0..ctx * kv_heads * hd).map(|_| rnd() * 2.0).collect();
            let v: Vec<f32> = (0..ctx * kv_heads * hd).map(|_| rnd()).collect();

            let layout = KvLayout { num_layers: 1, num_kv_heads: kv_heads, head_dim: hd, block_size };
            let nblocks = ctx.div_ceil(block_size) + 3;
            // Scatter the logical blocks over physical ids in a shuffled order.
            let mut table: Vec<u32> = (0..nblocks as u32).collect();
            table.reverse();
            table.rotate_left((seed % nblocks as u64) as usize);
            let width = kv_heads * hd;
            let mut store = CpuKvStorage { layout: layout.clone(), num_blocks: nblocks, layers: vec![super::super::CpuLayerKv { k: KvArena::filled(nblocks * block_size * width, f32::NAN).unwrap(), v: KvArena::filled(nblocks * block_size * width, f32::NAN).unwrap() }] };
            for t in 0..ctx {
                let slot = table[t / block_size] as usize * block_size + t % block_size;
                store.layers[0].k.range_mut(slot * width..(slot + 1) * width).copy_from_slice(&k[t * width..(t + 1) * width]);
                store.layers[0].v.range_mut(slot * width..(slot + 1) * width).copy_from_slice(&v[t * width..(t + 1) * width]);
            }
            let meta = AttentionMeta {
                seqs: vec![SeqAttention { q_start: 0, q_len, context_len: ctx, block_table: table }],
                num_heads: heads, num_kv_heads: kv_heads, head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let got = paged_attention(&CpuTensor::from_vec(q_len, heads * hd, q.clone()), &store, 0, &meta);
            let want = contiguous(&q, &k, &v, ctx, q_len, heads, kv_heads, hd);
            for (g, w) in got.data.iter().zip(&want) {
                prop_assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
            }
        }
    }
}
