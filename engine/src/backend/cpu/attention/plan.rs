//! How one attention call is cut into tasks, and where split tasks leave their partial results.
//!
//! Two shapes of task, chosen per sequence:
//! - **Per KV head** (prompts and prompt chunks): a tile of query rows × one KV head over all
//!   the keys its rows see. The tile's queries (rows × the group's query heads) reuse every
//!   K/V row from L1, and there are many such tasks.
//! - **Split over keys** (decode: a sequence with at most [`DECODE_ROWS`] new rows): all KV
//!   heads × one chunk of the context. One token's K (or V) for all heads is contiguous in the
//!   cache, so a chunk is read as long sequential runs the hardware prefetchers follow; per KV
//!   head the rows would lie a token width apart, a new page each. Chunks give the threads
//!   work even for a single sequence; their partial results are merged afterwards.

/// Sequences with at most this many new rows take split tasks.
pub(super) const DECODE_ROWS: usize = 4;
/// Fewest keys of a split task, so a chunk's merge costs little against its reads.
const MIN_CHUNK: usize = 128;
/// Tasks per thread the splitting aims for, for balance.
const TASKS_PER_THREAD: usize = 4;

/// One task: rows `row0..row0 + rows` of sequence `seq`'s new tokens, KV heads `heads`, keys
/// `keys` (positions; each row also stops at its own).
#[derive(Debug, Clone)]
pub(super) struct Task {
    pub seq: usize,
    pub row0: usize,
    pub rows: usize,
    pub heads: std::ops::Range<usize>,
    pub keys: std::ops::Range<usize>,
    /// Where the task writes its partial results (in f32 from the start of the partial
    /// buffer) when it covers only part of the keys; `None` when it writes final outputs.
    pub partial: Option<usize>,
}

impl Task {
    /// Query vectors × keys: the task's cost, for ordering.
    fn work(&self, group: usize) -> usize {
        self.rows * group * self.heads.len() * self.keys.len()
    }
}

/// A sequence whose tasks were split over keys: its partial results, `parts` blocks of
/// `part_len` f32 from `at`, to merge into its outputs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Split {
    pub seq: usize,
    pub at: usize,
    pub parts: usize,
}

/// The tasks of one call (longest first), the split sequences, and the partial buffer's size.
pub(super) struct Plan {
    pub tasks: Vec<Task>,
    pub splits: Vec<Split>,
    pub partial_len: usize,
}

/// f32 of one split task's partial results: per query vector its running max, its sum and
/// its `head_dim` unnormalised outputs.
pub(super) fn part_len(rows: usize, num_heads: usize, head_dim: usize) -> usize {
    rows * num_heads * (head_dim + 2)
}

