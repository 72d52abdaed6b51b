//! Leased KV, readable without the engine thread.
//!
//! A prefill lease's blocks are served from here to decode nodes by the export side of the
//! transport; reading through the engine thread instead would wait for the step in
//! progress (seconds for a long prefill chunk) and the pull would miss its deadline. Where
//! KV storage is host memory (the CPU backend) the lease **holds its blocks in place**:
//! nothing is copied, the engine writes no leased block, and it frees a released lease's
//! blocks only once every reader has dropped the lease (a transfer in progress finishes its
//! batch). Elsewhere (a GPU) the blocks are **copied** out of KV storage when the lease is
//! made. An entry lives exactly as long as the lease: removed at release or expiry, so a late
//! reader finds nothing. Every read presents the lease's secret ([`LeaseSecret`]): a wrong
//! secret finds nothing, exactly as an unknown id does. Each block's transfer checksum
//! ([`super::checksum`]) is computed here, once, when the lease is made: the exporter sends
//! it, and no transport hashes on the sending side. Not here: what is leased and when a lease
//! ends (the engine), nor serving it over the wire (pd-transport's export side).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::kv::handoff::checksum::{BlockChecksummer, block_checksum};
use crate::kv::handoff::host_buffer::HostBuffer;
use crate::kv::handoff::lease_secret::LeaseSecret;
use crate::kv::handoff::placement::HostKvMemory;

/// Compared against when the id is unknown, so that an unknown id and a wrong secret take
/// the same steps.
const NO_SECRET: LeaseSecret = LeaseSecret::from_bytes([0; 16]);

/// Where a lease's blocks are.
#[derive(Debug)]
enum LeaseData {
    /// A copy of the blocks, one after another, each `block_bytes` long in
    /// `Backend::read_block`'s layout.
    Copied {
        bytes: HostBuffer,
        block_bytes: usize,
    },
    /// The blocks where they lie in host KV memory, in lease order. "In place", not
    /// "pinned": pinned memory means page-locked memory in this project (`pd-kernels`).
    InPlace {
        memory: HostKvMemory,
        blocks: Vec<u32>,
    },
}

/// One lease's KV as it is exported.
#[derive(Debug)]
pub struct LeasedKv {
    data: LeaseData,
    /// `checksums[i]` = [`block_checksum`]`(i, block i's bytes)`.
    pub checksums: Vec<u64>,
}

impl LeasedKv {
    /// Copied blocks, `bytes` holding them one after another (`block_bytes` each, as
    /// `Backend::read_blocks` writes them), with their checksums, hashed on the rayon pool
    /// (this runs on the engine thread when a prefill ends: a 4,096-token Qwen3-0.6B lease
    /// is 940 MB, ~60 ms for one core at ~15 GB/s).
    pub fn copied(bytes: HostBuffer, block_bytes: usize) -> Self {
        let data = bytes.as_bytes();
        assert!(
            data.is_empty() || (block_bytes > 0 && data.len().is_multiple_of(block_bytes)),
            "whole blocks"
        );
        let checksums = if data.is_empty() {
            Vec::new()
        } else {
            data.par_chunks_exact(block_bytes)
                .enumerate()
                .map(|(i, b)| block_checksum(i as u64, b))
                .collect()
        };
        Self {
            data: LeaseData::Copied { bytes, block_bytes },
            checksums,
        }
    }

    /// Copied blocks given one buffer each (all of one length).
    pub fn new(blocks: Vec<Vec<u8>>) -> Self {
        let block_bytes = blocks.first().map_or(0, Vec::len);
        assert!(
            blocks.iter().all(|b| b.len() == block_bytes),
            "blocks of one length"
        );
        Self::copied(Box::new(blocks.concat()), block_bytes)
    }

    /// Physical `blocks` of `memory` held in place where they lie, with their checksums (hashed on
    /// the rayon pool).
    ///
    /// # Safety
    /// Nobody may write the blocks while this value lives, nor free them while it is shared:
    /// readers (the exporters) read them without a lock (see the module documentation).
    pub unsafe fn in_place(memory: HostKvMemory, blocks: Vec<u32>) -> Self {
        let checksums = blocks
            .par_iter()
            .enumerate()
            .map(|(i, &b)| {
                let mut h = BlockChecksummer::new(i as u64);
                // SAFETY: a leased block, unwritten while the lease exists (module docs).
                for piece in unsafe { memory.block_slices(b) } {
                    h.update(piece);
                }
                h.digest()
            })
            .collect();
        Self {
            data: LeaseData::InPlace { memory, blocks },
            checksums,
        }
    }

    /// The host KV memory the blocks lie in and where each lies in it (lease order),
    /// or `None` for copied blocks: for transports that read them where they lie.
    pub fn in_place_blocks(&self) -> Option<(&HostKvMemory, &[u32])> {
        match &self.data {
            LeaseData::Copied { .. } => None,
            LeaseData::InPlace { memory, blocks } => Some((memory, blocks)),
        }
    }

    /// A copied lease's blocks, one after another in one buffer (`block_bytes` each), or
    /// `None` for blocks held in place: for transports that register the copy as it is.
    pub fn copied_bytes(&self) -> Option<&[u8]> {
        match &self.data {
            LeaseData::Copied { bytes, .. } => Some(bytes.as_bytes()),
            LeaseData::InPlace { .. } => None,
        }
    }

