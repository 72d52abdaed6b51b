//! Tiers of the prefix cache outside the device: the host tier ([`super::host_tier::HostTier`],
//! an LRU pool in host memory that evicted device blocks spill to), the one [`ExternalTier`]
//! today; the scheduler sees a tier only through that trait. Restoring from it counts as an
//! *external* hit (docs/accounting.md), as KV received from a prefill node does.
//!
//! A block's data is the content of one KV block in the transfer layout
//! ([`crate::backend::Backend::read_block`]: `block_bytes` bytes, each value as the KV cache
//! stores it); the tier does not interpret it.
//! Content is addressed by [`BlockHash`], so it is immutable: a hash always names the same
//! data, and offering a hash a tier already holds changes nothing but its recency.
//! Not here: the device tier ([`super::device`], kept by the block pool) and the accounting
//! of hits (`crate::serve`).

use std::fmt;

use super::hash::BlockHash;

/// Which tier: also the value of the metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierKind {
    Host,
    Peer,
}

impl TierKind {
    /// Every tier, in a fixed order: the index of each in [`crate::serve::PerTier`]. A new
    /// tier (a disk tier) is one variant and its entry here; every `match` on the kind then
    /// shows where its names (metrics, wire) are missing.
    pub const ALL: [TierKind; 2] = [TierKind::Host, TierKind::Peer];
    pub const COUNT: usize = Self::ALL.len();

    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Host => "host",
            TierKind::Peer => "peer",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// The block is not (or no longer) there, e.g. evicted since the lookup. The caller
    /// computes the block instead.
    #[error("{tier} tier: block {hash} is not there (evicted since the lookup?)")]
    Miss { tier: TierKind, hash: BlockHash },
    /// The destination is not exactly one block long: a bug in the caller.
    #[error("{tier} tier: destination holds {got} bytes, a block is {expected}")]
    LengthMismatch {
        tier: TierKind,
        expected: usize,
        got: usize,
    },
    /// The tier could not be reached or failed (a peer that went away, a transfer error).
    /// The caller computes the block instead.
    #[error("{tier} tier: {message}")]
    Unavailable { tier: TierKind, message: String },
}

/// A store of KV blocks addressed by [`BlockHash`], outside the device.
pub trait ExternalTier: Send {
    /// Which tier this is (for metrics and logs).
    fn kind(&self) -> TierKind;

    /// Bytes in one block; `fetch` and `offer` take exactly this many.
    fn block_bytes(&self) -> usize;

    /// How many leading `hashes` the tier can provide now. No side effects (the LRU order is
    /// not touched). It is a hint: a `fetch` afterwards may still miss, since the tier may
    /// evict blocks in between (another offer, another node).
    fn lookup(&self, hashes: &[BlockHash]) -> usize;

    /// Copy the block of `hash` into `dst` (`block_bytes()` bytes). On success `dst` holds
    /// exactly what was offered under `hash`; the block stays in the tier (and counts as
    /// recently used). On error `dst` may be partly written and must be recomputed:
    /// [`TierError::Miss`] if the block is gone, [`TierError::Unavailable`] if the tier
    /// failed, [`TierError::LengthMismatch`] if `dst` has the wrong length.
    fn fetch(&mut self, hash: BlockHash, dst: &mut [u8]) -> Result<(), TierError>;

    /// Give the tier a copy of the block of `hash` (`block_bytes()` bytes), e.g. a device
    /// block about to be evicted. Best effort: the tier may store it (evicting others), keep
    /// an existing copy (marking it recently used), or drop it (disabled or full). Never
    /// fails; `data` of the wrong length is a caller bug and is ignored (debug builds panic).
    fn offer(&mut self, hash: BlockHash, data: &[u8]);
}
