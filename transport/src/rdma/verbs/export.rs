//! The prefill node's side: lease blocks in registered memory, and queue pairs that let
//! decode nodes READ them.
//!
//! - **In place** where the engine's KV is host memory (the CPU backend): a lease pinned in it
//!   is offered where it lies (a strided offer). Publishing registers the lease's blocks
//!   alone, one memory region per KV segment and run of adjacent blocks
//!   ([`LeaseRegions`]), copies nothing, and the exporter keeps the lease (so its blocks)
//!   and the regions until release or expiry; retiring deregisters them, which revokes
//!   their rkeys. No rkey of an offer reaches memory outside its lease's blocks. A lease
//!   too scattered for one offer, or whose registration fails, is staged.
//! - **Staged** otherwise (GPU KV, a failed registration): the lease's blocks back to back in
//!   a buffer registered for that lease alone (a packed offer): a GPU node's lease is such a
//!   buffer already (the engine copied it out of device memory) and is registered as it is;
//!   blocks pinned in KV memory that could not be registered are copied into one.
//!   Deregistering it at release or expiry revokes its rkey.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use pd_engine::kv::handoff::placement::HostKvMemory;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;

use super::device::RdmaDevice;
use super::qp::Connection;
use pd_engine::serve::LeasedKv;

use crate::rdma::{
    ExportMode, LeaseRegions, OfferLayout, QpEndpoint, RdmaError, RdmaOffer, RemoteRegion,
};

/// Queue pairs kept for decode nodes; the oldest is closed past this (a decode node that
/// restarted connects again and its old queue pair is useless).
const MAX_PEERS: usize = 256;

/// What keeps a published lease's bytes readable.
enum Held {
    /// A staged copy, registered for this lease alone.
    Staged {
        /// Dropped (deregistered: the rkey is revoked) before the buffer is freed.
        _mr: Arc<MemoryRegion>,
        _buf: Box<[u8]>,
    },
    /// A lease that is a copy already (GPU KV), its buffer registered for this lease alone.
    Copy {
        /// Dropped (deregistered: the rkey is revoked) before the lease may be freed.
        _mr: Arc<MemoryRegion>,
        _lease: Arc<LeasedKv>,
    },
    /// The lease itself: its blocks stay where they are, unwritten and not freed, while held
    /// here, registered for this lease alone.
    InPlace {
        /// Dropped (deregistered: the rkeys are revoked) before the lease may be freed.
        _mrs: Vec<Arc<MemoryRegion>>,
        _lease: Arc<LeasedKv>,
    },
}

/// One published lease.
struct Published {
    _held: Held,
    deadline: Instant,
}

/// Registers leases' blocks and accepts decode nodes' queue pairs.
pub struct RdmaExporter {
    device: RdmaDevice,
    connect_addr: String,
    /// Whether the engine's KV is host memory: leases pinned in it are offered in place,
    /// each registered alone when published.
    host_kv: bool,
    leases: Mutex<HashMap<u64, Published>>,
    /// Dropped before the device (field order is irrelevant: each holds the device's Arcs).
    peers: Mutex<VecDeque<Connection>>,
}

