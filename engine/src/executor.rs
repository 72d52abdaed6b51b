//! The model executor: a model, its backend and its paged KV storage. It runs one forward
//! pass over a batch whose blocks are already reserved, and moves whole blocks in and out of
//! KV storage (for the host tier and KV transfer). It owns no allocation policy: the
//! single-request [`crate::generate::Runner`] and the serving engine each bring their own.

use crate::backend::graph::{DecodeGraphStep, DecodeGraphs, is_pure_decode};
use crate::backend::{AttentionMeta, Backend, HostMatrix, SeqAttention};
use crate::error::EngineError;
use crate::kv::KvLayout;
use crate::kv::handoff::host_buffer::{HostAllocator, HostBuffer};
use crate::model::Qwen3;
use crate::sampling::{DeviceSample, DeviceSampleRow, PromptLogprob, PromptLogprobRow, SamplePlan};

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
    /// eagerly. A backend without graphs (the CPU) runs them eagerly either way, and one that
    /// cannot record a step (a Qwen3-MoE layer it routes on the host) says so and runs it
    /// eagerly ([`Backend::decode_graph`] returns `None`).
    pub fn set_decode_graphs(&mut self, graphs: Option<DecodeGraphs>) {
        self.graphs = graphs;
    }

    /// One forward pass. Returns, per item, the logits of its last new token (or of every
    /// new token with `all_logits`), and writes the new tokens' K/V into their blocks.
    pub fn execute(&mut self, items: &[ExecItem<'_>]) -> Vec<HostMatrix> {
        let first_rows: Vec<usize> = items
            .iter()
            .map(|i| if i.all_logits { 0 } else { i.tokens.len() - 1 })
            .collect();
        let (logits, spans) = self.forward(items, &first_rows);
        let logits = logits.expect("every item has a row");
        split_rows(&self.backend.to_host(&logits), &spans)
    }

    /// One forward pass of a serving step: per item, what `wants[i]` asks for. The next
    /// token is chosen on the backend for items with a plan (from
    /// [`crate::sampling::Sampler::device_plan`]), so only its id travels; items sampled on
    /// the host, and rows the backend hands back ([`DeviceSample::needs_host`]), get their
    /// last row of logits. Prompt positions are scored on the backend
    /// ([`Backend::prompt_logprobs`]). Only the first `vocab_limit` columns are candidate
    /// tokens, and scores are taken over them.
    ///
    /// # Panics
    /// If `wants` and `items` differ in length, an item sets `all_logits` (scoring comes
    /// through `wants`), or a scored range runs past the item's new tokens.
    pub fn execute_sampling(
        &mut self,
        items: &[ExecItem<'_>],
        wants: &[ItemWants<'_>],
        vocab_limit: usize,
    ) -> Vec<ItemOutput> {
        assert_eq!(wants.len(), items.len(), "one ItemWants per item");
        // Each item's logits rows run from its first scored position (or its last token) to
        // its last token; an item that wants neither has none.
        let first_rows: Vec<usize> = items
            .iter()
            .zip(wants)
            .map(|(item, w)| {
                assert!(
                    !item.all_logits,
                    "execute_sampling scores prompts through wants"
                );
                let last = item.tokens.len() - 1;
                match &w.prompt {
                    Some(p) if !p.next_tokens.is_empty() => {
                        assert!(
                            p.first + p.next_tokens.len() <= item.tokens.len(),
                            "scored positions among the item's new tokens"
                        );
                        p.first.min(last)
                    }
                    _ if matches!(w.next, NextToken::None) => item.tokens.len(),
                    _ => last,
                }
            })
            .collect();
        let (logits, spans) = self.forward(items, &first_rows);
        let mut outputs: Vec<ItemOutput> = wants
            .iter()
            .map(|_| ItemOutput {
                prompt_logprobs: Vec::new(),
                next: None,
            })
            .collect();
        let Some(logits) = logits else {
            return outputs;
        };
        let last_row = |i: usize| spans[i].0 + spans[i].1 - 1;

        let mut scored = Vec::new();
        let mut scored_items = Vec::new();
        for (i, w) in wants.iter().enumerate() {
            if let Some(p) = &w.prompt {
                let base = spans[i].0 + p.first - first_rows[i];
                for (j, &next_token) in p.next_tokens.iter().enumerate() {
                    scored.push(PromptLogprobRow {
                        row: base + j,
                        next_token,
                        top: p.top,
                    });
                    scored_items.push(i);
                }
            }
        }
        if !scored.is_empty() {
            let scores = self.backend.prompt_logprobs(&logits, &scored, vocab_limit);
            for (&i, score) in scored_items.iter().zip(scores) {
                outputs[i].prompt_logprobs.push(score);
            }
        }

        let mut device_rows = Vec::new();
        let mut device_items = Vec::new();
        for (i, w) in wants.iter().enumerate() {
            if let NextToken::Backend(plan) = &w.next {
                device_rows.push(DeviceSampleRow::planned(last_row(i), plan));
                device_items.push(i);
            }
        }
        if !device_rows.is_empty() {
            let sampled = self.backend.sample(&logits, &device_rows, vocab_limit);
            for (&i, sample) in device_items.iter().zip(sampled) {
                // A row the backend handed back joins the host rows below.
                if !sample.needs_host {
                    outputs[i].next = Some(StepOutput::Sampled(sample));
                }
            }
        }
        let host_items: Vec<usize> = (0..items.len())
            .filter(|&i| !matches!(wants[i].next, NextToken::None) && outputs[i].next.is_none())
            .collect();
        if !host_items.is_empty() {
            let rows: Vec<usize> = host_items.iter().map(|&i| last_row(i)).collect();
            let one_each: Vec<(usize, usize)> = (0..rows.len()).map(|r| (r, 1)).collect();
            let all_rows = spans.iter().map(|&(_, n)| n).sum::<usize>();
            let host = if rows.len() == all_rows {
                split_rows(&self.backend.to_host(&logits), &one_each)
            } else {
                let selected = self.backend.select_rows(&logits, &rows);
                split_rows(&self.backend.to_host(&selected), &one_each)
            };
            for (&i, m) in host_items.iter().zip(host) {
                outputs[i].next = Some(StepOutput::Logits(m));
            }
        }
        outputs
    }

    /// The forward pass shared by both `execute` variants: logits left on the backend for
    /// each item's new tokens from `first_rows[i]` on (none when it is the item's length),
    /// and each item's `(first row, rows)` in them. No logits at all when no item wants a
    /// row: the step then only writes its K/V ([`Qwen3::forward_kv_only`]).
    fn forward(
        &mut self,
        items: &[ExecItem<'_>],
        first_rows: &[usize],
    ) -> (Option<B::Tensor>, Vec<(usize, usize)>) {
        let bs = self.layout.block_size;
        let c = self.model.config();
        let mut tokens = Vec::new();
        let mut seqs = Vec::with_capacity(items.len());
        let mut logit_rows = Vec::new();
        let mut spans = Vec::with_capacity(items.len());
        for (item, &first) in items.iter().zip(first_rows) {
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
            spans.push((logit_rows.len(), count - first));
            logit_rows.extend(start + first..start + count);
        }
        let meta = AttentionMeta {
            seqs,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        if logit_rows.is_empty() {
            self.model
                .forward_kv_only(&self.backend, &mut self.kv, bs, &tokens, &meta);
            return (None, spans);
        }
        if let Some(logits) = self.decode_graph(items, first_rows, &tokens, &meta) {
            return (Some(logits), spans);
        }
        let logits =
            self.model
                .forward_logits(&self.backend, &mut self.kv, bs, &tokens, &meta, &logit_rows);
        (Some(logits), spans)
    }

    /// A pure decode step through the backend's graph for its bucket, if graphs are on and
    /// the backend has (or can capture) one; the logits rows start with the items' rows.
    fn decode_graph(
        &mut self,
        items: &[ExecItem<'_>],
        first_rows: &[usize],
        tokens: &[u32],
        meta: &AttentionMeta,
    ) -> Option<B::Tensor> {
        let graphs = self.graphs?;
        // The graph's logits rows are one per item: each must want exactly its last row.
        let not_just_last =
            |(i, &f): (&ExecItem<'_>, &usize)| (i.tokens.len(), f + 1 != i.tokens.len());
        if !is_pure_decode(items.iter().zip(first_rows).map(not_just_last)) {
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
    pub fn host_kv_memory(&self) -> Option<crate::kv::handoff::placement::HostKvMemory> {
        self.backend.host_kv_memory(&self.kv)
    }

    /// [`Backend::block_writer`]: imported blocks written into KV storage from other
    /// threads (a GPU's copy stream).
    pub fn block_writer(&self) -> Option<crate::kv::handoff::reservation::BlockWriter> {
        self.backend.block_writer(&self.kv)
    }
}

/// What a serving step wants from one item's logits ([`Executor::execute_sampling`]).
#[derive(Debug, Clone, Default)]
pub struct ItemWants<'a> {
    /// Prompt positions to score, if the request asked for `prompt_logprobs`.
    pub prompt: Option<PromptScoring<'a>>,
    /// What the item's last row is for.
    pub next: NextToken,
}

/// Prompt positions of one item to score ([`Backend::prompt_logprobs`]).
#[derive(Debug, Clone, Copy)]
pub struct PromptScoring<'a> {
    /// Index, among the item's new tokens, of the first position scored.
    pub first: usize,
    /// The prompt token after each scored position (positions `first..first + len`).
    pub next_tokens: &'a [u32],
    /// Alternatives listed per position (`prompt_logprobs = K`).
    pub top: u32,
}

/// What an item's last row of logits is for.
#[derive(Debug, Clone, Default)]
pub enum NextToken {
    /// Nothing: the item's prompt continues next step.
    #[default]
    None,
    /// The host sampler: its logits come back.
    Host,
    /// The backend chooses the token with this plan (or hands the row back).
    Backend(SamplePlan),
}

impl NextToken {
    /// Sample the next token: on the backend with `plan` (from
    /// [`crate::sampling::Sampler::device_plan`]), on the host without one.
    pub fn sample(plan: Option<SamplePlan>) -> Self {
        plan.map_or(Self::Host, Self::Backend)
    }
}

/// What [`Executor::execute_sampling`] returns for one item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutput {
    /// One score per position of [`ItemWants::prompt`], in order.
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// The next token, or the row to choose it from; `None` for [`NextToken::None`].
    pub next: Option<StepOutput>,
}

/// The next token of one item, as [`Executor::execute_sampling`] found it.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    /// The item's last row of logits, on the host, for the host sampler.
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
