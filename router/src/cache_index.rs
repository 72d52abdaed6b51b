//! What every node's prefix cache holds, as the node itself reports it: one index over all
//! nodes (prefill and decode roles alike), fed by each node's cache events — a snapshot,
//! then ordered changes — per tier (device blocks, host-memory blocks).
//!
//! The index answers one question for routing: how many leading blocks of a prompt a node
//! would find, and in which tier ([`TierMatch`]): the node's device run first (local hits),
//! then the blocks it would restore from its host tier. It never guesses: a node whose
//! stream is not in sync (no snapshot yet, a gap in its sequence numbers, a new epoch after
//! a restart, more blocks than the node said it can hold) answers `None`, and the caller
//! falls back to its own guess until the next snapshot.
//!
//! Memory is bounded per node by the capacity the node reports in its snapshot (device
//! blocks plus host blocks), and over all nodes by `max_blocks`: a node that would pass
//! either bound is dropped out of sync rather than grown. Block hashes are the engines' own
//! ([`pd_engine::kv::prefix::hash`]), so one prompt hashed once per block size is compared as is;
//! the events are the engines' own vocabulary ([`pd_engine::kv::prefix::events`]).
//!
//! [`SharedIndex`] is the one index of a router: the subscriptions write it, the policy reads
//! it, each for one short synchronous step under its lock.
//!
//! Not here: subscribing to the nodes' streams ([`crate::registry`]'s feed), the routing
//! decision (the policy's).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

pub use pd_engine::kv::prefix::events::{CacheEvent, EventBatch, Snapshot, Tier};
use pd_engine::kv::prefix::hash::BlockHash;

/// How many leading blocks of a prompt a node holds, split by the tier it would take each
/// from: `device` leading blocks on the device, then `host` more restorable from the host
/// tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierMatch {
    pub device: usize,
    pub host: usize,
}

impl TierMatch {
    /// Blocks found in any tier.
    pub fn blocks(&self) -> usize {
        self.device + self.host
    }

    /// The prompt tokens a node would reuse from this match for a prompt of `prompt_len`
    /// tokens in blocks of `block_size`, as `(device, host)`: whole blocks, capped the way the
    /// engine caps its lookup (`(prompt_len - 1) / block_size` blocks: the last prompt token
    /// is always computed), the device run first.
    pub fn tokens(&self, block_size: usize, prompt_len: usize) -> (u64, u64) {
        let usable = prompt_len.saturating_sub(1) / block_size.max(1);
        let device = self.device.min(usable);
        let host = self.blocks().min(usable) - device;
        let bs = block_size as u64;
        (device as u64 * bs, host as u64 * bs)
    }
}

/// Why a node's view was dropped (for logs and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutOfSync {
    /// Events arrived before any snapshot of their epoch.
    NoSnapshot,
    /// A sequence number was skipped or repeated out of order.
    Gap,
    /// The node reported more blocks than its capacity, or the index's total bound was hit.
    OverCapacity,
}

#[derive(Debug, Default)]
struct NodeView {
    epoch: u64,
    next_seq: u64,
    device_capacity: usize,
    host_capacity: usize,
    device: HashSet<BlockHash>,
    host: HashSet<BlockHash>,
    in_sync: bool,
}

impl NodeView {
    fn len(&self) -> usize {
        self.device.len() + self.host.len()
    }

    fn tier(&mut self, tier: Tier) -> (&mut HashSet<BlockHash>, usize) {
        match tier {
            Tier::Device => (&mut self.device, self.device_capacity),
            Tier::Host => (&mut self.host, self.host_capacity),
        }
    }

    fn drop_out(&mut self) {
        self.in_sync = false;
        self.device = HashSet::new();
        self.host = HashSet::new();
    }
}

/// The index over every node; `N` is the registry's node key.
#[derive(Debug)]
pub struct CacheIndex<N> {
    nodes: HashMap<N, NodeView>,
    /// Blocks held over all nodes.
    total: usize,
    max_blocks: usize,
}

impl<N: Copy + Eq + std::hash::Hash> CacheIndex<N> {
    /// An empty index keeping at most `max_blocks` block entries over all nodes.
    pub fn new(max_blocks: usize) -> Self {
        Self {
            nodes: HashMap::new(),
            total: 0,
            max_blocks,
        }
    }

