//! Causal grouped-query attention over a paged KV cache on the CPU, flash-attention style.
//!
//! Work is cut into tasks (`plan.rs`): for prompts, (sequence, KV head, tile of query rows);
//! for decode, (sequence, chunk of the context) over all KV heads, merged afterwards. A task
//! takes every query head that shares a KV head for every row of its tile together
//! (`rows × group` query vectors), so each K and V row read from the cache serves all of
//! them instead of one (`task.rs`). Keys are walked in tiles of 16 with an online softmax
//! (running max and sum per query vector, exponentials in base 2 with the scale folded into
//! Q); no score buffer the size of the context exists. Both products are register-blocked FMA
//! loops, the exponentials a polynomial on whole vectors: in AVX-512 intrinsics (`avx512.rs`,
//! a key tile's scores in one register), AVX2 + FMA intrinsics (`avx2.rs`) or portable code
//! (`portable.rs`), chosen at run time like the matrix kernels (`PD_CPU_ISA`); the task body
//! around them is compiled once for each.
//!
//! Keys and values of this step must already be written into the cache. What it does not
//! own: the KV layout ([`crate::kv::KvLayout`]) and the cache's memory ([`super::KvArena`]).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod plan;
mod portable;
mod task;

use rayon::prelude::*;

use super::isa::Isa;
use super::{CpuKvLayers, CpuKvStorage, CpuLayerKv, CpuTensor, KvElem};
use crate::backend::AttentionMeta;
use crate::kv::KvLayout;

/// Largest head_dim the CPU kernel accepts (guards the per-task scratch size).
pub const MAX_HEAD_DIM: usize = 512;

/// f32 lanes of one AVX2 register (the portable kernels compute on arrays of as many).
const LANES: usize = 8;
type Lanes = [f32; LANES];
/// Keys per tile of the online softmax: two lane groups of scores per query vector.
const KEY_TILE: usize = 2 * LANES;
/// Query vectors a prompt's task aims for: enough that a K/V row read from the cache is
/// reused many times, few enough that the task's Q and output accumulators stay in L1.
const TASK_QUERIES: usize = 32;
/// Rows of the register blocks of both products.
const ROW_BLOCK: usize = 4;

/// Which kernels a task body is compiled with (its `K` parameter).
const PORTABLE: u8 = 0;
/// [`avx2`]'s kernels (the body compiled with AVX2 + FMA + F16C).
const AVX2: u8 = 1;
/// [`avx512`]'s kernels (the body compiled with AVX-512).
const AVX512: u8 = 2;

/// `1 / ln 2`: scores are kept in base 2 so the exponential is `exp2`.
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `2^f = e^(f ln 2)` on `f` in [-0.5, 0.5]: the Taylor coefficients `(ln 2)^k / k!`, k = 1..7
/// (truncation error ≤ 1e-8 relative there; both kernels' `exp2` use them).
const EXP2_POLY: [f32; 7] = [
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
    0.000_015_252_73,
];

/// `softmax(q·kᵀ · scale)·v` for every new token of every sequence in `meta`, causal over
/// each sequence's context. `q` is `[rows, num_heads * head_dim]` in batch row order.
pub fn paged_attention(
    q: &CpuTensor,
    kv: &CpuKvStorage,
    layer: usize,
    meta: &AttentionMeta,
) -> CpuTensor {
    paged_attention_with(Isa::detect(), q, kv, layer, meta)
}

/// Everything a task reads, shared by all tasks of one call.
struct Shared<'a, E: KvElem> {
    q: &'a CpuTensor,
    layout: &'a KvLayout,
    /// The layer's K and V.
    store: &'a CpuLayerKv<E>,
    meta: &'a AttentionMeta,
    group: usize,
    /// `scale * log2(e)`: folded into Q so the scores are base-2 exponents.
    q_scale: f32,
}

