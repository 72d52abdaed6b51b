//! The device tier of the prefix cache: which block of the pool holds which [`BlockHash`],
//! both ways, and the journal of hashes entering and leaving the tier.
//!
//! The [`BlockPool`](crate::kv::pool::BlockPool) owns one and keeps it in step with its
//! reference counts and free lists (a block is evictable exactly when it is registered here
//! and nobody holds it). This module owns only the mapping: it does not hand out, free or
//! evict blocks (the pool decides which block goes), and it never sees a reference count.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use super::events::{CacheEvent, Tier};
use super::hash::BlockHash;
use super::journal::CacheJournal;

/// What [`BlockPool::register`](crate::kv::pool::BlockPool::register) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// The block is now the cached copy of the hash.
    New,
    /// The block was already registered with this hash; nothing changed.
    AlreadyRegistered,
    /// Another block already holds this hash (two requests computed the same block at the
    /// same time). The existing mapping is kept and this block stays unregistered: the caller
    /// keeps using it, and when freed it goes back as an uncached free block.
    Duplicate { existing: u32 },
}

/// `hash ↔ block` for every registered block of a pool of `num_blocks` blocks.
#[derive(Clone)]
pub(crate) struct DeviceIndex {
    /// The hash each block is registered with.
    hash: Vec<Option<BlockHash>>,
    /// `hash → block` for every registered block (in use or evictable).
    cached: HashMap<BlockHash, u32>,
    /// Hashes entering and leaving `cached`, while someone subscribes to them.
    journal: CacheJournal,
}

impl DeviceIndex {
    /// No block registered; block ids `0..num_blocks`.
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self {
            hash: vec![None; num_blocks],
            cached: HashMap::new(),
            journal: CacheJournal::new(Tier::Device),
        }
    }

    /// Registered blocks: the device tier's size in blocks.
    pub(crate) fn len(&self) -> usize {
        self.cached.len()
    }

    /// The hash `block` is registered with (None for an id out of range).
    pub(crate) fn block_hash(&self, block: u32) -> Option<BlockHash> {
        self.hash.get(block as usize).copied().flatten()
    }

    /// Whether `block` (in range) is registered.
    pub(crate) fn is_registered(&self, block: u32) -> bool {
        self.hash[block as usize].is_some()
    }

    /// The block that holds `hash`, if any.
    pub(crate) fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.cached.get(&hash).copied()
    }

    /// How many leading `hashes` are registered.
    pub(crate) fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Register `block` (in range, held by the caller) as the copy of `hash`; see
    /// [`Registration`]. `Err(registered)` if the block is registered with another hash:
    /// nothing changes.
    pub(crate) fn insert(
        &mut self,
        block: u32,
        hash: BlockHash,
    ) -> Result<Registration, BlockHash> {
        let i = block as usize;
        match self.hash[i] {
            Some(h) if h == hash => return Ok(Registration::AlreadyRegistered),
            Some(registered) => return Err(registered),
            None => {}
        }
        match self.cached.entry(hash) {
            Entry::Occupied(e) => Ok(Registration::Duplicate { existing: *e.get() }),
            Entry::Vacant(e) => {
                e.insert(block);
                self.hash[i] = Some(hash);
                self.journal.stored(hash);
                Ok(Registration::New)
            }
        }
    }

    /// Unregister `block` (in range, registered), whose content is about to be overwritten,
    /// and return the hash it held.
    pub(crate) fn evict(&mut self, block: u32) -> BlockHash {
        let h = self.hash[block as usize]
            .take()
            .expect("evictable blocks are registered");
        let removed = self.cached.remove(&h);
        debug_assert_eq!(removed, Some(block));
        self.journal.removed(h);
        h
    }

    /// Every registered hash, in no particular order (O(registered)).
    pub(crate) fn hashes(&self) -> Vec<BlockHash> {
        self.cached.keys().copied().collect()
    }

    /// Record the hashes that enter and leave the tier from now on (or stop, dropping what
    /// was not drained); off at first ([`CacheJournal`]).
    pub(crate) fn record_changes(&mut self, on: bool) {
        self.journal.set_enabled(on);
    }

    /// Move the changes recorded since the last call, oldest first, to the end of `out`.
    pub(crate) fn drain_changes(&mut self, out: &mut Vec<CacheEvent>) {
        self.journal.drain_into(out);
    }

    /// The map and the blocks agree, both ways. O(num_blocks); for tests and debugging.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut listed = 0;
        for (b, hash) in self.hash.iter().enumerate() {
            if let Some(h) = hash {
                listed += 1;
                if self.cached.get(h) != Some(&(b as u32)) {
                    return Err(format!(
                        "block {b} has hash {h} but the map says {:?}",
                        self.cached.get(h)
                    ));
                }
            }
        }
        if listed != self.cached.len() {
            return Err(format!(
                "{} hashes in the map, {listed} registered blocks",
                self.cached.len()
            ));
        }
        Ok(())
    }
}