    /// Block entries held over all nodes.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Whether `node`'s view follows its stream (else [`CacheIndex::lookup`] says `None`).
    pub fn in_sync(&self, node: N) -> bool {
        self.nodes.get(&node).is_some_and(|v| v.in_sync)
    }

    /// Replace `node`'s view with `snap`. Refused (and the node left out of sync) when the
    /// snapshot holds more than the node's stated capacity or would pass the index's bound.
    pub fn apply_snapshot(&mut self, node: N, snap: Snapshot) -> Result<(), OutOfSync> {
        let view = self.nodes.entry(node).or_default();
        self.total -= view.len();
        view.drop_out();
        view.epoch = snap.epoch;
        view.next_seq = snap.seq.wrapping_add(1);
        view.device_capacity = snap.device_capacity;
        view.host_capacity = snap.host_capacity;
        let device: HashSet<BlockHash> = snap.device.into_iter().collect();
        let host: HashSet<BlockHash> = snap.host.into_iter().collect();
        if device.len() > snap.device_capacity
            || host.len() > snap.host_capacity
            || self.total + device.len() + host.len() > self.max_blocks
        {
            return Err(OutOfSync::OverCapacity);
        }
        self.total += device.len() + host.len();
        view.device = device;
        view.host = host;
        view.in_sync = true;
        Ok(())
    }

    /// Apply a batch of changes. Events already in the snapshot (lower sequence numbers) are
    /// skipped; a gap, another epoch (epochs are random per node process, so another one is
    /// another process whatever its value) or a breach of capacity drops the node out of sync
    /// until its next snapshot.
    pub fn apply_events(&mut self, node: N, batch: EventBatch) -> Result<(), OutOfSync> {
        let Some(view) = self.nodes.get_mut(&node) else {
            return Err(OutOfSync::NoSnapshot);
        };
        if !view.in_sync || batch.epoch != view.epoch {
            self.total -= view.len();
            view.drop_out();
            return Err(OutOfSync::NoSnapshot);
        }
        for (i, event) in batch.events.into_iter().enumerate() {
            let seq = batch.first_seq.wrapping_add(i as u64);
            if seq < view.next_seq {
                continue;
            }
            if seq != view.next_seq {
                self.total -= view.len();
                view.drop_out();
                return Err(OutOfSync::Gap);
            }
            view.next_seq = seq.wrapping_add(1);
            match event {
                CacheEvent::Stored { tier, hashes } => {
                    let (set, capacity) = view.tier(tier);
                    for h in hashes {
                        if set.insert(h) {
                            self.total += 1;
                        }
                    }
                    if set.len() > capacity || self.total > self.max_blocks {
                        self.total -= view.len();
                        view.drop_out();
                        return Err(OutOfSync::OverCapacity);
                    }
                }
                CacheEvent::Removed { tier, hashes } => {
                    let (set, _) = view.tier(tier);
                    for h in hashes {
                        if set.remove(&h) {
                            self.total -= 1;
                        }
                    }
                }
                CacheEvent::Cleared => {
                    self.total -= view.len();
                    view.device.clear();
                    view.host.clear();
                }
            }
        }
        Ok(())
    }

    /// Forget `node` (it left the registry).
    pub fn remove(&mut self, node: N) {
        if let Some(view) = self.nodes.remove(&node) {
            self.total -= view.len();
        }
    }

    /// Mark `node` out of sync (its stream broke): lookups say `None` until a snapshot.
    pub fn lost_stream(&mut self, node: N) {
        if let Some(view) = self.nodes.get_mut(&node) {
            self.total -= view.len();
            view.drop_out();
        }
    }

    /// What `node`'s view holds, device blocks then host blocks (each in no particular
    /// order); `None` when it is not in sync. What checks of the index against a node's own
    /// snapshot read.
    pub fn view(&self, node: N) -> Option<(Vec<BlockHash>, Vec<BlockHash>)> {
        let v = self.nodes.get(&node).filter(|v| v.in_sync)?;
        Some((
            v.device.iter().copied().collect(),
            v.host.iter().copied().collect(),
        ))
    }