/// [`paged_attention`] on an explicit instruction set (which must be available on this CPU).
pub(super) fn paged_attention_with(
    isa: Isa,
    q: &CpuTensor,
    kv: &CpuKvStorage,
    layer: usize,
    meta: &AttentionMeta,
) -> CpuTensor {
    let hd = meta.head_dim;
    assert!(hd > 0 && hd <= MAX_HEAD_DIM, "head_dim {hd}");
    assert!(meta.num_kv_heads > 0 && meta.num_heads.is_multiple_of(meta.num_kv_heads));
    assert_eq!(q.cols, meta.num_heads * hd);
    assert_eq!(kv.layout.num_kv_heads, meta.num_kv_heads);
    assert_eq!(kv.layout.head_dim, hd);
    assert!(
        isa.available(),
        "attention: {isa:?} not available on this CPU"
    );
    for seq in &meta.seqs {
        assert!(seq.q_len <= seq.context_len && seq.q_start + seq.q_len <= q.rows);
        assert!(seq.block_table.len() * kv.layout.block_size >= seq.context_len);
    }
    match &kv.layers {
        CpuKvLayers::F32(l) => attend(isa, q, &kv.layout, &l[layer], meta),
        CpuKvLayers::F16(l) => attend(isa, q, &kv.layout, &l[layer], meta),
        CpuKvLayers::Bf16(l) => attend(isa, q, &kv.layout, &l[layer], meta),
    }
}

/// [`paged_attention_with`] over one layer's K and V stored as `E` (arguments checked).
fn attend<E: KvElem>(
    isa: Isa,
    q: &CpuTensor,
    layout: &KvLayout,
    store: &CpuLayerKv<E>,
    meta: &AttentionMeta,
) -> CpuTensor {
    let group = meta.num_heads / meta.num_kv_heads;
    let plan = plan::plan(
        meta,
        (TASK_QUERIES / group).max(1),
        rayon::current_num_threads(),
    );

    let shared = Shared {
        q,
        layout,
        store,
        meta,
        group,
        q_scale: meta.scale * LOG2_E,
    };
    let mut out = CpuTensor::zeros(q.rows, q.cols);
    let mut partials = vec![0.0f32; plan.partial_len];
    let dst = task::Outputs {
        out: out.data.as_mut_ptr(),
        partials: partials.as_mut_ptr(),
    };
    plan.tasks.par_iter().with_min_len(1).for_each(|t| {
        task::SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: `isa` is available (asserted above); the plan gives every task its own
            // rows × query heads of `out` ([q.rows, q.cols]; rows bounded by each sequence's
            // `q_start + q_len <= q.rows`, asserted above) or its own block of `partials`.
            unsafe { task::run_task(isa, &shared, t, scratch, dst) }
        })
    });
    for split in &plan.splits {
        task::merge(&shared, split, &partials, &mut out.data);
    }
    out
}

/// The tile's scores ([`portable::scores`]) on the kernels `K` selects.
#[inline(always)]
fn scores<const K: u8, E: KvElem>(
    q: &[f32],
    hd: usize,
    queries: usize,
    keys: &[&[E]],
    s: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match K {
        // SAFETY: `K` is `AVX512` only in code compiled into `task::task_avx512`, which runs
        // only on a CPU with AVX-512 F + BW + VL, AVX2, FMA and F16C.
        AVX512 => return unsafe { avx512::scores(q, hd, queries, keys, s) },
        // SAFETY: `K` is `AVX2` only in code compiled into `task::task_avx2`, which runs only
        // on a CPU with AVX2, FMA and F16C.
        AVX2 => return unsafe { avx2::scores(q, hd, queries, keys, s) },
        _ => {}
    }
    portable::scores(q, hd, queries, keys, s)
}

/// One query vector's softmax update ([`portable::softmax_step`]) on the kernels `K` selects.
#[inline(always)]
fn softmax_step<const K: u8>(
    s: &mut [f32],
    visible: usize,
    max: &mut f32,
    sum: &mut f32,
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match K {
        // SAFETY: as in `scores`.
        AVX512 => return unsafe { avx512::softmax_step(s, visible, max, sum, o) },
        // SAFETY: as in `scores`.
        AVX2 => return unsafe { avx2::softmax_step(s, visible, max, sum, o) },
        _ => {}
    }
    portable::softmax_step(s, visible, max, sum, o)
}

/// The tile's weighted values ([`portable::weighted_values`]) on the kernels `K` selects.
#[inline(always)]
fn weighted_values<const K: u8, E: KvElem>(
    p: &[f32],
    values: &[&[E]],
    hd: usize,
    queries: usize,
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match K {
        // SAFETY: as in `scores`.
        AVX512 => return unsafe { avx512::weighted_values(p, values, hd, queries, o) },
        // SAFETY: as in `scores`.
        AVX2 => return unsafe { avx2::weighted_values(p, values, hd, queries, o) },
        _ => {}
    }
    portable::weighted_values(p, values, hd, queries, o)
}

#[cfg(test)]
mod tests;
