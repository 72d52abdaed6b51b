//! Reservations for imports (decode role): the blocks a pull will fill are taken from the
//! pool before the pull starts, together with a reference on each block of this node's
//! cached prefix, so that admission finds everything where the puller left it (in place in
//! host KV memory, or copied into device KV storage by the puller). A reservation ends by admission (the sequence takes its blocks) or by
//! release (the pull failed, the request ended first): never both, never neither.

use crate::backend::Backend;
use crate::kv::handoff::placement::KvReservation;
use crate::kv::handoff::reservation::{
    DeviceReservation, ImportReservation, ReleaseFn, ReservationId,
};
use crate::kv::prefix::hash::block_hashes_with;

use super::Engine;

/// What a reservation holds in the pool.
#[derive(Debug)]
pub(super) struct Reserved {
    /// The cached prefix's blocks, one reference each.
    pub(super) cached: Vec<u32>,
    /// Fresh blocks the pull fills, in logical order after the prefix.
    pub(super) fresh: Vec<u32>,
}

impl<B: Backend> Engine<B> {
    /// Reserve the blocks of `tokens`' KV that this node does not cache (with `salt`), for
    /// a pull to fill; `release` is called with the id if the reservation is dropped
    /// unadmitted. `None`: the backend can neither land KV in place nor write it from
    /// another thread, or the pool has no room now (the caller pulls into buffers instead).
    pub fn reserve_import(
        &mut self,
        tokens: &[u32],
        salt: Option<&str>,
        release: ReleaseFn,
    ) -> Option<ImportReservation> {
        if !self.can_reserve() || tokens.is_empty() {
            return None;
        }
        let bs = self.block_size();
        let total = tokens.len().div_ceil(bs);
        let hashes = if self.config.enable_prefix_caching {
            block_hashes_with(tokens, bs, salt, self.config.hash_algo)
        } else {
            Vec::new()
        };
        // Never the block holding the last token (a prefill node computes it).
        let usable = ((tokens.len() - 1) / bs).min(hashes.len());
        let local = self.pool.cached_prefix(&hashes[..usable]);
        let cached = self
            .pool
            .acquire_cached(&hashes[..local])
            .expect("pool invariant: cached_prefix blocks can be acquired");
        // A reservation holds its blocks for the whole pull. Taking the last free ones would
        // make running sequences preempt (and recompute) to grow, so leave headroom: a block
        // for each running sequence and 1 % of the pool. Without it the pull lands in
        // buffers and admission waits for room, as it always did.
        let headroom = self.running.len() + self.num_blocks().div_ceil(100);
        let fresh = (self.pool.num_free() >= total - local + headroom)
            .then(|| self.allocate(total - local))
            .flatten();
        let Some(fresh) = fresh else {
            self.free_blocks(&cached);
            return None;
        };
        let id = self.handoff.next_reservation_id();
        let reservation = match (&self.handoff.host_kv, &self.handoff.block_writer) {
            (Some(memory), _) => ImportReservation::Host(KvReservation::new(
                id,
                local,
                &fresh,
                memory.clone(),
                release,
            )),
            (None, Some(writer)) => ImportReservation::Device(DeviceReservation::new(
                id,
                local,
                fresh.clone(),
                self.executor.block_bytes(),
                writer(),
                release,
            )),
            (None, None) => unreachable!("can_reserve checked"),
        };
        self.handoff
            .reservations
            .insert(id, Reserved { cached, fresh });
        Some(reservation)
    }

    /// Whether [`Self::reserve_import`] can reserve at all: KV storage in host memory
    /// (pulls land in place) or a backend that writes blocks from other threads.
    pub fn can_reserve(&self) -> bool {
        self.handoff.can_reserve()
    }

    /// Give back a reservation's blocks; false if it is not held (admitted or released).
    pub fn release_reservation(&mut self, id: ReservationId) -> bool {
        match self.handoff.reservations.remove(&id) {
            Some(r) => {
                self.free_blocks(&[r.cached, r.fresh].concat());
                true
            }
            None => false,
        }
    }

    /// Reservations held (a node with none outstanding after its requests ended leaks
    /// nothing).
    pub fn reservations_held(&self) -> usize {
        self.handoff.reservations.len()
    }
}
