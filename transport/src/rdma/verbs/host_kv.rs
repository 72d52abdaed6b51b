//! A decode node's host KV memory registered once, at start, for local write: every region
//! of the engine's [`HostKvMemory`] becomes a memory region, so a READ can scatter straight
//! into the blocks the engine reserved for a pull. (A prefill node registers no KV memory
//! whole: it registers each lease's blocks alone, `super::export`.)
//!
//! This owns the registrations and the lookup of a segment's keys; it does not post READs
//! ([`super::read`]), make offers ([`super::export`]) nor decide where blocks lie (the
//! engine's placement).

use std::sync::Arc;

use pd_engine::kv::handoff::placement::{HostKvMemory, KvReservation};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;

use super::device::RdmaDevice;
use crate::rdma::RdmaError;
use crate::rdma::scatter::{LocalRegion, LocalSpan, RegionTable, ScatterError};

/// The node's KV memory, registered.
pub(super) struct HostKvRegistration {
    table: RegionTable,
    // Field order matters: the regions are deregistered before `memory`'s keep-alive may
    // free the memory.
    _mrs: Vec<Arc<MemoryRegion>>,
    memory: HostKvMemory,
}

impl HostKvRegistration {
    /// Register every region of `memory`. Blocking: registration pins and maps every page
    /// (for gigabytes of KV, a noticeable part of a second).
    pub(super) fn register(device: &RdmaDevice, memory: HostKvMemory) -> Result<Self, RdmaError> {
        // Local write only: no peer may read or write this memory.
        let flags = AccessFlags::LocalWrite;
        let mut mrs = Vec::with_capacity(memory.regions().len());
        let mut regions = Vec::with_capacity(memory.regions().len());
        for segment in memory.regions() {
            // SAFETY: the region is KV memory that `memory`'s keep-alive holds allocated and in
            // place; `memory` is kept in this struct and dropped after the memory regions
            // (field order), so the memory outlives its registration.
            let mr = unsafe { device.register(segment.addr() as *const u8, segment.len(), flags)? };
            regions.push(LocalRegion {
                addr: segment.addr(),
                len: segment.len() as u64,
                lkey: mr.lkey(),
            });
            mrs.push(mr);
        }
        Ok(Self {
            table: RegionTable::new(regions),
            _mrs: mrs,
            memory,
        })
    }

    /// Memory regions registered.
    pub(super) fn regions(&self) -> usize {
        self.table.regions().len()
    }

    /// Bytes registered.
    pub(super) fn bytes(&self) -> u64 {
        self.table.bytes()
    }

    /// Whether `memory` is the memory registered here (the same regions at the same
    /// addresses): only then can a reservation of it be read into in place.
    pub(super) fn covers(&self, memory: &HostKvMemory) -> bool {
        self.memory.regions() == memory.regions()
    }

    /// The reservation's blocks as the transfer's stream of registered spans: block after
    /// block, each block's segments in transfer-layout order.
    pub(super) fn spans(&self, into: &KvReservation) -> Result<Vec<LocalSpan>, ScatterError> {
        let mut spans = Vec::new();
        for i in 0..into.len() {
            for s in into.block_segments(i) {
                spans.push(self.table.span(s.addr(), s.len() as u64)?);
            }
        }
        Ok(spans)
    }
}