impl std::fmt::Debug for RdmaExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaExporter")
            .field("device", &self.device)
            .field("connect_addr", &self.connect_addr)
            .field("in_place", &self.in_place())
            .field("published", &self.published())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RdmaExporter {
    /// An exporter on `device` whose offers name `connect_addr` (this node's gRPC
    /// `host:port`) for `RdmaConnect`; it stages every lease until
    /// [`RdmaExporter::with_host_kv`] registers the node's KV memory.
    pub fn new(device: &RdmaDevice, connect_addr: String) -> Result<Self, RdmaError> {
        Ok(Self {
            device: device.clone(),
            connect_addr,
            host_kv: false,
            leases: Mutex::default(),
            peers: Mutex::default(),
        })
    }

    /// Offer leases pinned in the node's host KV memory (the engine's; `None` where KV lives
    /// on a GPU) in place, each lease's blocks registered alone when it is published, and
    /// log once which way leases are exported. Nothing is registered here: no rkey ever
    /// covers the KV memory as a whole.
    pub fn with_host_kv(mut self, memory: Option<HostKvMemory>) -> Self {
        let device = self.device.describe();
        if memory.is_none() {
            tracing::info!(
                %device,
                "RDMA export: lease blocks are staged in registered host memory (KV memory is \
                 not host memory; GPUDirect RDMA registration is not implemented)"
            );
            return self;
        }
        tracing::info!(
            %device,
            "RDMA export in place: decode nodes READ leased blocks where the engine keeps \
             them, each lease's blocks registered for remote read alone while it lives"
        );
        self.host_kv = true;
        self
    }

    /// Whether leases pinned in the node's KV memory are offered in place.
    pub fn in_place(&self) -> bool {
        self.host_kv
    }

    /// Register lease `lease_id`'s blocks until `deadline` or [`RdmaExporter::retire`] (in
    /// place, or a staged copy); the encoded [`RdmaOffer`] for the `KvHandle`, with the
    /// checksums the lease store computed, and which way it was exported.
    pub fn publish(
        &self,
        lease_id: u64,
        kv: &Arc<LeasedKv>,
        deadline: Instant,
    ) -> Result<(Vec<u8>, ExportMode), RdmaError> {
        self.retire_expired(Instant::now());
        if let Some((offer, mrs)) = self.offer_in_place(kv) {
            lock(&self.leases).insert(
                lease_id,
                Published {
                    _held: Held::InPlace {
                        _mrs: mrs,
                        _lease: Arc::clone(kv),
                    },
                    deadline,
                },
            );
            return Ok((offer.encode(), ExportMode::InPlace));
        }
        let offer = self.publish_staged(lease_id, kv, deadline)?;
        Ok((offer, ExportMode::Staged))
    }

    /// A strided offer of `kv`'s blocks where they lie, its ranges registered for this lease
    /// alone; `None` (staged then) when the lease is not pinned in host KV memory, is too
    /// scattered for one offer, or a registration fails.
    fn offer_in_place(&self, kv: &LeasedKv) -> Option<(RdmaOffer, Vec<Arc<MemoryRegion>>)> {
        if !self.host_kv {
            return None;
        }
        let regions = LeaseRegions::of(kv)?;
        let mut mrs = Vec::with_capacity(regions.ranges.len());
        for &(addr, len) in &regions.ranges {
            let len = usize::try_from(len).ok()?;
            // SAFETY: the range is pieces of the lease's blocks in the engine's KV memory
            // (`LeaseRegions::of` computed it from the lease's own memory and places); the
            // lease, held with the regions in `Held::InPlace` and dropped after them (field
            // order), keeps those blocks allocated, in place and unwritten.
            match unsafe {
                self.device
                    .register(addr as *const u8, len, AccessFlags::RemoteRead)
            } {
                Ok(mr) => mrs.push(mr),
                Err(e) => {
                    tracing::warn!(error = %e, "registering a lease's blocks in place failed; staging it");
                    return None;
                }
            }
        }
        let rkeys: Vec<u32> = mrs.iter().map(|mr| mr.rkey()).collect();
        let offer = regions.offer(self.device.fabric(), self.connect_addr.clone(), kv, &rkeys)?;
        Some((offer, mrs))
    }

    /// `kv`'s blocks back to back in a buffer registered for this lease: the lease's own
    /// buffer where it is a copy already (a GPU node's), else a copy made here.
    fn publish_staged(
        &self,
        lease_id: u64,
        kv: &Arc<LeasedKv>,
        deadline: Instant,
    ) -> Result<Vec<u8>, RdmaError> {
        let block_bytes = kv.block_bytes();
        if block_bytes == 0 {
            return Err(RdmaError::BlockSize {
                theirs: 0,
                ours: block_bytes as u64,
            });
        }
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteRead;
        let (addr, len, mr, held) = match kv.copied_bytes() {
            // No second copy of what the engine already copied out of device memory.
            Some(bytes) => {
                // SAFETY: the lease's buffer is never written, moved or freed while the lease
                // lives, and `Held::Copy` keeps the lease until after the region (field
                // order); nothing posts a local write into it.
                let mr = unsafe { self.device.register(bytes.as_ptr(), bytes.len(), access)? };
                let held = Held::Copy {
                    _mr: mr.clone(),
                    _lease: Arc::clone(kv),
                };
                (bytes.as_ptr() as u64, bytes.len(), mr, held)
            }
            None => {
                // The staging copy: the lease's blocks back to back (from wherever they lie).
                let mut buf: Box<[u8]> =
                    vec![0u8; kv.num_blocks() * block_bytes].into_boxed_slice();
                for (i, block) in buf.chunks_exact_mut(block_bytes).enumerate() {
                    kv.copy_block(i, block);
                }
                // SAFETY: the boxed slice's heap memory does not move and is freed only after
                // the region (field order of `Held::Staged`).
                let mr = unsafe { self.device.register(buf.as_mut_ptr(), buf.len(), access)? };
                let (addr, len) = (buf.as_ptr() as u64, buf.len());
                let held = Held::Staged {
                    _mr: mr.clone(),
                    _buf: buf,
                };
                (addr, len, mr, held)
            }
        };
        let offer = RdmaOffer {
            fabric: self.device.fabric(),
            connect_addr: self.connect_addr.clone(),
            block_bytes: block_bytes as u64,
            regions: vec![RemoteRegion {
                addr,
                len: len as u64,
                rkey: mr.rkey(),
            }],
            layout: OfferLayout::Packed,
            checksums: kv.checksums.clone(),
        };
        lock(&self.leases).insert(
            lease_id,
            Published {
                _held: held,
                deadline,
            },
        );
        Ok(offer.encode())
    }

    /// Stop offering a lease's blocks (released): a staged copy is deregistered, a lease
    /// offered in place is let go (its blocks return to the engine once no other reader
    /// holds it). Whether it was published.
    pub fn retire(&self, lease_id: u64) -> bool {
        lock(&self.leases).remove(&lease_id).is_some()
    }

    /// [`RdmaExporter::retire`] every lease past its deadline; how many.
    pub fn retire_expired(&self, now: Instant) -> usize {
        let mut leases = lock(&self.leases);
        let before = leases.len();
        leases.retain(|_, p| p.deadline > now);
        before - leases.len()
    }

    /// Leases registered now.
    pub fn published(&self) -> usize {
        lock(&self.leases).len()
    }

    /// A decode node's queue pair endpoint (encoded): connect a queue pair of ours to it and
    /// answer with its endpoint (encoded).
    pub fn accept(&self, endpoint: &[u8]) -> Result<Vec<u8>, RdmaError> {
        let remote = QpEndpoint::decode(endpoint)?;
        // The target side posts nothing: a small send queue of single entries suffices.
        let mut conn = Connection::create(&self.device, 16, 1, true)?;
        conn.connect(&self.device, &remote)?;
        let answer = conn.local.encode();
        tracing::info!(
            peer = %remote.fabric,
            peer_qpn = remote.qpn,
            qpn = conn.local.qpn,
            "RDMA queue pair connected for a decode node"
        );
        let mut peers = lock(&self.peers);
        if peers.len() >= MAX_PEERS {
            peers.pop_front();
        }
        peers.push_back(conn);
        Ok(answer)
    }
}
