//! The model executor: a model, its backend and its paged KV storage. It runs one forward
//! pass over a batch whose blocks are already reserved, and moves whole blocks in and out of
//! KV storage (for the host tier and KV transfer). It owns no allocation policy: the
//! single-request [`crate::generate::Runner`] and the serving engine each bring their own.

use crate::backend::graph::{DecodeGraphStep, DecodeGraphs, is_pure_decode};
use crate::backend::{AttentionMeta, Backend, HostMatrix, SeqAttention};
use crate::error::EngineError;
use crate::kv::KvLayout;
use crate::kv::host_buffer::{HostAllocator, HostBuffer};
use crate::model::Qwen3;
use crate::sampling::{DeviceSample, DeviceSampleRow, SamplePlan};

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
    /// Pure decode steps go through the backend's captured graphs (`--cuda-graphs on`).
    graphs: Option<DecodeGraphs>,
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
        let layout = KvLayout::new(model.config(), block_size, backend.kv_dtype())?;
        let kv = backend.alloc_kv(&layout, num_blocks)?;
        Ok(Self {
            backend,
            model,
            kv,
            layout,
            num_blocks,
            graphs: None,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
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

    /// Offer pure decode steps (one new token per sequence, no prompt logprobs) of up to
    /// `graphs.max_batch` sequences to the backend's captured graphs; `None`: every step runs
    /// eagerly. A backend without graphs (the CPU) runs them eagerly either way.
    pub fn set_decode_graphs(&mut self, graphs: Option<DecodeGraphs>) {
        self.graphs = graphs;
    }

    /// One forward pass. Returns, per item, the logits of its last new token (or of every
    /// new token with `all_logits`), and writes the new tokens' K/V into their blocks.
    pub fn execute(&mut self, items: &[ExecItem<'_>]) -> Vec<HostMatrix> {
        let (logits, spans) = self.forward(items);
        split_rows(&self.backend.to_host(&logits), &spans)
    }

    /// [`Executor::execute`], choosing the next token on the backend for every item with a
    /// plan (`plans[i]`, from [`crate::sampling::Sampler::device_plan`]) instead of copying
    /// its logits to the host. Items without a plan, items with `all_logits` (their prompt
    /// logprobs need the rows) and rows the backend hands back
    /// ([`DeviceSample::needs_host`]) get their logits as before. Only the first
    /// `vocab_limit` columns are candidate tokens.
    ///
    /// # Panics
    /// If `plans` and `items` differ in length.
    pub fn execute_sampling(
        &mut self,
        items: &[ExecItem<'_>],
        plans: &[Option<SamplePlan>],
        vocab_limit: usize,
    ) -> Vec<StepOutput> {
        assert_eq!(plans.len(), items.len(), "one plan (or None) per item");
        let (logits, spans) = self.forward(items);
        let mut device_rows = Vec::new();
        let mut device_items = Vec::new();
        for (i, ((item, plan), &(first, _))) in items.iter().zip(plans).zip(&spans).enumerate() {
            if let Some(plan) = plan
                && !item.all_logits
            {
                device_rows.push(DeviceSampleRow::planned(first, plan));
                device_items.push(i);
            }
        }
        let mut outputs: Vec<Option<StepOutput>> = (0..items.len()).map(|_| None).collect();
        if !device_rows.is_empty() {
            let sampled = self.backend.sample(&logits, &device_rows, vocab_limit);
            for (&i, sample) in device_items.iter().zip(sampled) {
                // A row the backend handed back joins the host rows below.
                if !sample.needs_host {
                    outputs[i] = Some(StepOutput::Sampled(sample));
                }
            }
        }
        let mut host_rows = Vec::new();
        let mut host_spans = Vec::new();
        let mut host_items = Vec::new();
        for (i, &(first, n)) in spans.iter().enumerate() {
            if outputs[i].is_none() {
                host_spans.push((host_rows.len(), n));
                host_rows.extend(first..first + n);
                host_items.push(i);
            }
        }
        if !host_rows.is_empty() {
            let all_rows = spans.iter().map(|&(_, n)| n).sum::<usize>();
            let host = if host_rows.len() == all_rows {
                split_rows(&self.backend.to_host(&logits), &host_spans)
            } else {
                let rows = self.backend.select_rows(&logits, &host_rows);
                split_rows(&self.backend.to_host(&rows), &host_spans)
            };
            for (&i, m) in host_items.iter().zip(host) {
                outputs[i] = Some(StepOutput::Logits(m));
            }
        }
        outputs
            .into_iter()
            .map(|o| o.expect("every item sampled or given its logits"))
            .collect()
    }

    /// The forward pass shared by both `execute` variants: logits left on the backend, and
    /// each item's `(first row, rows)` in them.
    fn forward(&mut self, items: &[ExecItem<'_>]) -> (B::Tensor, Vec<(usize, usize)>) {
        let bs = self.layout.block_size;
        let c = self.model.config();
        let mut tokens = Vec::new();
        let mut seqs = Vec::with_capacity(items.len());
        let mut logit_rows = Vec::new();
        let mut spans = Vec::with_capacity(items.len());
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
            let n = if item.all_logits { count } else { 1 };
            spans.push((logit_rows.len(), n));
            logit_rows.extend(start + count - n..start + count);
        }
        let meta = AttentionMeta {
            seqs,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        if let Some(logits) = self.decode_graph(items, &tokens, &meta) {
            return (logits, spans);
        }
        let logits =
            self.model
                .forward_logits(&self.backend, &mut self.kv, bs, &tokens, &meta, &logit_rows);
        (logits, spans)
    }

    /// A pure decode step through the backend's graph for its bucket, if graphs are on and
    /// the backend has (or can capture) one; the logits rows start with the items' rows.
    fn decode_graph(
        &mut self,
        items: &[ExecItem<'_>],
        tokens: &[u32],
        meta: &AttentionMeta,
    ) -> Option<B::Tensor> {
        let graphs = self.graphs?;
        if !is_pure_decode(items.iter().map(|i| (i.tokens.len(), i.all_logits))) {
            return None;
        }
        let step = DecodeGraphStep {
            bucket: graphs.bucket(items.len())?,
            graphs,
            block_size: self.layout.block_size,
            logits_cols: self.model.config().vocab_size,
            tokens,
            meta,
        };
        let (padded_tokens, padded_meta, rows) = step.padded();
        let (model, backend, kv) = (&self.model, &self.backend, &mut self.kv);
        let bs = step.block_size;
        backend.decode_graph(&step, &mut || {
            model.forward_logits(backend, kv, bs, &padded_tokens, &padded_meta, &rows)
        })
    }

    /// Bytes of one block across all layers, K and V ([`Self::read_block`]'s length).
    pub fn block_bytes(&self) -> usize {
        self.layout.block_bytes()
    }

    /// Copy one block's K and V of every layer out of KV storage into `dst`, as stored.
    pub fn read_block(&self, block: u32, dst: &mut [u8]) {
        self.backend.read_block(&self.kv, block, dst);
    }

    /// Overwrite one block's K and V of every layer from `src`, as stored.
    pub fn write_block(&mut self, block: u32, src: &[u8]) {
        self.backend.write_block(&mut self.kv, block, src);
    }

    /// A host buffer for [`Executor::read_blocks`] ([`Backend::host_buffer`]).
    pub fn host_buffer(&self, len: usize) -> HostBuffer {
        self.backend.host_buffer(len)
    }

    /// [`Backend::host_allocator`]: host buffers for blocks, lent from any thread.
    pub fn host_allocator(&self) -> HostAllocator {
        self.backend.host_allocator()
    }

    /// [`Backend::read_blocks`]: `blocks` into `dst`, [`Self::block_bytes`] each.
    pub fn read_blocks(&self, blocks: &[u32], dst: &mut [u8]) {
        self.backend.read_blocks(&self.kv, blocks, dst);
    }

    /// [`Backend::write_blocks`]: `src[i]` into `blocks[i]`.
    pub fn write_blocks(&mut self, blocks: &[u32], src: &[&[u8]]) {
        self.backend.write_blocks(&mut self.kv, blocks, src);
    }

    /// Where KV storage lies in host memory (`None` on a GPU): imports land there in place.
    pub fn host_kv_memory(&self) -> Option<crate::kv::placement::HostKvMemory> {
        self.backend.host_kv_memory(&self.kv)
    }

    /// [`Backend::block_writer`]: imported blocks written into KV storage from other
    /// threads (a GPU's copy stream).
    pub fn block_writer(&self) -> Option<crate::kv::reservation::BlockWriter> {
        self.backend.block_writer(&self.kv)
    }
}

/// What [`Executor::execute_sampling`] returns for one item.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    /// The item's logits rows, on the host, for the host sampler (or prompt logprobs).
    Logits(HostMatrix),
    /// The token the backend chose; hand it to [`crate::sampling::Sampler::accept`].
    Sampled(DeviceSample),
}

/// Cut a host matrix into consecutive `(first row, rows)` spans.
fn split_rows(m: &HostMatrix, spans: &[(usize, usize)]) -> Vec<HostMatrix> {
    spans
        .iter()
        .map(|&(first, n)| HostMatrix {
            rows: n,
            cols: m.cols,
            data: m.data[first * m.cols..(first + n) * m.cols].to_vec(),
        })
        .collect()
}
