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
//! ([`pd_engine::kv::hash`]), so one prompt hashed once per block size is compared as is.
//!
//! Not here: subscribing to the nodes' streams (the registry's job), the routing decision
//! (the policy's).

use std::collections::{HashMap, HashSet};

use pd_engine::kv::hash::BlockHash;

/// Where a cached block lives on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// In the KV blocks the model reads: a hit costs nothing.
    Device,
    /// In the node's host-memory tier: a hit costs a copy back to the device.
    Host,
}

/// One change a node reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks that entered `tier` (computed and registered, spilled to the host tier,
    /// restored from it, or received from a peer).
    Stored { tier: Tier, hashes: Vec<BlockHash> },
    /// Blocks that left `tier` (evicted, spilled out of the device, dropped from the host).
    Removed { tier: Tier, hashes: Vec<BlockHash> },
    /// Everything in every tier left (the cache was reset).
    Cleared,
}

/// A node's whole cache at one point of its event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Changes when the node's process restarts: events of another epoch are stale.
    pub epoch: u64,
    /// The sequence number of the last change the snapshot includes.
    pub seq: u64,
    /// The most blocks the node can hold in each tier (bounds what the index keeps for it).
    pub device_capacity: usize,
    pub host_capacity: usize,
    pub device: Vec<BlockHash>,
    pub host: Vec<BlockHash>,
}

/// A batch of changes following a snapshot: `first_seq` is the sequence number of the
/// first event, the rest follow one by one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    pub epoch: u64,
    pub first_seq: u64,
    pub events: Vec<CacheEvent>,
}

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

    /// Apply a batch of changes. Events of an older epoch are ignored; events already in the
    /// snapshot (lower sequence numbers) are skipped; a gap, another epoch without a
    /// snapshot, or a breach of capacity drops the node out of sync until its next snapshot.
    pub fn apply_events(&mut self, node: N, batch: EventBatch) -> Result<(), OutOfSync> {
        let Some(view) = self.nodes.get_mut(&node) else {
            return Err(OutOfSync::NoSnapshot);
        };
        if batch.epoch < view.epoch {
            return Ok(());
        }
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
    fn a_restarted_node_is_stale_until_its_new_snapshot_and_old_epochs_are_ignored() {
        let mut ix = CacheIndex::new(100);
        ix.apply_snapshot(1u32, snapshot(5, hs(0..3), vec![]))
            .unwrap();
        // A late batch of the previous process changes nothing.
        let old = CacheEvent::Cleared;
        ix.apply_events(1, batch(4, 1, vec![old])).unwrap();
        assert_eq!(ix.lookup(1, &hs(0..3)).unwrap().device, 3);
        // The new process's events before its snapshot: out of sync, not mixed in.
        let new = CacheEvent::Stored {
            tier: Tier::Device,
            hashes: vec![h(50)],
        };
        assert_eq!(
            ix.apply_events(1, batch(6, 1, vec![new])),
            Err(OutOfSync::NoSnapshot)
        );
        assert_eq!(ix.lookup(1, &hs(0..3)), None);
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
