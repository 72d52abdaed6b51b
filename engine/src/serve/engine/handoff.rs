//! The KV handoff state of one engine, owned in one place: prefill leases (live, and
//! released ones a transfer may still read), the lease store the exporter reads, the
//! reservations of pulls in progress, the buffers imports arrive in, and where imported KV
//! can land (host KV memory in place, or a device block writer).
//!
//! Only the state and its construction live here. The rules that move blocks between the
//! handoff and the pool are in `leases` (export side), `reserve` and `import` (import side),
//! since each also touches the pool and the sequences, which the engine owns.

use std::collections::HashMap;

use crate::backend::Backend;
use crate::executor::Executor;
use crate::kv::handoff::block_buffers::{BlockBuffers, DEFAULT_SPARE_BYTES};
use crate::kv::handoff::lease_store::LeaseStore;
use crate::kv::handoff::placement::{HostKvMemory, ReservationId};
use crate::kv::handoff::reservation::BlockWriter;
use crate::serve::config::Role;

use super::leases::Lease;
use super::reserve::Reserved;

/// Leases, reservations and import buffers of one engine (see the module doc).
pub(super) struct KvHandoff {
    pub(super) leases: HashMap<u64, Lease>,
    /// Released leases whose blocks a transfer may still be reading in place.
    pub(super) released_leases: Vec<Lease>,
    /// Leases expired since the engine started (a counter).
    pub(super) expired_leases: u64,
    /// Copies of the leased blocks, for the export side (read without the engine thread).
    pub(super) lease_store: LeaseStore,
    /// Blocks set aside for imports being pulled.
    pub(super) reservations: HashMap<ReservationId, Reserved>,
    next_reservation: u64,
    /// Host buffers of imported blocks, given back once copied into KV storage.
    pub(super) import_buffers: BlockBuffers,
    /// Where KV storage lies in host memory (`None` on a GPU): imports can land in place.
    pub(super) host_kv: Option<HostKvMemory>,
    /// How a puller writes imported blocks into device KV storage from its own thread
    /// (`None` where KV is host memory, or the backend cannot).
    pub(super) block_writer: Option<BlockWriter>,
}

impl KvHandoff {
    pub(super) fn new<B: Backend>(executor: &Executor<B>, role: Role) -> Self {
        let host_kv = executor.host_kv_memory();
        // A prefill engine never imports KV; the writer holds device memory and a stream.
        let block_writer = (role != Role::Prefill && host_kv.is_none())
            .then(|| executor.block_writer())
            .flatten();
        let import_buffers = BlockBuffers::with_allocator(
            executor.block_bytes(),
            DEFAULT_SPARE_BYTES,
            executor.host_allocator(),
        );
        Self {
            leases: HashMap::new(),
            released_leases: Vec::new(),
            expired_leases: 0,
            lease_store: LeaseStore::default(),
            reservations: HashMap::new(),
            next_reservation: 1,
            import_buffers,
            host_kv,
            block_writer,
        }
    }

    /// Whether imports can be reserved at all: KV storage in host memory (pulls land in
    /// place) or a backend that writes blocks from other threads.
    pub(super) fn can_reserve(&self) -> bool {
        self.host_kv.is_some() || self.block_writer.is_some()
    }

    /// A reservation id never used before by this engine.
    pub(super) fn next_reservation_id(&mut self) -> ReservationId {
        let id = ReservationId(self.next_reservation);
        self.next_reservation += 1;
        id
    }

    /// Whether `id` names a lease, live or released (lease ids are never reused while a
    /// reader may still hold the old one).
    pub(super) fn lease_id_taken(&self, id: u64) -> bool {
        self.leases.contains_key(&id) || self.released_leases.iter().any(|l| l.id == id)
    }
}
