//! A single-process runner: a model, its paged KV storage and a block allocator, with a
//! multi-sequence forward step and a complete single-request generation loop (chunked
//! prefill, prompt logprobs, sampling, stop conditions, streaming). `pdctl run` and the
//! model benchmark use it; the serving scheduler builds on the same `step`.

use crate::backend::{Backend, HostMatrix};
use crate::error::EngineError;
use crate::executor::{ExecItem, Executor};
use crate::kv::{BlockAllocator, BlockTable, KvLayout};
use crate::model::Qwen3;
use crate::sampling::{
    FinishReason, PromptLogprob, SampledToken, Sampler, SamplingParams, StopChecker,
    prompt_logprobs,
};
use crate::tokenizer::Tokenizer;

/// One sequence's state in the runner: its tokens and the blocks that hold their KV.
#[derive(Debug, Default)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    /// How many of `tokens` have their KV in the cache.
    pub computed: usize,
    pub table: BlockTable,
}

impl Sequence {
    pub fn new(tokens: Vec<u32>) -> Self {
        Self {
            tokens,
            computed: 0,
            table: BlockTable::default(),
        }
    }
}

/// What a step computes for one sequence.
#[derive(Debug)]
pub struct StepItem<'a> {
    pub seq: &'a mut Sequence,
    /// New tokens to run: `seq.tokens[seq.computed .. seq.computed + count]`.
    pub count: usize,
    /// Return logits for every new token (prompt logprobs), not only the last.
    pub all_logits: bool,
}

/// A model with its KV cache and a plain block allocator, for direct (unscheduled) use.
pub struct Runner<B: Backend> {
    executor: Executor<B>,
    allocator: BlockAllocator,
    max_model_len: usize,
}

impl<B: Backend> std::fmt::Debug for Runner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("executor", &self.executor)
            .field("free_blocks", &self.allocator.num_free())
            .finish_non_exhaustive()
    }
}

/// Everything a finished generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Per generated token, when logprobs were asked for.
    pub logprobs: Option<Vec<SampledToken>>,
    /// Per prompt position after the first, when prompt logprobs were asked for.
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
}

/// One streamed piece of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent<'a> {
    pub token: &'a SampledToken,
    /// Text that became final with this token (may be empty: held back or mid-character).
    pub text: &'a str,
}

