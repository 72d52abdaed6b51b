//! Causal grouped-query attention over a paged KV cache on the CPU, flash-attention style.
//!
//! Work is cut into tasks of (sequence, KV head, tile of query rows). A task takes every
//! query head that shares its KV head for every row of its tile together (`rows × group`
//! query vectors), so each K and V row read from the cache serves all of them instead of one.
//! Keys are walked in tiles of [`KEY_TILE`] with an online softmax (running max and sum per
//! query vector, exponentials in base 2 with the scale folded into Q); no score buffer the
//! size of the context exists. Both products are register-blocked FMA loops, the
//! exponentials a polynomial on whole vectors: in AVX2 + FMA intrinsics ([`avx2`]) or in
//! portable code ([`portable`]), chosen at run time like the matrix kernels ([`Isa`]); the
//! task body around them ([`task_body`]) is compiled once for each.
//!
//! Keys and values of this step must already be written into the cache. What it does not
//! own: the KV layout ([`crate::kv::KvLayout`]) and the cache's memory ([`super::KvArena`]).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod portable;

use std::cell::RefCell;

use rayon::prelude::*;

use super::convert::Isa;
use super::{CpuKvStorage, CpuTensor};
use crate::backend::AttentionMeta;

/// Largest head_dim the CPU kernel accepts (guards the per-task scratch size).
pub const MAX_HEAD_DIM: usize = 512;

/// f32 lanes of one AVX2 register (the portable kernels compute on arrays of as many).
const LANES: usize = 8;
type Lanes = [f32; LANES];
/// Keys per tile of the online softmax: two lane groups of scores per query vector.
const KEY_TILE: usize = 2 * LANES;
/// Query vectors a task aims for: enough that a K/V row read from the cache is reused many
/// times, few enough that the task's Q and output accumulators stay in L1/L2.
const TASK_QUERIES: usize = 32;
/// Rows of the register blocks of both products.
const ROW_BLOCK: usize = 4;

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

/// One task: `rows` query rows of sequence `seq` from its `row0`-th new token, KV head `kv_head`.
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    row0: usize,
    rows: usize,
    /// Keys the last row sees (its position + 1): the task's cost, for ordering.
    keys: usize,
}

/// Everything a task reads, shared by all tasks of one call.
struct Shared<'a> {
    q: &'a CpuTensor,
    kv: &'a CpuKvStorage,
    layer: usize,
    meta: &'a AttentionMeta,
    group: usize,
    /// `scale * log2(e)`: folded into Q so the scores are base-2 exponents.
    q_scale: f32,
}

/// The output pointer shared by tasks that write disjoint (row, head) slices.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write only the (row, head) slices of their own rows and KV head's query
// heads, disjoint across tasks, while the owning tensor is borrowed by the call that spawned
// them (rayon joins before that call returns).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}
impl OutPtr {
    /// A method (not a field access) so closures capture the whole `Send` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Per-thread buffers of a task, reused across tasks and calls.
#[derive(Default)]
struct Scratch {
    /// Scaled query vectors, `[queries, head_dim]`.
    q: Vec<f32>,
    /// Unnormalised output accumulators, `[queries, head_dim]`.
    o: Vec<f32>,
    /// Scores, then probabilities, of the current key tile, `[queries, KEY_TILE]`.
    s: Vec<f32>,
    /// Running max (base-2 exponent) and sum of each query vector.
    max: Vec<f32>,
    sum: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// [`paged_attention`] on an explicit instruction set (which must be available on this CPU).
fn paged_attention_with(
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
    let group = meta.num_heads / meta.num_kv_heads;
    let rows_per_task = (TASK_QUERIES / group).max(1);

    let mut tasks = Vec::new();
    for (s, seq) in meta.seqs.iter().enumerate() {
        assert!(seq.q_len <= seq.context_len && seq.q_start + seq.q_len <= q.rows);
        let first_pos = seq.context_len - seq.q_len;
        for row0 in (0..seq.q_len).step_by(rows_per_task) {
            let rows = rows_per_task.min(seq.q_len - row0);
            for kv_head in 0..meta.num_kv_heads {
                let keys = first_pos + row0 + rows;
                tasks.push(Task {
                    seq: s,
                    kv_head,
                    row0,
                    rows,
                    keys,
                });
            }
        }
    }
    // Longest first, so the last tasks to start are short ones and the threads end together.
    tasks.sort_by_key(|t| std::cmp::Reverse(t.keys));

    let shared = Shared {
        q,
        kv,
        layer,
        meta,
        group,
        q_scale: meta.scale * LOG2_E,
    };
    let mut out = CpuTensor::zeros(q.rows, q.cols);
    let out_ptr = OutPtr(out.data.as_mut_ptr());
    tasks.par_iter().with_min_len(1).for_each(|task| {
        SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: `isa` is available (asserted above); the task writes only its own rows'
            // slices of its KV head's query heads, inside `out` ([q.rows, q.cols]; rows
            // bounded by the sequence's `q_start + q_len <= q.rows`, asserted above).
            unsafe { run_task(isa, &shared, task, scratch, out_ptr.get()) }
        })
    });
    out
}