/// Cut a call into tasks. `rows_per_task` rows per per-KV-head task; `threads` to size the
/// key chunks of split tasks.
pub(super) fn plan(
    meta: &crate::backend::AttentionMeta,
    rows_per_task: usize,
    threads: usize,
) -> Plan {
    let group = meta.num_heads / meta.num_kv_heads;
    let decode_seqs = meta.seqs.iter().filter(|s| s.q_len <= DECODE_ROWS).count();
    // Chunks per decode sequence: enough tasks for the threads when the batch alone is not.
    let want = (TASKS_PER_THREAD * threads).div_ceil(decode_seqs.max(1));
    let mut tasks = Vec::new();
    let mut splits = Vec::new();
    let mut partial_len = 0;
    for (s, seq) in meta.seqs.iter().enumerate() {
        let first_pos = seq.context_len - seq.q_len;
        if seq.q_len <= DECODE_ROWS {
            let keys = seq.context_len;
            let chunk = keys
                .div_ceil(want)
                .max(MIN_CHUNK)
                .next_multiple_of(super::KEY_TILE);
            let parts = keys.div_ceil(chunk);
            let len = part_len(seq.q_len, meta.num_heads, meta.head_dim);
            if parts > 1 {
                splits.push(Split {
                    seq: s,
                    at: partial_len,
                    parts,
                });
            }
            for p in 0..parts {
                tasks.push(Task {
                    seq: s,
                    row0: 0,
                    rows: seq.q_len,
                    heads: 0..meta.num_kv_heads,
                    keys: p * chunk..((p + 1) * chunk).min(keys),
                    partial: (parts > 1).then_some(partial_len + p * len),
                });
            }
            if parts > 1 {
                partial_len += parts * len;
            }
        } else {
            for row0 in (0..seq.q_len).step_by(rows_per_task) {
                let rows = rows_per_task.min(seq.q_len - row0);
                for h in 0..meta.num_kv_heads {
                    tasks.push(Task {
                        seq: s,
                        row0,
                        rows,
                        heads: h..h + 1,
                        keys: 0..first_pos + row0 + rows,
                        partial: None,
                    });
                }
            }
        }
    }
    // Longest first, so the last tasks to start are short ones and the threads end together.
    tasks.sort_by_key(|t| std::cmp::Reverse(t.work(group)));
    Plan {
        tasks,
        splits,
        partial_len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AttentionMeta, SeqAttention};

    fn meta(seqs: &[(usize, usize)]) -> AttentionMeta {
        let mut q_start = 0;
        AttentionMeta {
            seqs: seqs
                .iter()
                .map(|&(q_len, context_len)| {
                    let s = SeqAttention {
                        q_start,
                        q_len,
                        context_len,
                        block_table: vec![],
                    };
                    q_start += q_len;
                    s
                })
                .collect(),
            num_heads: 16,
            num_kv_heads: 8,
            head_dim: 128,
            scale: 1.0,
        }
    }

    /// Every (row, KV head, key) a sequence's rows need is covered exactly once.
    fn assert_covers(plan: &Plan, meta: &AttentionMeta) {
        for (s, seq) in meta.seqs.iter().enumerate() {
            for row in 0..seq.q_len {
                let pos = seq.context_len - seq.q_len + row;
                for h in 0..meta.num_kv_heads {
                    let mut seen = vec![0; pos + 1];
                    for t in plan.tasks.iter().filter(|t| t.seq == s) {
                        if (t.row0..t.row0 + t.rows).contains(&row) && t.heads.contains(&h) {
                            for k in t.keys.clone().filter(|&k| k <= pos) {
                                seen[k] += 1;
                            }
                        }
                    }
                    assert!(seen.iter().all(|&c| c == 1), "seq {s} row {row} head {h}");
                }
            }
        }
    }

    #[test]
    fn a_single_long_decode_is_split_so_every_thread_has_work() {
        let m = meta(&[(1, 1024)]);
        let p = plan(&m, 16, 2);
        assert_eq!(p.tasks.len(), 8);
        assert!(
            p.tasks
                .iter()
                .all(|t| t.heads == (0..8) && t.partial.is_some())
        );
        assert_eq!(p.splits.len(), 1);
        assert_eq!(p.partial_len, 8 * part_len(1, 16, 128));
        assert_covers(&p, &m);
        // A short context stays whole: one task, written directly.
        let m = meta(&[(1, 100)]);
        let p = plan(&m, 16, 2);
        assert_eq!(p.tasks.len(), 1);
        assert!(p.splits.is_empty() && p.tasks[0].partial.is_none());
        assert_covers(&p, &m);
    }

    #[test]
    fn prompts_take_per_head_tasks_and_mixed_batches_cover_every_key_once() {
        let m = meta(&[(37, 237), (1, 900), (3, 3), (5, 5), (70, 70)]);
        let p = plan(&m, 16, 2);
        assert_covers(&p, &m);
        let prompt_tasks = p.tasks.iter().filter(|t| t.seq == 0).count();
        assert_eq!(prompt_tasks, 37usize.div_ceil(16) * 8);
        assert!(
            p.tasks
                .iter()
                .filter(|t| t.seq == 0)
                .all(|t| t.heads.len() == 1)
        );
        assert!(
            p.tasks
                .iter()
                .filter(|t| t.seq == 2)
                .all(|t| t.heads.len() == 8)
        );
        // Sorted by work, longest first.
        let work: Vec<usize> = p.tasks.iter().map(|t| t.work(2)).collect();
        assert!(work.windows(2).all(|w| w[0] >= w[1]));
        // Batches large enough to keep the threads busy are not split.
        let many: Vec<(usize, usize)> = (0..16).map(|_| (1, 1024)).collect();
        let p = plan(&meta(&many), 16, 2);
        assert_eq!(p.tasks.len(), 16);
        assert!(p.splits.is_empty());
    }
}
