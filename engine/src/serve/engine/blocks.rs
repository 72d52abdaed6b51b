//! Block bookkeeping of the engine's sequences: growing a sequence's block table,
//! allocation (spilling evicted cached blocks to the host tier), freeing, registration in
//! the prefix cache, and preemption. The pool itself is [`crate::kv::pool`].

use crate::backend::Backend;
use crate::kv::hash::BlockHash;
use crate::kv::tier::ExternalTier;
use crate::serve::request::RequestId;

use super::Engine;

impl<B: Backend> Engine<B> {
    /// Make `id`'s blocks cover `tokens` tokens. False (nothing allocated) if the pool is
    /// short.
    pub(super) fn grow(&mut self, id: &RequestId, tokens: usize) -> bool {
        let bs = self.block_size();
        let have = self.seqs[id].blocks.len();
        let need = tokens.div_ceil(bs).saturating_sub(have);
        if need == 0 {
            return true;
        }
        match self.allocate(need) {
            Some(blocks) => {
                self.seqs.get_mut(id).expect("exists").blocks.extend(blocks);
                true
            }
            None => false,
        }
    }

    /// Allocate blocks, spilling evicted cached blocks to the host tier first.
    pub(super) fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        let alloc = self.pool.allocate(n).ok()?;
        for (block, hash) in alloc.evicted {
            if self.config.host_cache_blocks > 0 {
                self.executor.read_block(block, &mut self.block_buf);
                self.host.offer(hash, &self.block_buf);
            }
        }
        Some(alloc.blocks)
    }

    /// Free a sequence's blocks, given in logical order (the pool releases them tail first).
    pub(super) fn free_blocks(&mut self, blocks: &[u32]) {
        self.pool
            .free(blocks)
            .expect("pool invariant: the engine frees only blocks it holds");
    }

    pub(super) fn register(&mut self, block: u32, hash: BlockHash) {
        self.pool
            .register(block, hash)
            .expect("pool invariant: the engine registers only blocks it holds");
    }

    /// Put a running sequence back in front of the queue, its blocks freed (their content
    /// stays in the prefix cache where registered).
    pub(super) fn preempt(&mut self, id: &RequestId) {
        let seq = self.seqs.get_mut(id).expect("exists");
        let blocks = std::mem::take(&mut seq.blocks);
        seq.computed = 0;
        seq.registered = 0;
        self.free_blocks(&blocks);
        self.counters.preemptions += 1;
        self.waiting.push_front(id.clone());
    }
}
