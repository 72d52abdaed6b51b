//! Decode steps through a captured graph (CUDA graphs on the CUDA backend): which steps
//! qualify, the batch-size buckets a backend captures one graph per, and the padded batch
//! the model runs over while the backend records it.
//!
//! A graph replays fixed kernel launches on fixed buffers, so it serves one batch shape: a
//! pure decode step (one new token per sequence, logits of that token only) of at most
//! `bucket` sequences, padded up to the bucket. The backend stages each step's metadata
//! (token ids, positions, KV slots, block tables padded to [`DecodeGraphs::max_blocks`]) in
//! fixed buffers before a replay; padding rows are the backend's to neutralise (the CUDA
//! backend gives them no KV slot).

use crate::backend::{AttentionMeta, SeqAttention};

/// Batch sizes a graph is captured for: a step of `n` sequences replays the smallest bucket
/// `>= n` (vLLM's capture sizes start the same way).
pub const BUCKETS: [usize; 11] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128];

/// Decode-graph settings of an executor (`--cuda-graphs on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeGraphs {
    /// Largest bucket used (a bigger decode batch runs eagerly).
    pub max_batch: usize,
    /// Block-table entries per sequence in the staged metadata: enough for the longest
    /// context (`--max-model-len`).
    pub max_blocks: usize,
    /// Keys of the longest context, for the attention launch shape baked into a graph.
    pub max_context: usize,
}

impl DecodeGraphs {
    /// Graphs for up to `max_num_seqs` sequences of up to `max_model_len` tokens in blocks of
    /// `block_size`.
    pub fn new(max_num_seqs: usize, max_model_len: usize, block_size: usize) -> Self {
        let max_batch = BUCKETS
            .iter()
            .copied()
            .filter(|&b| b <= max_num_seqs.max(1))
            .max()
            .unwrap_or(1);
        Self {
            max_batch,
            max_blocks: max_model_len.div_ceil(block_size),
            max_context: max_model_len,
        }
    }

    /// The bucket a decode step of `seqs` sequences replays, if any.
    pub fn bucket(&self, seqs: usize) -> Option<usize> {
        BUCKETS
            .iter()
            .copied()
            .find(|&b| b >= seqs && b <= self.max_batch)
    }
}

/// One pure decode step offered to [`super::Backend::decode_graph`].
#[derive(Debug, Clone, Copy)]
pub struct DecodeGraphStep<'a> {
    pub bucket: usize,
    pub graphs: DecodeGraphs,
    pub block_size: usize,
    /// Columns of the logits (the vocabulary).
    pub logits_cols: usize,
    /// The real sequences' new tokens (one each, `tokens.len() <= bucket`).
    pub tokens: &'a [u32],
    /// The real sequences' attention metadata.
    pub meta: &'a AttentionMeta,
}

impl DecodeGraphStep<'_> {
    /// The batch the model runs over while a graph is captured: the real sequences, then
    /// copies of the last one up to the bucket (valid positions and blocks, so a backend that
    /// ran them would compute the same row again; the captured graph's padding rows read the
    /// backend's staged padding instead). Returns the tokens, the metadata and the logits rows
    /// (every row).
    pub fn padded(&self) -> (Vec<u32>, AttentionMeta, Vec<usize>) {
        let n = self.tokens.len();
        assert!(n > 0 && n <= self.bucket, "decode graph step of {n} rows");
        let mut tokens = self.tokens.to_vec();
        let mut meta = self.meta.clone();
        let last = meta.seqs[n - 1].clone();
        for row in n..self.bucket {
            tokens.push(self.tokens[n - 1]);
            meta.seqs.push(SeqAttention {
                q_start: row,
                ..last.clone()
            });
        }
        (tokens, meta, (0..self.bucket).collect())
    }
}

/// Whether a step's items make a pure decode batch: one new token each, no prompt logprobs.
pub fn is_pure_decode(tokens_per_item: impl IntoIterator<Item = (usize, bool)>) -> bool {
    tokens_per_item
        .into_iter()
        .all(|(tokens, all_logits)| tokens == 1 && !all_logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_batch_up_to_the_largest() {
        let g = DecodeGraphs::new(64, 4096, 16);
        assert_eq!(g.max_batch, 64);
        assert_eq!(g.max_blocks, 256);
        assert_eq!(g.bucket(1), Some(1));
        assert_eq!(g.bucket(3), Some(4));
        assert_eq!(g.bucket(17), Some(24));
        assert_eq!(g.bucket(64), Some(64));
        assert_eq!(g.bucket(65), None);
        // --max-num-seqs below a bucket: the largest bucket that fits.
        let g = DecodeGraphs::new(20, 100, 16);
        assert_eq!((g.max_batch, g.bucket(17), g.max_blocks), (16, None, 7));
        assert_eq!(DecodeGraphs::new(0, 1, 16).max_batch, 1);
    }

    #[test]
    fn padding_repeats_the_last_sequence_in_new_rows() {
        let meta = AttentionMeta {
            seqs: vec![
                SeqAttention {
                    q_start: 0,
                    q_len: 1,
                    context_len: 9,
                    block_table: vec![4, 5, 6],
                },
                SeqAttention {
                    q_start: 1,
                    q_len: 1,
                    context_len: 3,
                    block_table: vec![1],
                },
            ],
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
            scale: 0.5,
        };
        let step = DecodeGraphStep {
            bucket: 4,
            graphs: DecodeGraphs::new(8, 64, 4),
            block_size: 4,
            logits_cols: 10,
            tokens: &[7, 8],
            meta: &meta,
        };
        let (tokens, padded, rows) = step.padded();
        assert_eq!(tokens, vec![7, 8, 8, 8]);
        assert_eq!(rows, vec![0, 1, 2, 3]);
        assert_eq!(padded.seqs.len(), 4);
        assert_eq!(padded.seqs[3].q_start, 3);
        assert_eq!(padded.seqs[3].context_len, 3);
        assert_eq!(padded.positions(), vec![8, 2, 2, 2]);
        assert!(is_pure_decode([(1, false), (1, false)]));
        assert!(!is_pure_decode([(1, false), (2, false)]));
        assert!(!is_pure_decode([(1, true)]));
    }
}
