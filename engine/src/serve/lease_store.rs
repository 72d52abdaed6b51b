//! Copies of leased KV, readable without the engine thread.
//!
//! A prefill lease's blocks are copied out of KV storage when the lease is made (on the
//! engine thread, where the storage lives) and served from here to decode nodes by the
//! export side of the transport. Reading through the engine thread instead would wait for
//! the step in progress — seconds for a long prefill chunk — and the pull would miss its
//! deadline. The copy lives exactly as long as the lease: removed at release or expiry, so
//! a late reader finds nothing, as with the lease itself. It does not replace the lease's
//! hold on the engine's blocks (the prefix cache keeps those). Each block's transfer
//! checksum ([`crate::kv::checksum`]) is computed here, once, when the lease is made: the
//! exporter sends it, and no transport hashes on the sending side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::kv::checksum::block_checksum;

/// One lease's KV as it is exported.
#[derive(Debug, Clone, PartialEq)]
pub struct LeasedKv {
    /// Each block in `Backend::read_block`'s layout.
    pub blocks: Vec<Vec<f32>>,
    /// `checksums[i]` = [`block_checksum`]`(i, blocks[i])`.
    pub checksums: Vec<u64>,
}

impl LeasedKv {
    /// `blocks` with their checksums, hashed on the rayon pool (this runs on the engine
    /// thread when a prefill ends: a 4,096-token Qwen3-0.6B lease is 940 MB, ~60 ms for one
    /// core at ~15 GB/s).
    pub fn new(blocks: Vec<Vec<f32>>) -> Self {
        let checksums = blocks
            .par_iter()
            .enumerate()
            .map(|(i, b)| block_checksum(i as u64, bytemuck::cast_slice(b)))
            .collect();
        Self { blocks, checksums }
    }
}

/// Leased blocks by lease id. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct LeaseStore {
    leases: Arc<Mutex<HashMap<u64, Arc<LeasedKv>>>>,
}

impl LeaseStore {
    /// Keep `blocks` under `lease_id`, checksummed (outside the lock).
    pub fn insert(&self, lease_id: u64, blocks: Vec<Vec<f32>>) {
        let kv = Arc::new(LeasedKv::new(blocks));
        if let Ok(mut leases) = self.leases.lock() {
            leases.insert(lease_id, kv);
        }
    }

    pub fn remove(&self, lease_id: u64) {
        if let Ok(mut leases) = self.leases.lock() {
            leases.remove(&lease_id);
        }
    }

    /// All of a lease's blocks, shared (not copied); `None` if the lease is gone. The blocks
    /// stay readable through the returned `Arc` even if the lease is released meanwhile.
    pub fn get(&self, lease_id: u64) -> Option<Arc<LeasedKv>> {
        self.leases.lock().ok()?.get(&lease_id).cloned()
    }

    /// Copies of blocks `first .. first + count` of a lease; `None` if the lease is gone or
    /// shorter.
    pub fn read(&self, lease_id: u64, first: usize, count: usize) -> Option<Vec<Vec<f32>>> {
        // Clone the Arc under the lock, copy the blocks outside it.
        let kv = self.leases.lock().ok()?.get(&lease_id).cloned()?;
        Some(kv.blocks.get(first..first.checked_add(count)?)?.to_vec())
    }

    pub fn len(&self) -> usize {
        self.leases.lock().map(|l| l.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ranges_until_removed() {
        let store = LeaseStore::default();
        store.insert(7, vec![vec![1.0], vec![2.0], vec![3.0]]);
        assert_eq!(store.read(7, 1, 2), Some(vec![vec![2.0], vec![3.0]]));
        assert_eq!(store.read(7, 2, 2), None, "past the end");
        assert_eq!(store.read(7, usize::MAX, 2), None, "overflow");
        assert_eq!(store.read(8, 0, 1), None, "unknown lease");
        let shared = store.get(7).expect("leased");
        assert_eq!(shared.blocks.len(), 3);
        let want: Vec<u64> = (0..3u64)
            .map(|i| block_checksum(i, bytemuck::cast_slice(&[(i + 1) as f32])))
            .collect();
        assert_eq!(shared.checksums, want, "block i's checksum, seeded by i");
        store.remove(7);
        assert_eq!(store.read(7, 0, 1), None, "released");
        assert!(store.get(7).is_none(), "released");
        assert_eq!(
            shared.blocks[2],
            vec![3.0],
            "a reader's shared copy outlives the release"
        );
        assert!(store.is_empty());
    }
}
