//! The attention kernels against plain attention in f64 over contiguous K/V, on every
//! instruction set this CPU has and every KV cache type (the reference then takes K and V
//! as rounded to that type, so the bounds stay those of f32 arithmetic).

use super::super::CpuBackend;
use super::*;
use crate::backend::{Backend, SeqAttention};
use crate::kv::KvLayout;
use crate::weights::DType;
use half::{bf16, f16};
use proptest::prelude::*;

const KV_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// `x` as a KV cache of `dtype` stores it.
fn rounded(dtype: DType, x: &[f32]) -> Vec<f32> {
    match dtype {
        DType::F32 => x.to_vec(),
        DType::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        DType::BF16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
    }
}

/// A one-layer store of `num_blocks` blocks in `dtype`, every value NaN.
fn nan_store(layout: KvLayout, num_blocks: usize) -> CpuKvStorage {
    let len = num_blocks * layout.block_size * layout.token_width();
    CpuKvStorage {
        layers: CpuKvLayers::filled(layout.dtype, 1, len, f32::NAN).unwrap(),
        layout,
        num_blocks,
    }
}

/// Token `t`'s K and V rows (`width` each, from `[ctx, width]` arrays) into `slot`, as the
/// engine writes them (rounded to the store's type).
fn put(store: &mut CpuKvStorage, slot: usize, t: usize, k: &[f32], v: &[f32]) {
    let width = store.layout.token_width();
    let row = |x: &[f32]| CpuTensor::from_vec(1, width, x[t * width..][..width].to_vec());
    CpuBackend::new().write_kv(store, 0, &row(k), &row(v), &[slot as u32]);
}

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
        hd in prop::sample::select(vec![2usize, 6, 8, 14, 16, 24, 40, 64, 128]),
        block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
        dtype in prop::sample::select(KV_DTYPES.to_vec()),
        seed in any::<u64>(),
    ) {
        let heads = kv_heads * group;
        let q_len = 1 + ((ctx - 1) as f64 * q_frac) as usize;
        let mut state = seed | 1;
        let mut rnd = || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 };
        let q: Vec<f32> = (0..q_len * heads * hd).map(|_| rnd()).collect();
        let k: Vec<f32> = (0..ctx * kv_heads * hd).map(|_| rnd() * 2.0).collect();
        let v: Vec<f32> = (0..ctx * kv_heads * hd).map(|_| rnd()).collect();

        let layout = KvLayout { num_layers: 1, num_kv_heads: kv_heads, head_dim: hd, block_size, dtype };
        let nblocks = ctx.div_ceil(block_size) + 3;
        // Scatter the logical blocks over physical ids in a shuffled order.
        let mut table: Vec<u32> = (0..nblocks as u32).collect();
        table.reverse();
        table.rotate_left((seed % nblocks as u64) as usize);
        let width = kv_heads * hd;
        prop_assert_eq!(width, layout.token_width());
        let mut store = nan_store(layout, nblocks);
        for t in 0..ctx {
            put(&mut store, table[t / block_size] as usize * block_size + t % block_size, t, &k, &v);
        }
        let meta = AttentionMeta {
            seqs: vec![SeqAttention { q_start: 0, q_len, context_len: ctx, block_table: table }],
            num_heads: heads, num_kv_heads: kv_heads, head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let want = contiguous(&q, &rounded(dtype, &k), &rounded(dtype, &v), ctx, q_len, heads, kv_heads, hd);
        for isa in Isa::all_available() {
            let got = paged_attention_with(isa, &CpuTensor::from_vec(q_len, heads * hd, q.clone()), &store, 0, &meta);
            for (g, w) in got.data.iter().zip(&want) {
                prop_assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{isa:?} {dtype:?}: {g} vs {w}");
            }
        }
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = crate::backend::cpu::convert::tests::Rng::new(seed);
    (0..n).map(|_| rng.unit()).collect()
}

/// One sequence of a batch: its whole context's K/V (contiguous, `[ctx, width]`) and the
/// queries of its new tokens.
struct Seq {
    ctx: usize,
    q_len: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
}

