//! Prefill leases: the prompt's KV blocks kept for a decode node after a prefill request
//! ends, lent to the exporter through the [`LeaseStore`] (held in place on host memory,
//! copied from a GPU), released by the decode node or expired after `lease_timeout` (a
//! released lease's blocks return to the pool once no transfer reads them); and the buffers
//! imported KV arrives in (the other end of a transfer).

use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::kv::handoff::block_buffers::BlockBuffers;
use crate::kv::handoff::lease_secret::{LeaseSecret, random_lease_id};
use crate::kv::handoff::lease_store::{LeaseStore, LeasedKv};
use crate::kv::handoff::placement::HostKvMemory;
use crate::serve::request::KvLease;

use super::Engine;
use super::seq::Seq;

pub(super) struct Lease {
    pub(super) id: u64,
    /// Only a release presenting it frees the lease early.
    pub(super) secret: LeaseSecret,
    pub(super) blocks: Vec<u32>,
    pub(super) deadline: Instant,
    /// What the exporter reads; the blocks are freed once nobody else holds it.
    pub(super) kv: Arc<LeasedKv>,
}

impl<B: Backend> Engine<B> {
    /// Release a prefill lease; false if it does not exist (released or expired) or
    /// `secret` is not its secret (then nothing is released: the two answers are alike).
    pub fn release_lease(&mut self, lease_id: u64, secret: &LeaseSecret) -> bool {
        let sealed = self.handoff.leases.get(&lease_id).map(|l| l.secret);
        if !sealed.is_some_and(|s| s.matches(secret)) {
            return false;
        }
        self.drop_lease(lease_id)
    }

    /// Release a lease whatever presented it (expiry); false if it does not exist.
    fn drop_lease(&mut self, lease_id: u64) -> bool {
        self.handoff.lease_store.remove(lease_id);
        match self.handoff.leases.remove(&lease_id) {
            Some(lease) => {
                // A transfer may still be reading the blocks in place: they go back to the
                // pool once it dropped the lease (`reap_released_leases`).
                self.handoff.released_leases.push(lease);
                self.reap_released_leases();
                true
            }
            None => false,
        }
    }

    /// Free the blocks of released leases that no reader holds any more.
    pub(super) fn reap_released_leases(&mut self) {
        let mut i = 0;
        while i < self.handoff.released_leases.len() {
            if Arc::strong_count(&self.handoff.released_leases[i].kv) == 1 {
                let lease = self.handoff.released_leases.swap_remove(i);
                self.free_blocks(&lease.blocks);
            } else {
                i += 1;
            }
        }
    }

    /// Release every lease past its deadline (and free released leases' blocks that no
    /// reader holds any more).
    pub fn expire_leases(&mut self, now: Instant) {
        self.reap_released_leases();
        let expired: Vec<u64> = self
            .handoff
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.drop_lease(id);
            self.handoff.expired_leases += 1;
        }
    }

    /// Copy blocks `first .. first + count` of a lease out of KV storage (the export side of
    /// a KV transfer). `None` if the lease does not exist, is shorter or `secret` is wrong.
    pub fn read_lease(
        &self,
        lease_id: u64,
        secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<Vec<Vec<u8>>> {
        self.handoff
            .lease_store
            .read(lease_id, secret, first, count)
    }

    /// The buffers imported KV arrives in: the importer takes them, this engine gives them
    /// back after copying their blocks into KV storage.
    pub fn import_buffers(&self) -> BlockBuffers {
        self.handoff.import_buffers.clone()
    }

    /// Where KV storage lies in host memory (`None` on a GPU): imports can land in place.
    pub fn host_kv_memory(&self) -> Option<HostKvMemory> {
        self.handoff.host_kv.clone()
    }

    /// Leased blocks, shared with whoever exports them (see [`LeaseStore`]).
    pub fn lease_store(&self) -> LeaseStore {
        self.handoff.lease_store.clone()
    }

    pub fn num_leases(&self) -> usize {
        self.handoff.leases.len()
    }

    /// Keep a finished prefill request's prompt blocks under a new lease (lent to the
    /// exporter through the lease store) and free the rest of `blocks`.
    pub(super) fn lease_prompt_blocks(
        &mut self,
        seq: &Seq,
        blocks: &[u32],
        now: Instant,
    ) -> KvLease {
        // Random, never counting up: one lease's id says nothing about another's.
        let lease_id = random_lease_id(|id| self.handoff.lease_id_taken(id));
        let secret = LeaseSecret::random();
        // The lease covers the prompt's KV (the first token's KV is not computed yet).
        let prompt_blocks = seq.prompt_len.div_ceil(self.block_size());
        let (keep, rest) = blocks.split_at(prompt_blocks.min(blocks.len()));
        self.free_blocks(rest);
        let kv = match self.handoff.host_kv.clone() {
            // Host memory: the lease holds the blocks in place, nothing is copied.
            // SAFETY: the engine writes no block a lease holds, and frees them only once the
            // lease is released and no reader shares it (`reap_released_leases`).
            Some(memory) => unsafe { LeasedKv::in_place(memory, keep.to_vec()) },
            // Device memory: one copy of the whole lease (the backend moves it in batches,
            // not block by block) into memory the backend lends (page-locked on a GPU).
            None => {
                let block_bytes = self.executor.block_bytes();
                let mut bytes = self.executor.host_buffer(keep.len() * block_bytes);
                self.executor.read_blocks(keep, bytes.as_bytes_mut());
                LeasedKv::copied(bytes, block_bytes)
            }
        };
        let kv = self.handoff.lease_store.insert(lease_id, secret, kv);
        self.handoff.leases.insert(
            lease_id,
            Lease {
                id: lease_id,
                secret,
                blocks: keep.to_vec(),
                deadline: now + self.config.lease_timeout,
                kv,
            },
        );
        let full = seq.prompt_len / self.block_size();
        KvLease {
            lease_id,
            secret,
            blocks: keep.to_vec(),
            block_hashes: seq.hasher.hashes()[..full].to_vec(),
            num_tokens: seq.prompt_len,
        }
    }
}
