//! A direct runner: the model executor with a plain block allocator and a multi-sequence
//! forward step, for benchmarks and numerical tests that drive the model without a
//! scheduler (serving goes through [`crate::serve`]).

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