/// Run one task on the chosen instruction set.
///
/// # Safety
/// `isa` must be available; `out` must point to a `[q.rows, q.cols]` buffer in which no other
/// thread touches this task's slices.
unsafe fn run_task(isa: Isa, sh: &Shared<'_>, task: &Task, scratch: &mut Scratch, out: *mut f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2`/`Avx512` availability implies AVX2 + FMA (every AVX-512F CPU has
        // them; `Isa::available` checks them for `Avx2`); the output contract is forwarded.
        Isa::Avx2 | Isa::Avx512 => unsafe { task_avx2(sh, task, scratch, out) },
        // SAFETY: forwarded output contract.
        _ => unsafe { task_body::<false>(sh, task, scratch, out) },
    }
}

/// The kernel body compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must have AVX2 and FMA; output contract as [`run_task`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2(sh: &Shared<'_>, task: &Task, scratch: &mut Scratch, out: *mut f32) {
    // SAFETY: forwarded contract; the body is inlined here and compiled with these features.
    unsafe { task_body::<true>(sh, task, scratch, out) }
}

/// One task: gather its scaled queries, walk its keys tile by tile, write its outputs. `AVX2`
/// selects the kernels (true only inside [`task_avx2`], which enables the features).
///
/// # Safety
/// Output contract as [`run_task`].
#[inline(always)]
unsafe fn task_body<const AVX2: bool>(
    sh: &Shared<'_>,
    task: &Task,
    scratch: &mut Scratch,
    out: *mut f32,
) {
    let meta = sh.meta;
    let hd = meta.head_dim;
    let group = sh.group;
    let seq = &meta.seqs[task.seq];
    let queries = task.rows * group;
    let first_pos = seq.context_len - seq.q_len + task.row0;
    let layout = &sh.kv.layout;
    let (bs, width) = (layout.block_size, layout.token_width());
    let store = &sh.kv.layers[sh.layer];

    let Scratch { q, o, s, max, sum } = scratch;
    q.resize(queries * hd, 0.0);
    o.clear();
    o.resize(queries * hd, 0.0);
    s.resize(queries * KEY_TILE, 0.0);
    max.clear();
    max.resize(queries, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(queries, 0.0);

    // Query vector m = r * group + j is row `row0 + r`, head `kv_head * group + j`.
    for r in 0..task.rows {
        let row = &sh.q.data[(seq.q_start + task.row0 + r) * sh.q.cols..][..sh.q.cols];
        let heads = &row[task.kv_head * group * hd..][..group * hd];
        for (dst, src) in q[r * group * hd..][..group * hd].iter_mut().zip(heads) {
            *dst = src * sh.q_scale;
        }
    }

    let mut k_rows: [&[f32]; KEY_TILE] = [&[]; KEY_TILE];
    let mut v_rows: [&[f32]; KEY_TILE] = [&[]; KEY_TILE];
    let mut key0 = 0;
    while key0 < task.keys {
        let n = KEY_TILE.min(task.keys - key0);
        for i in 0..n {
            let t = key0 + i;
            let slot = seq.block_table[t / bs] as usize * bs + t % bs;
            let at = slot * width + task.kv_head * hd;
            k_rows[i] = store.k.range(at..at + hd);
            v_rows[i] = store.v.range(at..at + hd);
        }
        scores::<AVX2>(q, hd, queries, &k_rows[..n], s);
        // Row r of the tile sees keys up to its own position.
        for m in 0..queries {
            let pos = first_pos + m / group;
            let visible = (pos + 1).saturating_sub(key0).min(n);
            softmax_step::<AVX2>(
                &mut s[m * KEY_TILE..][..KEY_TILE],
                visible,
                &mut max[m],
                &mut sum[m],
                &mut o[m * hd..][..hd],
            );
        }
        weighted_values::<AVX2>(s, &v_rows[..n], hd, queries, o);
        key0 += n;
    }

    for m in 0..queries {
        let (r, j) = (m / group, m % group);
        let head = task.kv_head * group + j;
        let inv = 1.0 / sum[m];
        let at = (seq.q_start + task.row0 + r) * sh.q.cols + head * hd;
        for (d, &acc) in o[m * hd..][..hd].iter().enumerate() {
            // SAFETY: `at + d` is inside this task's (row, head) slice of `out` (the caller's
            // contract); no other task writes it.
            unsafe { *out.add(at + d) = acc * inv };
        }
    }
}

/// The tile's scores ([`portable::scores`]) on the kernels `AVX2` selects.
#[inline(always)]
fn scores<const AVX2: bool>(q: &[f32], hd: usize, queries: usize, keys: &[&[f32]], s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is true only in code compiled into `task_avx2`, which runs only on a
        // CPU with AVX2 and FMA.
        return unsafe { avx2::scores(q, hd, queries, keys, s) };
    }
    portable::scores(q, hd, queries, keys, s)
}

/// One query vector's softmax update ([`portable::softmax_step`]) on the kernels `AVX2` selects.
#[inline(always)]
fn softmax_step<const AVX2: bool>(
    s: &mut [f32],
    visible: usize,
    max: &mut f32,
    sum: &mut f32,
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `scores`.
        return unsafe { avx2::softmax_step(s, visible, max, sum, o) };
    }
    portable::softmax_step(s, visible, max, sum, o)
}

/// The tile's weighted values ([`portable::weighted_values`]) on the kernels `AVX2` selects.
#[inline(always)]
fn weighted_values<const AVX2: bool>(
    p: &[f32],
    values: &[&[f32]],
    hd: usize,
    queries: usize,
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `scores`.
        return unsafe { avx2::weighted_values(p, values, hd, queries, o) };
    }
    portable::weighted_values(p, values, hd, queries, o)
}

#[cfg(test)]
mod tests;
