//! The changes one cache tier records for the engine to publish: which block hashes entered
//! and left it, in order ([`CacheEvent`]s). The tier (the device pool, the host tier) records
//! where its set of hashes changes; the engine drains the journal once per step and hands the
//! changes to its subscribers.
//!
//! Recording costs nothing while nobody subscribes: a disabled journal ignores every change
//! and holds no memory. Consecutive changes of the same kind are merged into one event.
//!
//! Not here: sequence numbers, epochs and subscribers (`crate::serve::cache_feed`).

use super::events::{CacheEvent, Tier};
use super::hash::BlockHash;

/// One tier's pending changes (see the module doc).
#[derive(Debug, Clone)]
pub struct CacheJournal {
    tier: Tier,
    enabled: bool,
    events: Vec<CacheEvent>,
}

impl CacheJournal {
    /// A disabled journal of `tier`.
    pub fn new(tier: Tier) -> Self {
        Self {
            tier,
            enabled: false,
            events: Vec::new(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Start or stop recording. Stopping drops what was not drained: without subscribers
    /// nobody needs it, and the next subscriber starts from a snapshot.
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
        if !enabled {
            self.events = Vec::new();
        }
    }

    /// `hash` entered the tier.
    pub fn stored(&mut self, hash: BlockHash) {
        if !self.enabled {
            return;
        }
        if let Some(CacheEvent::Stored { hashes, .. }) = self.events.last_mut() {
            hashes.push(hash);
        } else {
            self.events.push(CacheEvent::Stored {
                tier: self.tier,
                hashes: vec![hash],
            });
        }
    }

    /// `hash` left the tier.
    pub fn removed(&mut self, hash: BlockHash) {
        if !self.enabled {
            return;
        }
        if let Some(CacheEvent::Removed { hashes, .. }) = self.events.last_mut() {
            hashes.push(hash);
        } else {
            self.events.push(CacheEvent::Removed {
                tier: self.tier,
                hashes: vec![hash],
            });
        }
    }

    /// Move the pending changes, oldest first, to the end of `out`.
    pub fn drain_into(&mut self, out: &mut Vec<CacheEvent>) {
        out.append(&mut self.events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_runs_of_one_kind_and_ignores_changes_while_disabled() {
        let mut j = CacheJournal::new(Tier::Host);
        j.stored(BlockHash(1));
        let mut out = Vec::new();
        j.drain_into(&mut out);
        assert!(out.is_empty(), "a disabled journal records nothing");

        j.set_enabled(true);
        j.stored(BlockHash(1));
        j.stored(BlockHash(2));
        j.removed(BlockHash(1));
        j.stored(BlockHash(3));
        j.drain_into(&mut out);
        let h = |v: &[u128]| v.iter().map(|&x| BlockHash(x)).collect::<Vec<_>>();
        assert_eq!(
            out,
            vec![
                CacheEvent::Stored {
                    tier: Tier::Host,
                    hashes: h(&[1, 2])
                },
                CacheEvent::Removed {
                    tier: Tier::Host,
                    hashes: h(&[1])
                },
                CacheEvent::Stored {
                    tier: Tier::Host,
                    hashes: h(&[3])
                },
            ]
        );
        out.clear();
        j.drain_into(&mut out);
        assert!(out.is_empty(), "drained once");

        j.stored(BlockHash(4));
        j.set_enabled(false);
        j.set_enabled(true);
        j.drain_into(&mut out);
        assert!(out.is_empty(), "disabling drops what was pending");
    }
}