/// Sequences of `(context, new rows)` with random K/V in [-1, 1) and queries scaled by
/// `q_gain` (larger scores), each from its own seeds.
fn random_seqs(
    spec: &[(usize, usize)],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    q_gain: f32,
) -> Vec<Seq> {
    let width = kv_heads * hd;
    spec.iter()
        .enumerate()
        .map(|(i, &(ctx, q_len))| Seq {
            ctx,
            q_len,
            k: values(ctx * width, 10 + i as u64),
            v: values(ctx * width, 20 + i as u64),
            q: values(q_len * heads * hd, 30 + i as u64)
                .iter()
                .map(|x| x * q_gain)
                .collect(),
        })
        .collect()
}

/// Write every sequence's K/V into one paged store of `dtype`, each over its own blocks taken
/// from the end of the pool backwards (so block ids and positions never line up), the unused
/// slots NaN so a read past a sequence's context shows up in the output.
fn batch(
    seqs: &[Seq],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    block_size: usize,
    dtype: DType,
) -> (CpuTensor, CpuKvStorage, AttentionMeta) {
    let nblocks: usize = seqs.iter().map(|s| s.ctx.div_ceil(block_size) + 1).sum();
    let layout = KvLayout {
        num_layers: 1,
        num_kv_heads: kv_heads,
        head_dim: hd,
        block_size,
        dtype,
    };
    let mut store = nan_store(layout, nblocks);
    let mut next_block = nblocks as u32;
    let mut q = Vec::new();
    let mut meta_seqs = Vec::new();
    for s in seqs {
        let table: Vec<u32> = (0..s.ctx.div_ceil(block_size) + 1)
            .map(|_| {
                next_block -= 1;
                next_block
            })
            .collect();
        for t in 0..s.ctx {
            let slot = table[t / block_size] as usize * block_size + t % block_size;
            put(&mut store, slot, t, &s.k, &s.v);
        }
        meta_seqs.push(SeqAttention {
            q_start: q.len() / (heads * hd),
            q_len: s.q_len,
            context_len: s.ctx,
            block_table: table,
        });
        q.extend_from_slice(&s.q);
    }
    let rows = q.len() / (heads * hd);
    let meta = AttentionMeta {
        seqs: meta_seqs,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    (CpuTensor::from_vec(rows, heads * hd, q), store, meta)
}

/// Largest `|got - want| / (1 + |want|)` of a batch in a KV cache of `dtype` against the
/// reference (over K/V rounded as stored), per sequence, on every instruction set: `(isa,
/// error)` pairs.
fn batch_errors(
    seqs: &[Seq],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    bs: usize,
    dtype: DType,
) -> Vec<(Isa, f32)> {
    let (q, store, meta) = batch(seqs, heads, kv_heads, hd, bs, dtype);
    let wants: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| {
            let (k, v) = (rounded(dtype, &s.k), rounded(dtype, &s.v));
            contiguous(&s.q, &k, &v, s.ctx, s.q_len, heads, kv_heads, hd)
        })
        .collect();
    Isa::all_available()
        .into_iter()
        .map(|isa| {
            let got = paged_attention_with(isa, &q, &store, 0, &meta);
            let mut worst = 0.0f32;
            for (want, m) in wants.iter().zip(&meta.seqs) {
                let got = &got.data[m.q_start * heads * hd..][..want.len()];
                for (g, w) in got.iter().zip(want) {
                    worst = worst.max((g - w).abs() / (1.0 + w.abs()));
                }
            }
            (isa, worst)
        })
        .collect()
}

/// A batch as the engine builds one under chunked prefill: a decode row over a long context,
/// a prompt chunk over cached context, a whole prompt, and a one-token prompt, with Qwen3's
/// head shapes (0.6B: 16 query heads over 8 KV heads; 8B: 32 over 8; head_dim 128).
#[test]
fn mixed_batches_with_qwen3_head_shapes_match_the_reference() {
    for (heads, kv_heads) in [(16, 8), (32, 8), (8, 8)] {
        let hd = 128;
        let seqs = random_seqs(
            &[(300, 1), (200, 37), (70, 70), (1, 1)],
            heads,
            kv_heads,
            hd,
            1.0,
        );
        for (bs, dtype) in [
            (16, DType::F32),
            (32, DType::F32),
            (16, DType::F16),
            (32, DType::BF16),
        ] {
            for (isa, err) in batch_errors(&seqs, heads, kv_heads, hd, bs, dtype) {
                assert!(
                    err <= 1e-5,
                    "{isa:?} {dtype:?} heads {heads}/{kv_heads} block {bs}: error {err}"
                );
            }
        }
    }
}

