//! The model executor: a model, its backend and its paged KV storage. It runs one forward
//! pass over a batch whose blocks are already reserved, and moves whole blocks in and out of
//! KV storage (for the host tier and KV transfer). It owns no allocation policy: the
//! single-request [`crate::generate::Runner`] and the serving engine each bring their own.

use crate::backend::{AttentionMeta, Backend, HostMatrix, SeqAttention};
use crate::error::EngineError;
use crate::kv::KvLayout;
use crate::model::Qwen3;

/// One sequence's part of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct ExecItem<'a> {
    /// This step's new tokens.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache (the new ones follow them).
    pub start: usize,
    /// Physical blocks covering at least `start + tokens.len()` tokens.
    pub block_table: &'a [u32],
    /// Logits for every new token (prompt logprobs), not only the last.
    pub all_logits: bool,
}

pub struct Executor<B: Backend> {
    backend: B,
    model: Qwen3<B>,
    kv: B::KvStorage,
    layout: KvLayout,
    num_blocks: usize,
}

impl<B: Backend> std::fmt::Debug for Executor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("layout", &self.layout)
            .field("num_blocks", &self.num_blocks)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Executor<B> {
    /// Allocate `num_blocks` KV blocks of `block_size` tokens for `model` on `backend`.
    pub fn new(
        backend: B,
        model: Qwen3<B>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let layout = KvLayout::new(model.config(), block_size)?;
        let kv = backend.alloc_kv(&layout, num_blocks)?;
        Ok(Self {
            backend,
            model,
            kv,
            layout,
            num_blocks,
        })
    }

    pub fn model(&self) -> &Qwen3<B> {
        &self.model
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// One forward pass. Returns, per item, the logits of its last new token (or of every
    /// new token with `all_logits`), and writes the new tokens' K/V into their blocks.
    pub fn execute(&mut self, items: &[ExecItem<'_>]) -> Vec<HostMatrix> {
        let bs = self.layout.block_size;
        let c = self.model.config();
        let mut tokens = Vec::new();
        let mut seqs = Vec::with_capacity(items.len());
        let mut logit_rows = Vec::new();
        let mut row_counts = Vec::with_capacity(items.len());
        for item in items {
            let start = tokens.len();
            let count = item.tokens.len();
            assert!(count > 0, "an item without tokens");
            assert!(
                item.block_table.len() * bs >= item.start + count,
                "blocks reserved"
            );
            tokens.extend_from_slice(item.tokens);
            seqs.push(SeqAttention {
                q_start: start,
                q_len: count,
                context_len: item.start + count,
                block_table: item.block_table.to_vec(),
            });
            if item.all_logits {
                logit_rows.extend(start..start + count);
                row_counts.push(count);
            } else {
                logit_rows.push(start + count - 1);
                row_counts.push(1);
            }
        }
        let meta = AttentionMeta {
            seqs,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let logits =
            self.model
                .forward(&self.backend, &mut self.kv, bs, &tokens, &meta, &logit_rows);
        let mut out = Vec::with_capacity(items.len());
        let mut row = 0;
        for n in row_counts {
            out.push(HostMatrix {
                rows: n,
                cols: logits.cols,
                data: logits.data[row * logits.cols..(row + n) * logits.cols].to_vec(),
            });
            row += n;
        }
        out
    }

    /// f32 elements of one block across all layers, K and V ([`Self::read_block`]'s length).
    pub fn block_len(&self) -> usize {
        self.layout.block_bytes() / 4
    }

    /// Copy one block's K and V of every layer out of KV storage into `dst`.
    pub fn read_block(&self, block: u32, dst: &mut [f32]) {
        self.backend.read_block(&self.kv, block, dst);
    }

    /// Overwrite one block's K and V of every layer from `src`.
    pub fn write_block(&mut self, block: u32, src: &[f32]) {
        self.backend.write_block(&mut self.kv, block, src);
    }
}
