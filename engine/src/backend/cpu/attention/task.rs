//! One attention task's body (gather its scaled queries, walk its keys tile by tile with an
//! online softmax, write its outputs or partial results), and the merge of split tasks'
//! partial results. The kernels inside are [`super::avx512`]'s, [`super::avx2`]'s or
//! [`super::portable`]'s.

use std::cell::RefCell;

use super::plan::{Split, Task};
use super::{KEY_TILE, PORTABLE, Shared, scores, softmax_step, weighted_values};
use crate::backend::cpu::KvElem;
use crate::backend::cpu::isa::Isa;

/// Per-thread buffers of a task, reused across tasks and calls.
#[derive(Default)]
pub(super) struct Scratch {
    /// Scaled query vectors, `[queries, head_dim]`, KV head by KV head.
    q: Vec<f32>,
    /// Unnormalised output accumulators, `[queries, head_dim]`.
    o: Vec<f32>,
    /// Scores, then weights, of the current key tile for one KV head, `[per_head, KEY_TILE]`.
    s: Vec<f32>,
    /// Running max (base-2 exponent) and sum of each query vector.
    max: Vec<f32>,
    sum: Vec<f32>,
}

thread_local! {
    pub(super) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Raw pointers to the call's output tensor and partial buffer.
#[derive(Clone, Copy)]
pub(super) struct Outputs {
    pub out: *mut f32,
    pub partials: *mut f32,
}
// SAFETY: tasks write only their own (row, head) slices of `out` or their own block of
// `partials`, disjoint across tasks (the plan gives each its rows × heads, or its partial
// offset), while the owning buffers are borrowed by the call that spawned them (rayon joins
// before that call returns).
unsafe impl Send for Outputs {}
// SAFETY: as above.
unsafe impl Sync for Outputs {}

/// Run one task on the chosen instruction set.
///
/// # Safety
/// `isa` must be available; `dst.out` must point to a `[q.rows, q.cols]` buffer and
/// `dst.partials` to the plan's partial buffer, in which no other thread touches this task's
/// slices.
pub(super) unsafe fn run_task<E: KvElem>(
    isa: Isa,
    sh: &Shared<'_, E>,
    task: &Task,
    scratch: &mut Scratch,
    dst: Outputs,
) {
    match isa.simd() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is available (the contract): AVX-512 F + BW + VL with AVX2, FMA and
        // F16C (`Isa::available` checks all of them); the output contract is forwarded.
        Isa::Avx512 => unsafe { task_avx512(sh, task, scratch, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` availability is AVX2 + FMA + F16C; the output contract is forwarded.
        Isa::Avx2 => unsafe { task_avx2(sh, task, scratch, dst) },
        // SAFETY: forwarded output contract.
        _ => unsafe { task_body::<PORTABLE, E>(sh, task, scratch, dst) },
    }
}

/// The task body compiled for AVX-512 (16-lane kernels).
///
/// # Safety
/// The CPU must have AVX-512 F + BW + VL, AVX2, FMA and F16C; output contract as [`run_task`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn task_avx512<E: KvElem>(
    sh: &Shared<'_, E>,
    task: &Task,
    scratch: &mut Scratch,
    dst: Outputs,
) {
    // SAFETY: forwarded contract; the body is inlined here and compiled with these features.
    unsafe { task_body::<{ super::AVX512 }, E>(sh, task, scratch, dst) }
}

/// The task body compiled for AVX2 + FMA + F16C (the matrix kernels' set).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; output contract as [`run_task`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<E: KvElem>(
    sh: &Shared<'_, E>,
    task: &Task,
    scratch: &mut Scratch,
    dst: Outputs,
) {
    // SAFETY: forwarded contract; the body is inlined here and compiled with these features.
    unsafe { task_body::<{ super::AVX2 }, E>(sh, task, scratch, dst) }
}

/// One task. `K` selects the kernels (`AVX512` / `AVX2` only inside [`task_avx512`] /
/// [`task_avx2`], which enable the features). Query vector `(h * rows + r) * group + j` (h counted from the task's first KV
/// head) is row `row0 + r` of query head `h * group + j`.
///
/// # Safety
/// Output contract as [`run_task`].
#[inline(always)]
unsafe fn task_body<const K: u8, E: KvElem>(
    sh: &Shared<'_, E>,
    task: &Task,
    scratch: &mut Scratch,
    dst: Outputs,
) {
    let meta = sh.meta;
    let hd = meta.head_dim;
    let group = sh.group;
    let seq = &meta.seqs[task.seq];
    let per_head = task.rows * group;
    let queries = per_head * task.heads.len();
    let first_pos = seq.context_len - seq.q_len + task.row0;
    let (bs, width) = (sh.layout.block_size, sh.layout.token_width());
    let store = sh.store;

    let Scratch { q, o, s, max, sum } = scratch;
    q.resize(queries * hd, 0.0);
    o.clear();
    o.resize(queries * hd, 0.0);
    s.resize(per_head * KEY_TILE, 0.0);
    max.clear();
    max.resize(queries, f32::NEG_INFINITY);
    sum.clear();
    sum.resize(queries, 0.0);

    for (h, kv_head) in task.heads.clone().enumerate() {
        for r in 0..task.rows {
            let row = &sh.q.data[(seq.q_start + task.row0 + r) * sh.q.cols..][..sh.q.cols];
            let heads = &row[kv_head * group * hd..][..group * hd];
            let dst = &mut q[(h * task.rows + r) * group * hd..][..group * hd];
            for (d, x) in dst.iter_mut().zip(heads) {
                *d = x * sh.q_scale;
            }
        }
    }

    let mut token_at = [0usize; KEY_TILE];
    let mut k_rows: [&[E]; KEY_TILE] = [&[]; KEY_TILE];
    let mut v_rows: [&[E]; KEY_TILE] = [&[]; KEY_TILE];
    let mut key0 = task.keys.start;
    while key0 < task.keys.end {
        let n = KEY_TILE.min(task.keys.end - key0);
        for (i, at) in token_at[..n].iter_mut().enumerate() {
            let t = key0 + i;
            *at = (seq.block_table[t / bs] as usize * bs + t % bs) * width;
        }
        for (h, kv_head) in task.heads.clone().enumerate() {
            for i in 0..n {
                let at = token_at[i] + kv_head * hd;
                k_rows[i] = store.k.range(at..at + hd);
                v_rows[i] = store.v.range(at..at + hd);
            }
            let qh = &q[h * per_head * hd..][..per_head * hd];
            scores::<K, _>(qh, hd, per_head, &k_rows[..n], s);
            for m in 0..per_head {
                // Each row sees the keys up to its own position.
                let pos = first_pos + m / group;
                let visible = (pos + 1).saturating_sub(key0).min(n);
                let v = h * per_head + m;
                softmax_step::<K>(
                    &mut s[m * KEY_TILE..][..KEY_TILE],
                    visible,
                    &mut max[v],
                    &mut sum[v],
                    &mut o[v * hd..][..hd],
                );
            }
            let oh = &mut o[h * per_head * hd..][..per_head * hd];
            weighted_values::<K, _>(s, &v_rows[..n], hd, per_head, oh);
        }
        key0 += n;
    }

    if let Some(at) = task.partial {
        // SAFETY: the plan reserved `part_len(rows, num_heads, hd)` f32 at `at` for this task
        // alone; a split task covers all KV heads, so `queries * (hd + 2)` is exactly that.
        let part =
            unsafe { std::slice::from_raw_parts_mut(dst.partials.add(at), queries * (hd + 2)) };
        for (v, p) in part.chunks_exact_mut(hd + 2).enumerate() {
            p[0] = max[v];
            p[1] = sum[v];
            p[2..].copy_from_slice(&o[v * hd..][..hd]);
        }
        return;
    }
    for (h, kv_head) in task.heads.clone().enumerate() {
        for m in 0..per_head {
            let (r, j) = (m / group, m % group);
            let v = h * per_head + m;
            let inv = 1.0 / sum[v];
            let at = (seq.q_start + task.row0 + r) * sh.q.cols + (kv_head * group + j) * hd;
            for (d, &acc) in o[v * hd..][..hd].iter().enumerate() {
                // SAFETY: `at + d` is inside this task's (row, head) slice of `out` (the
                // caller's contract); no other task writes it.
                unsafe { *dst.out.add(at + d) = acc * inv };
            }
        }
    }
}

/// Combine a split sequence's partial results into its outputs: each part's sum and outputs
/// are scaled by `2^(its max - the overall max)`, then the outputs divided by the total sum.
/// A part none of whose keys a row sees has max -inf and contributes nothing.
pub(super) fn merge<E: KvElem>(
    sh: &Shared<'_, E>,
    split: &Split,
    partials: &[f32],
    out: &mut [f32],
) {
    let meta = sh.meta;
    let (hd, group) = (meta.head_dim, sh.group);
    let seq = &meta.seqs[split.seq];
    let vectors = seq.q_len * meta.num_heads;
    let part = |p: usize, v: usize| &partials[split.at + (p * vectors + v) * (hd + 2)..][..hd + 2];
    for v in 0..vectors {
        // Vector v of a split task: KV head h, row r, group member j.
        let per_head = seq.q_len * group;
        let (h, m) = (v / per_head, v % per_head);
        let (r, j) = (m / group, m % group);
        let top = (0..split.parts)
            .map(|p| part(p, v)[0])
            .fold(f32::NEG_INFINITY, f32::max);
        let at = (seq.q_start + r) * sh.q.cols + (h * group + j) * hd;
        let dst = &mut out[at..at + hd];
        dst.fill(0.0);
        let mut total = 0.0;
        for p in 0..split.parts {
            let x = part(p, v);
            if x[0] == f32::NEG_INFINITY {
                continue;
            }
            let w = (x[0] - top).exp2();
            total += w * x[1];
            for (d, &o) in dst.iter_mut().zip(&x[2..]) {
                *d += w * o;
            }
        }
        let inv = 1.0 / total;
        for d in dst.iter_mut() {
            *d *= inv;
        }
    }
}
