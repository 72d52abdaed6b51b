//! The block pool: physical KV blocks with reference counts, and free blocks kept in LRU
//! order (`lru.rs`) so that cached content survives until the memory is needed. It keeps the
//! device tier of the prefix cache ([`crate::kv::prefix::device`]: which block holds which
//! [`BlockHash`]) in step with those counts; the map itself and its journal live there.
//! Not here: the KV memory (the backend's), the host tier and hashing ([`crate::kv::prefix`]),
//! blocks set aside for an import ([`crate::kv::handoff`]).
//!
//! It is the one block allocator: the direct runner ([`crate::generate::Runner`]) takes and
//! returns blocks here too, and since it never registers one, to it this is a free list.
//!
//! # States of a block
//!
//! | refcount | hash      | where                  | meaning                                      |
//! |----------|-----------|------------------------|----------------------------------------------|
//! | > 0      | none      | —                      | in use, content not (yet) complete/shared    |
//! | > 0      | `h`       | map `h → block`        | in use and cached: others may share it       |
//! | 0        | none      | *uncached free* list   | free, nothing worth keeping                  |
//! | 0        | `h`       | map + *evictable* list | free but cached: reusable by a later request |
//!
//! [`BlockPool::allocate`] takes uncached free blocks first (least recently freed first) and
//! only when none is left evicts cached free blocks, least recently freed first; an evicted
//! block's hash leaves the map and is reported in [`Allocation::evicted`] so the caller can copy
//! the content to the host tier **before** it writes new data into the block.
//! [`BlockPool::free`] takes a sequence's blocks in logical order and releases them tail first,
//! so a prompt's last blocks are evicted before its first ones (a shorter prefix stays reusable
//! longest, as in vLLM).
//!
//! # Using it (what the scheduler does per request)
//!
//! 1. `n = pool.cached_prefix(&hashes)` (capped by the caller so the last prompt token is
//!    always computed), then `blocks = pool.acquire_cached(&hashes[..n])?` — acquire **before**
//!    allocating, or the allocation may evict the very blocks the request was going to reuse.
//! 2. `pool.allocate(rest)?` for the remaining blocks; copy out `evicted` first.
//! 3. When a block's content is complete (all `block_size` tokens computed or restored),
//!    `pool.register(block, hash)`.
//! 4. On every exit path (finish, abort, preemption): `pool.free(&table.blocks)?`.
//!
//! # Errors rather than panics
//!
//! Misuse that would corrupt the cache — a double free, registering a block nobody holds,
//! re-registering a block under another hash, an id out of range — is reported as a
//! [`PoolError`] and leaves the pool unchanged (every call is all-or-nothing). These are bugs in
//! the caller: log them loudly; they cannot go unnoticed because every such method returns a
//! `Result`.
//!
//! Every operation is O(1) per block (hash-map operations and an intrusive doubly-linked list
//! over block ids); only [`BlockPool::check_invariants`] scans the pool.

pub(crate) mod lru;

use std::fmt;

use crate::kv::prefix::device::DeviceIndex;
pub use crate::kv::prefix::device::Registration;
use crate::kv::prefix::events::CacheEvent;
use crate::kv::prefix::hash::BlockHash;
use lru::LruList;

/// Misuse of a [`BlockPool`]; the call that returns one changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error(
        "out of KV blocks: {needed} needed, {free} free (free includes evictable cached blocks)"
    )]
    OutOfBlocks { needed: usize, free: usize },
    #[error("block id {block} is out of range (the pool has {num_blocks} blocks)")]
    InvalidBlock { block: u32, num_blocks: usize },
    #[error("double free of KV block {block}: its reference count is already 0")]
    DoubleFree { block: u32 },
    #[error(
        "KV block {block} is not in use (reference count 0): only a held block can be registered"
    )]
    NotInUse { block: u32 },
    #[error("KV block {block} is already registered as {registered}, cannot register it as {new}")]
    HashConflict {
        block: u32,
        registered: BlockHash,
        new: BlockHash,
    },
    #[error("block hash {hash} (index {index}) is not cached on the device")]
    NotCached { index: usize, hash: BlockHash },
}