    pub fn num_blocks(&self) -> usize {
        match &self.data {
            LeaseData::Copied { bytes, block_bytes } => bytes
                .as_bytes()
                .len()
                .checked_div(*block_bytes)
                .unwrap_or(0),
            LeaseData::InPlace { blocks, .. } => blocks.len(),
        }
    }

    /// Bytes of each block (0 for an empty lease).
    pub fn block_bytes(&self) -> usize {
        match &self.data {
            LeaseData::Copied { block_bytes, .. } => *block_bytes,
            LeaseData::InPlace { memory, .. } => memory.block_bytes(),
        }
    }

    /// Block `i`'s bytes in transfer layout, in one piece (a copy) or several (in place: one
    /// per layer's K and V), in order.
    pub fn block_pieces(&self, i: usize) -> Vec<&[u8]> {
        match &self.data {
            LeaseData::Copied { bytes, block_bytes } => {
                vec![&bytes.as_bytes()[i * block_bytes..(i + 1) * block_bytes]]
            }
            // SAFETY: a leased block, unwritten while this value lives (module docs).
            LeaseData::InPlace { memory, blocks } => unsafe { memory.block_slices(blocks[i]) },
        }
    }

    /// Copy block `i` in transfer layout into `dst` (`block_bytes` long).
    pub fn copy_block(&self, i: usize, dst: &mut [u8]) {
        assert_eq!(dst.len(), self.block_bytes(), "block length");
        let mut at = 0;
        for piece in self.block_pieces(i) {
            dst[at..at + piece.len()].copy_from_slice(piece);
            at += piece.len();
        }
    }

    /// Block `i`'s bytes, copied.
    pub fn block_data(&self, i: usize) -> Vec<u8> {
        let mut out = vec![0; self.block_bytes()];
        self.copy_block(i, &mut out);
        out
    }
}

/// A lease's secret and its blocks.
type Sealed = (LeaseSecret, Arc<LeasedKv>);

/// Leased blocks by lease id, each sealed by its secret. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct LeaseStore {
    leases: Arc<Mutex<HashMap<u64, Sealed>>>,
}

impl LeaseStore {
    /// Keep `kv` under `lease_id`, readable only with `secret`; the returned handle lets the
    /// engine see when no reader holds the lease any more ([`Arc::strong_count`]).
    pub fn insert(&self, lease_id: u64, secret: LeaseSecret, kv: LeasedKv) -> Arc<LeasedKv> {
        let kv = Arc::new(kv);
        if let Ok(mut leases) = self.leases.lock() {
            leases.insert(lease_id, (secret, Arc::clone(&kv)));
        }
        kv
    }

    pub fn remove(&self, lease_id: u64) {
        if let Ok(mut leases) = self.leases.lock() {
            leases.remove(&lease_id);
        }
    }

    /// All of a lease's blocks, shared (not copied); `None` if the lease is gone or `secret`
    /// is not its secret (the two are indistinguishable). The blocks stay readable through
    /// the returned `Arc` even if the lease is released meanwhile.
    pub fn get(&self, lease_id: u64, secret: &LeaseSecret) -> Option<Arc<LeasedKv>> {
        let leases = self.leases.lock().ok()?;
        match leases.get(&lease_id) {
            Some((sealed, kv)) => sealed.matches(secret).then(|| Arc::clone(kv)),
            None => {
                // The same comparison as for a known id, so both refusals take alike.
                let _ = NO_SECRET.matches(secret);
                None
            }
        }
    }

    /// Copies of blocks `first .. first + count` of a lease; `None` if the lease is gone,
    /// shorter, or `secret` is wrong.
    pub fn read(
        &self,
        lease_id: u64,
        secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<Vec<Vec<u8>>> {
        // Clone the Arc under the lock, copy the blocks outside it.
        let kv = self.get(lease_id, secret)?;
        let end = first.checked_add(count).filter(|&e| e <= kv.num_blocks())?;
        Some((first..end).map(|i| kv.block_data(i)).collect())
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
        let key = LeaseSecret::random();
        let wrong = LeaseSecret::random();
        store.insert(
            7,
            key,
            LeasedKv::new(vec![vec![1, 1], vec![2, 2], vec![3, 3]]),
        );
        assert_eq!(
            store.read(7, &key, 1, 2),
            Some(vec![vec![2, 2], vec![3, 3]])
        );
        assert_eq!(store.read(7, &key, 2, 2), None, "past the end");
        assert_eq!(store.read(7, &key, usize::MAX, 2), None, "overflow");
        assert_eq!(store.read(8, &key, 0, 1), None, "unknown lease");
        assert_eq!(store.read(7, &wrong, 0, 1), None, "wrong secret");
        assert!(store.get(7, &wrong).is_none(), "wrong secret");
        let shared = store.get(7, &key).expect("leased");
        assert_eq!(shared.num_blocks(), 3);
        assert_eq!(
            shared.copied_bytes(),
            Some(&[1, 1, 2, 2, 3, 3][..]),
            "a copied lease is one buffer, block after block (what RDMA registers as it is)"
        );
        let want: Vec<u64> = (0..3u64)
            .map(|i| block_checksum(i, &[(i + 1) as u8; 2]))
            .collect();
        assert_eq!(shared.checksums, want, "block i's checksum, seeded by i");
        store.remove(7);
        assert_eq!(store.read(7, &key, 0, 1), None, "released");
        assert!(store.get(7, &key).is_none(), "released");
        assert_eq!(
            shared.block_data(2),
            vec![3, 3],
            "a reader's shared copy outlives the release"
        );
        assert!(store.is_empty());
    }
}
