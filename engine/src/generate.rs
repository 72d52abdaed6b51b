//! A direct runner: the model executor with the block pool and a multi-sequence
//! forward step, for benchmarks and numerical tests that drive the model without a
//! scheduler (serving goes through [`crate::serve`]).

use crate::backend::{Backend, HostMatrix};
use crate::error::EngineError;
use crate::executor::{ExecItem, Executor};
use crate::kv::pool::BlockPool;
use crate::kv::{BlockTable, KvLayout};
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

/// A model with its KV cache and a block pool, for direct (unscheduled) use. It never
/// registers a block in the prefix cache, so to it the pool is a plain free list.
pub struct Runner<B: Backend> {
    executor: Executor<B>,
    pool: BlockPool,
    max_model_len: usize,
}

impl<B: Backend> std::fmt::Debug for Runner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("executor", &self.executor)
            .field("free_blocks", &self.pool.num_free())
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
            pool: BlockPool::new(num_blocks),
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
        self.pool.num_free()
    }

    pub fn total_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Return a sequence's blocks.
    pub fn release(&mut self, seq: &mut Sequence) {
        release(&mut self.pool, &mut seq.table);
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
            if let Err(e) = grow(&mut self.pool, &mut items[idx].seq.table, end, bs) {
                for (item, &n) in items.iter_mut().zip(&before).take(idx) {
                    let mut extra = BlockTable {
                        blocks: item.seq.table.blocks.split_off(n),
                    };
                    release(&mut self.pool, &mut extra);
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

/// Grow `table` so it covers `tokens` tokens, or fail without allocating anything.
fn grow(
    pool: &mut BlockPool,
    table: &mut BlockTable,
    tokens: usize,
    block_size: usize,
) -> Result<(), EngineError> {
    let need = tokens
        .div_ceil(block_size)
        .saturating_sub(table.blocks.len());
    let allocation = pool.allocate(need).map_err(|_| {
        EngineError::OutOfBlocks(format!(
            "{tokens} tokens need {need} more blocks of {block_size}, {} free",
            pool.num_free()
        ))
    })?;
    table.blocks.extend(allocation.blocks);
    Ok(())
}

/// Return every block of `table` to the pool.
fn release(pool: &mut BlockPool, table: &mut BlockTable) {
    pool.free(&table.blocks)
        .expect("pool invariant: the runner frees only the blocks its tables hold");
    table.blocks.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_is_all_or_nothing_and_release_returns_everything() {
        let mut pool = BlockPool::new(4);
        let mut t = BlockTable::default();
        grow(&mut pool, &mut t, 17, 16).unwrap();
        assert_eq!(t.blocks.len(), 2);
        assert!(grow(&mut pool, &mut t, 16 * 7, 16).is_err());
        assert_eq!(t.blocks.len(), 2, "a failed grow allocates nothing");
        grow(&mut pool, &mut t, 64, 16).unwrap();
        assert_eq!(pool.num_free(), 0);
        release(&mut pool, &mut t);
        assert_eq!(pool.num_free(), 4);
        assert!(t.blocks.is_empty());
    }
}
