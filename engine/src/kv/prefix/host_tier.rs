//! The host tier of the prefix cache: an LRU pool of KV blocks in host memory that device
//! blocks spill to when they are evicted (`--host-cache-blocks`).
//!
//! Memory is one preallocated arena of `capacity × block_bytes` bytes (no allocation per block);
//! a map `hash → slot` finds a block, an intrusive LRU list over slots picks the victim when
//! the arena is full. A fetched block stays (and becomes most recently used): the device copy
//! made from it may be evicted again later. Capacity 0 disables the tier: lookups find
//! nothing and offers are dropped.
//! Not here: what is spilled or restored and when (the engine's scheduler), and how the
//! restored bytes reach KV storage (the backend).

use std::collections::HashMap;
use std::fmt;

use super::events::{CacheEvent, Tier};
use super::hash::BlockHash;
use super::journal::CacheJournal;
use super::tier::{ExternalTier, TierError, TierKind};
use crate::kv::pool::lru::LruList;

pub struct HostTier {
    block_bytes: usize,
    /// `capacity × block_bytes` bytes; slot `s` is `arena[s*block_bytes .. (s+1)*block_bytes]`.
    arena: Vec<u8>,
    slots: HashMap<BlockHash, u32>,
    /// The hash held by each occupied slot.
    slot_hash: Vec<BlockHash>,
    /// Occupied slots, least recently used at the front.
    lru: LruList,
    /// Slots never used yet (taken before evicting anything).
    unused: Vec<u32>,
    /// Hashes entering and leaving the tier, while someone subscribes to them.
    journal: CacheJournal,
}

impl HostTier {
    /// A tier of `capacity` blocks of `block_bytes` bytes each, allocated now.
    ///
    /// # Panics
    /// If `capacity × block_bytes` overflows or `capacity >= u32::MAX`.
    pub fn new(capacity: usize, block_bytes: usize) -> Self {
        let len = capacity
            .checked_mul(block_bytes)
            .expect("host cache size overflows");
        Self {
            block_bytes,
            arena: vec![0; len],
            slots: HashMap::with_capacity(capacity),
            slot_hash: vec![BlockHash(0); capacity],
            lru: LruList::new(capacity),
            unused: (0..capacity as u32).rev().collect(),
            journal: CacheJournal::new(Tier::Host),
        }
    }

    /// Capacity in blocks (0 = disabled).
    pub fn capacity(&self) -> usize {
        self.slot_hash.len()
    }

    pub fn is_enabled(&self) -> bool {
        self.capacity() > 0
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.slots.contains_key(&hash)
    }

    /// Held hashes from the next to be evicted to the last (O(len); for tests and debugging).
    pub fn eviction_order(&self) -> Vec<BlockHash> {
        self.lru
            .iter()
            .map(|s| self.slot_hash[s as usize])
            .collect()
    }

    /// Every hash held, in no particular order (O(len)): what a cache snapshot lists.
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.slots.keys().copied().collect()
    }

    /// Record the hashes that enter and leave the tier from now on (or stop, dropping what
    /// was not drained); off at first ([`CacheJournal`]).
    pub fn record_changes(&mut self, on: bool) {
        self.journal.set_enabled(on);
    }

    /// Move the changes recorded since the last call, oldest first, to the end of `out`.
    pub fn drain_changes(&mut self, out: &mut Vec<CacheEvent>) {
        self.journal.drain_into(out);
    }

    fn slot(&self, s: u32) -> std::ops::Range<usize> {
        let start = s as usize * self.block_bytes;
        start..start + self.block_bytes
    }
}

impl ExternalTier for HostTier {
    fn kind(&self) -> TierKind {
        TierKind::Host
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn lookup(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.slots.contains_key(h))
            .count()
    }

    fn fetch(&mut self, hash: BlockHash, dst: &mut [u8]) -> Result<(), TierError> {
        if dst.len() != self.block_bytes {
            return Err(TierError::LengthMismatch {
                tier: TierKind::Host,
                expected: self.block_bytes,
                got: dst.len(),
            });
        }
        let Some(&s) = self.slots.get(&hash) else {
            return Err(TierError::Miss {
                tier: TierKind::Host,
                hash,
            });
        };
        dst.copy_from_slice(&self.arena[self.slot(s)]);
        self.lru.move_to_back(s);
        Ok(())
    }

    fn offer(&mut self, hash: BlockHash, data: &[u8]) {
        debug_assert_eq!(
            data.len(),
            self.block_bytes,
            "offered data is not one block"
        );
        if !self.is_enabled() || data.len() != self.block_bytes {
            return;
        }
        if let Some(&s) = self.slots.get(&hash) {
            // Same hash, same content: only the recency changes.
            self.lru.move_to_back(s);
            return;
        }
        let s = match self.unused.pop() {
            Some(s) => s,
            None => {
                let s = self
                    .lru
                    .pop_front()
                    .expect("a full tier has occupied slots");
                let old = self.slot_hash[s as usize];
                self.slots.remove(&old);
                self.journal.removed(old);
                s
            }
        };
        let range = self.slot(s);
        self.arena[range].copy_from_slice(data);
        self.slot_hash[s as usize] = hash;
        self.slots.insert(hash, s);
        self.journal.stored(hash);
        self.lru.push_back(s);
    }
}

impl fmt::Debug for HostTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostTier")
            .field("capacity", &self.capacity())
            .field("block_bytes", &self.block_bytes)
            .field("len", &self.len())
            .finish()
    }
}
