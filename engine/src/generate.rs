//! A direct runner: the model executor with a plain block allocator and a multi-sequence
//! forward step, for benchmarks and numerical tests that drive the model without a
//! scheduler (serving goes through [`crate::serve`]). Also the prompt checks every entry
//! point shares.

use crate::backend::{Backend, HostMatrix};
use crate::error::EngineError;
use crate::executor::{ExecItem, Executor};
use crate::kv::{BlockAllocator, BlockTable, KvLayout};
use crate::model::Qwen3;

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
}

/// vLLM's `truncate_prompt_tokens`: keep only the last `keep` tokens of `prompt` (left
/// truncation, after any chat template), `keep` in `1..=max_model_len`. A shorter prompt is
/// kept whole.
pub fn truncate_prompt(
    prompt: &mut Vec<u32>,
    keep: u32,
    max_model_len: usize,
) -> Result<(), EngineError> {
    if keep == 0 || keep as usize > max_model_len {
        return Err(EngineError::InvalidRequest(format!(
            "truncate_prompt_tokens must be between 1 and the model's context of \
             {max_model_len} tokens, got {keep}"
        )));
    }
    let excess = prompt.len().saturating_sub(keep as usize);
    prompt.drain(..excess);
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_the_last_tokens_within_the_context() {
        let mut p: Vec<u32> = (0..10).collect();
        truncate_prompt(&mut p, 4, 16).unwrap();
        assert_eq!(p, [6, 7, 8, 9]);
        truncate_prompt(&mut p, 16, 16).unwrap();
        assert_eq!(p, [6, 7, 8, 9], "a shorter prompt stays whole");
        for bad in [0, 17] {
            let e = truncate_prompt(&mut p, bad, 16).unwrap_err().to_string();
            assert!(
                e.contains("truncate_prompt_tokens must be between 1 and"),
                "{e}"
            );
        }
    }
}