/// The result of [`BlockPool::allocate`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Exactly the number of blocks asked for, each with reference count 1 and no hash.
    pub blocks: Vec<u32>,
    /// Cached blocks that were reclaimed to satisfy the allocation (each also in `blocks`),
    /// with the hash they held, in eviction order. Their hash is no longer in the pool's map;
    /// their content is still intact: copy it to the host tier **before** writing new data.
    pub evicted: Vec<(u32, BlockHash)>,
}

/// Physical KV blocks, their reference counts and the device tier of the prefix cache.
/// See the module doc for the states of a block and how to use it.
#[derive(Clone)]
pub struct BlockPool {
    refcount: Vec<u32>,
    /// The device tier's `hash ↔ block` map and its journal (the prefix cache's part).
    index: DeviceIndex,
    /// Free blocks without a hash, least recently freed at the front; used first.
    free_uncached: LruList,
    /// Free blocks with a hash, least recently freed (or touched) at the front; evicted in
    /// that order once `free_uncached` is empty.
    evictable: LruList,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks with ids `0..num_blocks`, handed out in that order
    /// at first.
    ///
    /// # Panics
    /// If `num_blocks >= u32::MAX`.
    pub fn new(num_blocks: usize) -> Self {
        let mut free_uncached = LruList::new(num_blocks);
        for b in 0..num_blocks as u32 {
            free_uncached.push_back(b);
        }
        Self {
            refcount: vec![0; num_blocks],
            index: DeviceIndex::new(num_blocks),
            free_uncached,
            evictable: LruList::new(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks that [`allocate`](Self::allocate) can hand out: uncached free blocks plus
    /// evictable cached ones (reference count 0).
    pub fn num_free(&self) -> usize {
        self.free_uncached.len() + self.evictable.len()
    }

    /// Cached blocks with reference count 0 (part of [`num_free`](Self::num_free)).
    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks with reference count > 0.
    pub fn num_in_use(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Registered blocks, in use or evictable: the device tier's size in blocks.
    pub fn num_cached(&self) -> usize {
        self.index.len()
    }

    /// Fraction of blocks with reference count > 0, in [0, 1] (vLLM's `kv_cache_usage_perc`:
    /// evictable cached blocks count as free). 0 for an empty pool.
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            0.0
        } else {
            self.num_in_use() as f64 / self.num_blocks() as f64
        }
    }

    /// Reference count of `block` (0 for an id out of range).
    pub fn refcount(&self, block: u32) -> u32 {
        self.refcount.get(block as usize).copied().unwrap_or(0)
    }

    /// The hash `block` is registered with, if any.
    pub fn block_hash(&self, block: u32) -> Option<BlockHash> {
        self.index.block_hash(block)
    }

    /// The block that holds `hash` on the device, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.index.lookup(hash)
    }

    /// How many leading `hashes` are cached on the device. No side effects (not even on the
    /// LRU order).
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        self.index.cached_prefix(hashes)
    }

    /// Take one reference on the cached block of each of `hashes` (normally the first
    /// [`cached_prefix`](Self::cached_prefix) hashes of a request) and return the blocks in
    /// the same order. A block that was evictable leaves the evictable list.
    ///
    /// Fails with [`PoolError::NotCached`], changing nothing, if any hash is not cached.
    pub fn acquire_cached(&mut self, hashes: &[BlockHash]) -> Result<Vec<u32>, PoolError> {
        let mut blocks = Vec::with_capacity(hashes.len());
        for (index, &hash) in hashes.iter().enumerate() {
            match self.index.lookup(hash) {
                Some(b) => blocks.push(b),
                None => return Err(PoolError::NotCached { index, hash }),
            }
        }
        for &b in &blocks {
            let rc = &mut self.refcount[b as usize];
            if *rc == 0 {
                self.evictable.remove(b);
            }
            *rc += 1;
        }
        Ok(blocks)
    }