impl<B: Backend> Runner<B> {
    /// A runner with `num_blocks` KV blocks of `block_size` tokens.
    pub fn new(
        backend: B,
        model: Qwen3<B>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, EngineError> {
        let max_model_len = model.config().max_position_embeddings;
        Ok(Self {
            executor: Executor::new(backend, model, block_size, num_blocks)?,
            allocator: BlockAllocator::new(num_blocks),
            max_model_len,
        })
    }

    /// Limit the context (prompt + generated tokens) below the model's maximum.
    pub fn set_max_model_len(&mut self, len: usize) -> Result<(), EngineError> {
        let max = self.model().config().max_position_embeddings;
        if len == 0 || len > max {
            return Err(EngineError::InvalidRequest(format!(
                "max model length {len} must be between 1 and the model's {max} positions"
            )));
        }
        self.max_model_len = len;
        Ok(())
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn model(&self) -> &Qwen3<B> {
        self.executor.model()
    }

    pub fn layout(&self) -> &KvLayout {
        self.executor.layout()
    }

    pub fn free_blocks(&self) -> usize {
        self.allocator.num_free()
    }

    pub fn total_blocks(&self) -> usize {
        self.allocator.total()
    }

    /// Return a sequence's blocks.
    pub fn release(&mut self, seq: &mut Sequence) {
        self.allocator.release(&mut seq.table);
        seq.computed = 0;
    }

    /// One forward pass over several sequences. Returns, per item, the logits of its last
    /// new token (or of every new token with `all_logits`). On error nothing was computed
    /// and blocks already held stay with their sequences.
    pub fn step(&mut self, items: &mut [StepItem<'_>]) -> Result<Vec<HostMatrix>, EngineError> {
        let bs = self.layout().block_size;
        let max_len = self.max_model_len;
        for item in items.iter_mut() {
            let end = item.seq.computed + item.count;
            if item.count == 0 || end > item.seq.tokens.len() {
                return Err(EngineError::InvalidRequest(format!(
                    "step of {} tokens from {} in a sequence of {}",
                    item.count,
                    item.seq.computed,
                    item.seq.tokens.len()
                )));
            }
            if end > max_len {
                return Err(EngineError::InvalidRequest(format!(
                    "{end} tokens exceed the model's {max_len} positions"
                )));
            }
        }
        // Reserve every item's blocks before computing anything; undo on failure.
        let before: Vec<usize> = items.iter().map(|i| i.seq.table.blocks.len()).collect();
        for idx in 0..items.len() {
            let end = items[idx].seq.computed + items[idx].count;
            if let Err(e) = self.allocator.grow(&mut items[idx].seq.table, end, bs) {
                for (item, &n) in items.iter_mut().zip(&before).take(idx) {
                    let mut extra = BlockTable {
                        blocks: item.seq.table.blocks.split_off(n),
                    };
                    self.allocator.release(&mut extra);
                }
                return Err(e);
            }
        }

        let exec: Vec<ExecItem<'_>> = items
            .iter()
            .map(|item| ExecItem {
                tokens: &item.seq.tokens[item.seq.computed..item.seq.computed + item.count],
                start: item.seq.computed,
                block_table: &item.seq.table.blocks,
                all_logits: item.all_logits,
            })
            .collect();
        let out = self.executor.execute(&exec);
        for item in items.iter_mut() {
            item.seq.computed += item.count;
        }
        Ok(out)
    }

    /// Generate for one request: chunked prefill of at most `chunk` tokens per step, then
    /// token-by-token decoding until a stop condition. `on_token` sees each token as it is
    /// sampled. Every block is released before returning, on success or error.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &SamplingParams,
        seed: u64,
        eos_token_ids: &[u32],
        tokenizer: &Tokenizer,
        chunk: usize,
        on_token: &mut dyn FnMut(TokenEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let mut seq = Sequence::new(prompt.to_vec());
        let result = self.generate_inner(&mut seq, params, seed, eos_token_ids, tokenizer, chunk, on_token);
        self.release(&mut seq);
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn generate_inner(
        &mut self,
        seq: &mut Sequence,
        params: &SamplingParams,
        seed: u64,
        eos_token_ids: &[u32],
        tokenizer: &Tokenizer,
        chunk: usize,
        on_token: &mut dyn FnMut(TokenEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let c = self.model().config().clone();
        let prompt: Vec<u32> = seq.tokens.clone();
        validate_prompt(&prompt, c.vocab_size, self.max_model_len, params.max_tokens)?;
        params.validate(c.vocab_size, u32::MAX)?;
        let chunk = chunk.max(1);

        let mut prompt_lp: Option<Vec<PromptLogprob>> = params.prompt_logprobs.map(|_| Vec::new());
        let mut last_logits = Vec::new();
        while seq.computed < prompt.len() {
            let start = seq.computed;
            let count = chunk.min(prompt.len() - start);
            let all = params.prompt_logprobs.is_some();
            let logits = self.step(&mut [StepItem { seq, count, all_logits: all }])?.remove(0);
            if let (Some(out), Some(k)) = (prompt_lp.as_mut(), params.prompt_logprobs) {
                // Row r predicts prompt token start + r + 1.
                for r in 0..logits.rows {
                    let next = start + r + 1;
                    if next < prompt.len() {
                        out.push(prompt_logprobs(logits.row(r), prompt[next], k));
                    }
                }
            }
            last_logits = logits.row(logits.rows - 1).to_vec();
        }

        let mut sampler = Sampler::new(params, seed);
        let mut stop = StopChecker::new(params, eos_token_ids.to_vec());
        let mut decoder = tokenizer.incremental_decoder(true);
        let mut output: Vec<u32> = Vec::new();
        let mut logprobs: Option<Vec<SampledToken>> = params.logprobs.map(|_| Vec::new());
        let mut text = String::new();
        // Ids past the tokenizer's vocabulary are padding rows of the embedding: no text
        // exists for them, so they can never be produced.
        let known = tokenizer.vocab_size().min(c.vocab_size);
        let finish = loop {
            last_logits[known..].fill(f32::NEG_INFINITY);
            let sampled = sampler.sample(&last_logits, &prompt, &output);
            output.push(sampled.token_id);
            seq.tokens.push(sampled.token_id);
            let piece = decoder.push(sampled.token_id)?;
            let decision = stop.on_token(sampled.token_id, &piece);
            text.push_str(&decision.text);
            on_token(TokenEvent {
                token: &sampled,
                text: &decision.text,
            });
            if let Some(lp) = logprobs.as_mut() {
                lp.push(sampled);
            }
            if let Some(reason) = decision.finished {
                break reason;
            }
            let count = seq.tokens.len() - seq.computed;
            last_logits = self
                .step(&mut [StepItem { seq, count, all_logits: false }])?
                .remove(0)
                .data;
        };
        Ok(Generation {
            token_ids: output,
            text,
            finish_reason: finish,
            prompt_tokens: prompt.len(),
            logprobs,
            prompt_logprobs: prompt_lp,
        })
    }
}

/// The prompt checks every entry point shares: non-empty, ids inside the vocabulary, and
/// room in the context for the prompt plus `max_tokens`.
pub fn validate_prompt(
    prompt: &[u32],
    vocab_size: usize,
    max_model_len: usize,
    max_tokens: u32,
) -> Result<(), EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if let Some((i, id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab_size)
    {
        return Err(EngineError::InvalidRequest(format!(
            "token id {id} at position {i} is outside the vocabulary (size {vocab_size})"
        )));
    }
    if prompt.len() >= max_model_len {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {} tokens; the model's context is {max_model_len} tokens",
            prompt.len()
        )));
    }
    if prompt.len() + max_tokens as usize > max_model_len {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {max_model_len} tokens",
            prompt.len()
        )));
    }
    Ok(())
}
