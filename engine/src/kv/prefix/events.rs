//! The prefix cache's changes as others see them: which block hashes entered and left each
//! tier, in order. A node publishes them (a [`Snapshot`], then [`EventBatch`]es) so that the
//! router's index of every node's cache follows the node exactly.
//!
//! Only the vocabulary lives here: the engine produces the events where blocks enter and
//! leave its tiers, the nodes serve them, the router applies them.

use super::hash::BlockHash;

/// Where a cached block lives on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// In the KV blocks the model reads: a hit costs nothing.
    Device,
    /// In the node's host-memory tier: a hit costs a copy back to the device.
    Host,
}

/// One change of a node's cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks that entered `tier` (computed and registered, spilled to the host tier,
    /// restored from it, or received from a peer).
    Stored { tier: Tier, hashes: Vec<BlockHash> },
    /// Blocks that left `tier` (evicted from the device, dropped from the host).
    Removed { tier: Tier, hashes: Vec<BlockHash> },
    /// Everything in every tier left (the cache was reset).
    Cleared,
}

/// A node's whole cache at one point of its event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Changes when the node's process restarts: events of another epoch are stale.
    pub epoch: u64,
    /// The sequence number of the last change the snapshot includes (the next is `seq + 1`).
    pub seq: u64,
    /// The node's KV block size (the hashes depend on it).
    pub block_size: usize,
    /// The most blocks the node can hold in each tier.
    pub device_capacity: usize,
    pub host_capacity: usize,
    pub device: Vec<BlockHash>,
    pub host: Vec<BlockHash>,
}

/// Changes following a snapshot: `events[i]` has sequence number `first_seq + i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    pub epoch: u64,
    pub first_seq: u64,
    pub events: Vec<CacheEvent>,
}