    /// Hand out `n` blocks, each with reference count 1 and no hash, or fail with
    /// [`PoolError::OutOfBlocks`] without taking any.
    ///
    /// Uncached free blocks go first (least recently freed first); then evictable cached
    /// blocks, least recently freed first, are evicted: their hash leaves the map and they are
    /// listed in [`Allocation::evicted`] — copy their content out before overwriting it.
    pub fn allocate(&mut self, n: usize) -> Result<Allocation, PoolError> {
        let free = self.num_free();
        if n > free {
            return Err(PoolError::OutOfBlocks { needed: n, free });
        }
        let mut blocks = Vec::with_capacity(n);
        let mut evicted = Vec::new();
        for _ in 0..n {
            let b = match self.free_uncached.pop_front() {
                Some(b) => b,
                None => {
                    let b = self.evictable.pop_front().expect("counted in num_free");
                    let h = self.index.evict(b);
                    evicted.push((b, h));
                    b
                }
            };
            debug_assert_eq!(self.refcount[b as usize], 0);
            self.refcount[b as usize] = 1;
            blocks.push(b);
        }
        Ok(Allocation { blocks, evicted })
    }

    /// Record that `block` (which the caller holds) now holds the complete content of `hash`,
    /// so that later requests can share it.
    ///
    /// - If another block already holds `hash`, the existing mapping is kept and `block`
    ///   stays unregistered ([`Registration::Duplicate`]).
    /// - Registering a block again with the same hash is a no-op
    ///   ([`Registration::AlreadyRegistered`]).
    /// - Errors (nothing changes): [`PoolError::NotInUse`] if the block's reference count is 0,
    ///   [`PoolError::HashConflict`] if it is registered with another hash (a cached block's
    ///   content must never change), [`PoolError::InvalidBlock`].
    pub fn register(&mut self, block: u32, hash: BlockHash) -> Result<Registration, PoolError> {
        self.check_id(block)?;
        let i = block as usize;
        if self.refcount[i] == 0 {
            return Err(PoolError::NotInUse { block });
        }
        self.index
            .insert(block, hash)
            .map_err(|registered| PoolError::HashConflict {
                block,
                registered,
                new: hash,
            })
    }

    /// Drop one reference on each of `blocks`, given in the sequence's logical order (a block
    /// table). They are released **tail first**: among blocks reaching reference count 0, the
    /// sequence's last block becomes the least recently freed, so under memory pressure a
    /// prompt's tail is evicted before its prefix. A block reaching 0 stays cached (evictable)
    /// if it is registered, and becomes an uncached free block otherwise.
    ///
    /// A block whose reference count is already 0 is a double free: the call fails with
    /// [`PoolError::DoubleFree`] (or [`PoolError::InvalidBlock`]) and changes nothing. (A
    /// block listed twice needs two references.)
    pub fn free(&mut self, blocks: &[u32]) -> Result<(), PoolError> {
        for (done, &b) in blocks.iter().enumerate() {
            let error = match self.refcount.get(b as usize) {
                None => Some(PoolError::InvalidBlock {
                    block: b,
                    num_blocks: self.num_blocks(),
                }),
                Some(0) => Some(PoolError::DoubleFree { block: b }),
                Some(_) => None,
            };
            if let Some(error) = error {
                for &u in &blocks[..done] {
                    self.refcount[u as usize] += 1;
                }
                return Err(error);
            }
            self.refcount[b as usize] -= 1;
        }
        for &b in blocks.iter().rev() {
            if self.refcount[b as usize] == 0 {
                self.park(b);
            }
        }
        Ok(())
    }

    /// Mark the cached blocks of the leading cached `hashes` as recently used, tail first as
    /// in [`free`](Self::free) (only evictable ones move; blocks in use are not in the LRU).
    /// Returns [`cached_prefix`](Self::cached_prefix). Use it to keep a waiting request's
    /// prefix from being evicted first.
    pub fn touch(&mut self, hashes: &[BlockHash]) -> usize {
        let n = self.cached_prefix(hashes);
        for &h in hashes[..n].iter().rev() {
            let b = self.index.lookup(h).expect("within the cached prefix");
            if self.evictable.contains(b) {
                self.evictable.move_to_back(b);
            }
        }
        n
    }

