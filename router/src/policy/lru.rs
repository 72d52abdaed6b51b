//! The router's own guess of what a node caches: a bounded set of the block hashes of the
//! prompts it sent there, least recently used forgotten first. The prefix-aware policy
//! falls back to it for a node whose cache events are not in sync (see the parent module).
//! Not here: what the nodes report themselves ([`crate::cache_index`]).

use std::collections::{BTreeMap, HashMap};

use pd_engine::kv::prefix::hash::BlockHash;

/// A bounded set of block hashes with least-recently-used eviction.
#[derive(Debug)]
pub(super) struct PrefixIndex {
    capacity: usize,
    pub(super) epoch: u64,
    clock: u64,
    stamps: HashMap<BlockHash, u64>,
    by_age: BTreeMap<u64, BlockHash>,
}

impl PrefixIndex {
    pub(super) fn new(capacity: usize, epoch: u64) -> Self {
        Self {
            capacity,
            epoch,
            clock: 0,
            stamps: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    /// Leading hashes present (hashes are chained: block i stands for blocks 0..=i).
    pub(super) fn matched(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamps.contains_key(h))
            .count()
    }

    /// Marks a prompt's blocks most recently used, its first block the most recent.
    pub(super) fn insert(&mut self, hashes: &[BlockHash]) {
        for &h in hashes.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamps.insert(h, self.clock) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.clock, h);
        }
        while self.stamps.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.stamps.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_engine::kv::prefix::hash::block_hashes;

    #[test]
    fn prefix_index_is_bounded_and_forgets_tails_first() {
        let mut ix = PrefixIndex::new(4, 0);
        let a = block_hashes(&(0..12).collect::<Vec<u32>>(), 4, None); // 3 blocks
        let b = block_hashes(&(100..108).collect::<Vec<u32>>(), 4, None); // 2 blocks
        ix.insert(&a);
        ix.insert(&b);
        assert_eq!(ix.stamps.len(), 4);
        assert_eq!(ix.matched(&b), 2);
        assert_eq!(ix.matched(&a), 2, "a's last block went first");
    }
}