    /// The leading blocks of `hashes` (a prompt's block hashes with `node`'s block size) that
    /// `node` holds: its device run, then the blocks it would restore from its host tier.
    /// `None` while the node's view is out of sync.
    pub fn lookup(&self, node: N, hashes: &[BlockHash]) -> Option<TierMatch> {
        let view = self.nodes.get(&node).filter(|v| v.in_sync)?;
        let device = hashes
            .iter()
            .take_while(|h| view.device.contains(h))
            .count();
        let host = hashes[device..]
            .iter()
            .take_while(|h| view.host.contains(h) || view.device.contains(h))
            .count();
        Some(TierMatch { device, host })
    }
}

/// The router's one index over every node, keyed by the registry's node id, behind a lock
/// that is held for one synchronous step at a time (never across an await): routing never
/// waits on a node's stream.
#[derive(Debug)]
pub struct SharedIndex {
    inner: Mutex<CacheIndex<usize>>,
}

impl SharedIndex {
    /// An empty index of at most `max_blocks` block entries (`--cache-index-blocks`).
    pub fn new(max_blocks: usize) -> Self {
        Self {
            inner: Mutex::new(CacheIndex::new(max_blocks)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CacheIndex<usize>> {
        // Every method leaves the index consistent before it returns: a panic elsewhere
        // cannot leave it torn.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`CacheIndex::lookup`].
    pub fn lookup(&self, node: usize, hashes: &[BlockHash]) -> Option<TierMatch> {
        self.lock().lookup(node, hashes)
    }

    /// [`CacheIndex::view`].
    pub fn view(&self, node: usize) -> Option<(Vec<BlockHash>, Vec<BlockHash>)> {
        self.lock().view(node)
    }

    /// [`CacheIndex::in_sync`].
    pub fn in_sync(&self, node: usize) -> bool {
        self.lock().in_sync(node)
    }

    /// [`CacheIndex::total_blocks`].
    pub fn total_blocks(&self) -> usize {
        self.lock().total_blocks()
    }

    /// One change of the index under its lock.
    pub fn update<R>(&self, f: impl FnOnce(&mut CacheIndex<usize>) -> R) -> R {
        f(&mut self.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u128) -> BlockHash {
        BlockHash(i)
    }

    fn hs(r: std::ops::Range<u128>) -> Vec<BlockHash> {
        r.map(h).collect()
    }

    fn snapshot(epoch: u64, device: Vec<BlockHash>, host: Vec<BlockHash>) -> Snapshot {
        Snapshot {
            epoch,
            seq: 10,
            block_size: 16,
            device_capacity: 8,
            host_capacity: 8,
            device,
            host,
        }
    }

    fn batch(epoch: u64, first_seq: u64, events: Vec<CacheEvent>) -> EventBatch {
        EventBatch {
            epoch,
            first_seq,
            events,
        }
    }

    #[test]
    fn a_prompt_matches_the_device_run_then_the_host_tier() {
        let mut ix = CacheIndex::new(100);
        assert_eq!(ix.lookup(0u32, &hs(0..4)), None, "no snapshot yet");
        ix.apply_snapshot(0, snapshot(1, hs(0..2), hs(2..4)))
            .unwrap();
        let m = ix.lookup(0, &hs(0..6)).unwrap();
        assert_eq!(m, TierMatch { device: 2, host: 2 });
        assert_eq!(m.blocks(), 4);
        // A prompt diverging at block 1 matches one block.
        assert_eq!(
            ix.lookup(0, &[h(0), h(99), h(2)]).unwrap(),
            TierMatch { device: 1, host: 0 }
        );
        // Spilled: block 1 leaves the device for the host; the device run is one block.
        ix.apply_events(
            0,
            batch(
                1,
                11,
                vec![
                    CacheEvent::Removed {
                        tier: Tier::Device,
                        hashes: vec![h(1)],
                    },
                    CacheEvent::Stored {
                        tier: Tier::Host,
                        hashes: vec![h(1)],
                    },
                ],
            ),
        )
        .unwrap();
        assert_eq!(
            ix.lookup(0, &hs(0..6)).unwrap(),
            TierMatch { device: 1, host: 3 }
        );
        assert_eq!(ix.total_blocks(), 4);
    }

    #[test]
    fn predicted_tokens_are_whole_blocks_short_of_the_last_prompt_token() {
        let m = TierMatch { device: 2, host: 3 };
        // 100 tokens in blocks of 16: 6 usable blocks; all 5 matched count.
        assert_eq!(m.tokens(16, 100), (32, 48));
        // 65 tokens: 4 usable blocks (the 65th token is computed): device 2, host 2.
        assert_eq!(m.tokens(16, 65), (32, 32));
        // 64 tokens: 3 usable blocks (the last token of block 4 must be computed).
        assert_eq!(m.tokens(16, 64), (32, 16));
        // 17 tokens: one block, from the device.
        assert_eq!(m.tokens(16, 17), (16, 0));
        assert_eq!(m.tokens(16, 1), (0, 0));
        assert_eq!(TierMatch::default().tokens(16, 0), (0, 0));
    }

    #[test]
    fn replayed_events_are_skipped_and_a_gap_drops_the_node_until_its_next_snapshot() {
        let mut ix = CacheIndex::new(100);
        ix.apply_snapshot(7u32, snapshot(1, hs(0..2), vec![]))
            .unwrap();
        // Seq 10 is in the snapshot already: its removal must not apply.
        let stale = CacheEvent::Removed {
            tier: Tier::Device,
            hashes: vec![h(0)],
        };
        let fresh = CacheEvent::Stored {
            tier: Tier::Device,
            hashes: vec![h(2)],
        };
        ix.apply_events(7, batch(1, 10, vec![stale, fresh]))
            .unwrap();
        assert_eq!(ix.lookup(7, &hs(0..3)).unwrap().device, 3);
        // Seq 13 after 11: one change was lost.
        let lost = CacheEvent::Stored {
            tier: Tier::Device,
            hashes: vec![h(3)],
        };
        assert_eq!(
            ix.apply_events(7, batch(1, 13, vec![lost])),
            Err(OutOfSync::Gap)
        );
        assert_eq!(ix.lookup(7, &hs(0..3)), None);
        assert_eq!(ix.total_blocks(), 0);
        ix.apply_snapshot(7, snapshot(1, hs(0..4), vec![])).unwrap();
        assert_eq!(ix.lookup(7, &hs(0..5)).unwrap().device, 4);
    }

    #[test]
    fn a_batch_of_another_epoch_leaves_the_view_out_of_sync_until_a_new_snapshot() {
        let mut ix = CacheIndex::new(100);
        ix.apply_snapshot(1u32, snapshot(5, hs(0..3), vec![]))
            .unwrap();
        // Another process's events (a lower epoch as well as a higher one: epochs are
        // random): not mixed in, and the view is no longer trusted.
        for epoch in [4, 6] {
            let new = CacheEvent::Stored {
                tier: Tier::Device,
                hashes: vec![h(50)],
            };
            assert_eq!(
                ix.apply_events(1, batch(epoch, 1, vec![new])),
                Err(OutOfSync::NoSnapshot)
            );
            assert_eq!(ix.lookup(1, &hs(0..3)), None);
            assert_eq!(ix.total_blocks(), 0);
            ix.apply_snapshot(1, snapshot(5, hs(0..3), vec![])).unwrap();
        }
        ix.apply_snapshot(1, snapshot(6, vec![], vec![])).unwrap();
        assert_eq!(ix.lookup(1, &hs(0..3)).unwrap(), TierMatch::default());
    }

    #[test]
    fn memory_stays_within_each_nodes_capacity_and_the_total_bound() {
        let mut ix = CacheIndex::new(10);
        let too_many = snapshot(1, hs(0..9), vec![]);
        assert_eq!(
            ix.apply_snapshot(1u32, too_many),
            Err(OutOfSync::OverCapacity)
        );
        assert_eq!(ix.total_blocks(), 0);
        ix.apply_snapshot(1, snapshot(1, hs(0..6), vec![])).unwrap();
        // A second node would pass the index's bound of 10 entries.
        assert_eq!(
            ix.apply_snapshot(2, snapshot(1, hs(100..106), vec![])),
            Err(OutOfSync::OverCapacity)
        );
        assert!(ix.in_sync(1) && !ix.in_sync(2));
        // Growing node 1 past its device capacity of 8 drops it.
        let grow = CacheEvent::Stored {
            tier: Tier::Device,
            hashes: hs(6..9),
        };
        assert_eq!(
            ix.apply_events(1, batch(1, 11, vec![grow])),
            Err(OutOfSync::OverCapacity)
        );
        assert_eq!(ix.total_blocks(), 0);
        ix.apply_snapshot(2, snapshot(1, hs(100..106), vec![]))
            .unwrap();
        ix.remove(2);
        assert_eq!(ix.total_blocks(), 0);
    }
}