    /// Every hash cached on the device, in no particular order (O(cached)): what a cache
    /// snapshot lists.
    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        self.index.hashes()
    }

    /// Record the hashes that enter and leave the device tier from now on (or stop, dropping
    /// what was not drained); off at first
    /// ([`CacheJournal`](crate::kv::prefix::journal::CacheJournal)).
    pub fn record_changes(&mut self, on: bool) {
        self.index.record_changes(on);
    }

    /// Move the changes recorded since the last call, oldest first, to the end of `out`.
    pub fn drain_changes(&mut self, out: &mut Vec<CacheEvent>) {
        self.index.drain_changes(out);
    }

    /// Evictable blocks from the next to be evicted to the last (O(evictable); for tests and
    /// debugging).
    pub fn eviction_order(&self) -> Vec<u32> {
        self.evictable.iter().collect()
    }

    /// Full consistency check, O(num_blocks): every block is in exactly the place its state
    /// says (see the module doc) and the map and the blocks agree. For tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.num_blocks();
        for b in 0..n as u32 {
            let i = b as usize;
            let (rc, hash) = (self.refcount[i], self.index.block_hash(b));
            let in_free = self.free_uncached.contains(b);
            let in_evictable = self.evictable.contains(b);
            let ok = match (rc, hash) {
                (0, None) => in_free && !in_evictable,
                (0, Some(_)) => !in_free && in_evictable,
                (_, _) => !in_free && !in_evictable,
            };
            if !ok {
                return Err(format!(
                    "block {b}: refcount {rc}, hash {hash:?}, in uncached free list {in_free}, \
                     in evictable list {in_evictable}"
                ));
            }
        }
        self.index.check_invariants()?;
        let walked = self.free_uncached.iter().count() + self.evictable.iter().count();
        if walked != self.num_free() {
            return Err(format!(
                "free lists walk {walked} blocks, counted {}",
                self.num_free()
            ));
        }
        Ok(())
    }

    fn park(&mut self, b: u32) {
        // A block listed twice in one `free` reaches 0 once but is seen twice here.
        if self.index.is_registered(b) {
            if !self.evictable.contains(b) {
                self.evictable.push_back(b);
            }
        } else if !self.free_uncached.contains(b) {
            self.free_uncached.push_back(b);
        }
    }

    fn check_id(&self, block: u32) -> Result<(), PoolError> {
        if (block as usize) < self.num_blocks() {
            Ok(())
        } else {
            Err(PoolError::InvalidBlock {
                block,
                num_blocks: self.num_blocks(),
            })
        }
    }
}

impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("num_blocks", &self.num_blocks())
            .field("in_use", &self.num_in_use())
            .field("cached", &self.num_cached())
            .field("evictable", &self.num_evictable())
            .field("uncached_free", &self.free_uncached.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_pool_hands_out_ids_in_order() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.usage(), 0.0);
        let a = p.allocate(3).unwrap();
        assert_eq!(a.blocks, [0, 1, 2]);
        assert!(a.evicted.is_empty());
        assert_eq!(p.usage(), 0.75);
        p.check_invariants().unwrap();
        assert_eq!(BlockPool::new(0).usage(), 0.0);
    }

    #[test]
    fn free_of_a_listed_twice_block_parks_it_once() {
        let mut p = BlockPool::new(2);
        let b = p.allocate(1).unwrap().blocks[0];
        p.register(b, BlockHash(7)).unwrap();
        assert_eq!(p.acquire_cached(&[BlockHash(7)]).unwrap(), [b]);
        p.free(&[b, b]).unwrap();
        assert_eq!(p.refcount(b), 0);
        assert_eq!(p.eviction_order(), [b]);
        p.check_invariants().unwrap();
    }
}