/// Scores far apart (|score| in the hundreds) whose maximum moves to a later key tile, as
/// well as one that sits in the first tile: the running max and its corrections must keep
/// the softmax exact instead of overflowing or flushing to zero.
#[test]
fn large_scores_and_a_moving_maximum_stay_exact() {
    let (heads, kv_heads, hd, ctx) = (4, 2, 64, 100);
    let width = kv_heads * hd;
    let q = values(ctx * heads * hd, 1)
        .iter()
        .map(|x| x * 8.0)
        .collect::<Vec<_>>();
    // Keys grow along the context, so every new tile brings a new maximum for most rows...
    let mut k: Vec<f32> = values(ctx * width, 2);
    for (t, row) in k.chunks_mut(width).enumerate() {
        let gain = 1.0 + t as f32 / 10.0;
        row.iter_mut().for_each(|x| *x *= gain);
    }
    // ...except one early key aligned with every query of head 0, far above the rest.
    for d in 0..hd {
        k[3 * width + d] = q[d].signum() * 12.0;
    }
    let seqs = [Seq {
        ctx,
        q_len: ctx,
        k,
        v: values(ctx * width, 3),
        q,
    }];
    for dtype in KV_DTYPES {
        for (isa, err) in batch_errors(&seqs, heads, kv_heads, hd, 16, dtype) {
            assert!(err <= 1e-5, "{isa:?} {dtype:?}: error {err}");
        }
    }
}

/// The polynomial `exp2` of both kernels against the standard library, over the range a
/// softmax uses (exponents ≤ 0), and its floor below -126.
#[test]
fn exp2_is_within_two_ulp_of_the_standard_library() {
    let xs: Vec<f32> = (0..=200_000)
        .map(|i| -126.0 * i as f32 / 200_000.0)
        .collect();
    let check = |name: &str, got: &[f32], xs: &[f32]| {
        for (&g, &x) in got.iter().zip(xs) {
            let want = x.exp2();
            assert!(
                (g - want).abs() <= 2.5e-7 * want,
                "{name}: exp2({x}) = {g}, want {want}"
            );
        }
    };
    let mut got = Vec::new();
    for chunk in xs.chunks_exact(LANES) {
        got.extend(portable::exp2_lanes(chunk.try_into().unwrap()));
    }
    check("portable", &got, &xs);
    assert_eq!(portable::exp2_lanes([-1000.0; LANES])[0], 2f32.powi(-126));
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.available() {
        let mut got = Vec::new();
        for chunk in xs.chunks_exact(LANES) {
            // SAFETY: AVX2, FMA and F16C are available (checked above); 8 readable f32 per chunk.
            let v = unsafe { avx2::exp2(std::arch::x86_64::_mm256_loadu_ps(chunk.as_ptr())) };
            let mut out = [0.0f32; LANES];
            // SAFETY: 8 writable f32.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), v) };
            got.extend(out);
        }
        check("avx2", &got, &xs);
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.available() {
        let mut got = Vec::new();
        for chunk in xs.chunks_exact(16) {
            // SAFETY: AVX-512 is available (checked above); 16 readable f32 per chunk.
            let v = unsafe { avx512::exp2(std::arch::x86_64::_mm512_loadu_ps(chunk.as_ptr())) };
            let mut out = [0.0f32; 16];
            // SAFETY: 16 writable f32.
            unsafe { std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), v) };
            got.extend(out);
        }
        check("avx512", &got, &xs[..got.len()]);
    } else {
        eprintln!("AVX-512 not available: its exp2 is not exercised on this CPU");
    }
}

/// Decode steps over long contexts are split into chunks of the context whose partial
/// results are merged: one of four rows (as in speculative decoding) whose last chunk holds
/// keys only the later rows see, and a single row over a thousand tokens.
#[test]
fn long_decodes_split_over_the_context_match_the_reference() {
    let (heads, kv_heads, hd) = (16, 8, 128);
    let seqs = random_seqs(&[(386, 4), (1000, 1)], heads, kv_heads, hd, 4.0);
    let (_, _, meta) = batch(&seqs, heads, kv_heads, hd, 16, DType::F32);
    let p = plan::plan(&meta, 16, 2);
    assert_eq!(p.splits.len(), 2, "both sequences are split");
    for dtype in KV_DTYPES {
        for (isa, err) in batch_errors(&seqs, heads, kv_heads, hd, 16, dtype) {
            assert!(err <= 1e-5, "{isa:?} {dtype:?}: error {err}");
        }
    }
}
