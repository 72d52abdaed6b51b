//! The prefill node's side: lease blocks in registered memory, and queue pairs that let
//! decode nodes READ them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;

use super::device::RdmaDevice;
use super::qp::Connection;
use pd_engine::serve::LeasedKv;

use crate::rdma::{QpEndpoint, RdmaError, RdmaOffer, RemoteRegion};

/// Queue pairs kept for decode nodes; the oldest is closed past this (a decode node that
/// restarted connects again and its old queue pair is useless).
const MAX_PEERS: usize = 256;

/// One lease's blocks, packed, registered for remote read.
struct Published {
    /// Dropped (deregistered: the rkey is revoked) before the buffer is freed.
    _mr: Arc<MemoryRegion>,
    _buf: Box<[f32]>,
    deadline: Instant,
}

/// Registers leases' blocks and accepts decode nodes' queue pairs.
pub struct RdmaExporter {
    device: RdmaDevice,
    connect_addr: String,
    leases: Mutex<HashMap<u64, Published>>,
    /// Dropped before the device (field order is irrelevant: each holds the device's Arcs).
    peers: Mutex<VecDeque<Connection>>,
}

impl std::fmt::Debug for RdmaExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaExporter")
            .field("device", &self.device)
            .field("connect_addr", &self.connect_addr)
            .field("published", &self.published())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RdmaExporter {
    /// An exporter on `device` whose offers name `connect_addr` (this node's gRPC
    /// `host:port`) for `RdmaConnect`.
    pub fn new(device: &RdmaDevice, connect_addr: String) -> Result<Self, RdmaError> {
        tracing::info!(
            device = %device.describe(),
            %connect_addr,
            "RDMA export: lease blocks are staged in registered host memory (GPUDirect RDMA \
             is not used: the engine does not expose its KV storage for registration)"
        );
        Ok(Self {
            device: device.clone(),
            connect_addr,
            leases: Mutex::default(),
            peers: Mutex::default(),
        })
    }

    /// Register lease `lease_id`'s blocks until `deadline` or [`RdmaExporter::retire`]; the
    /// encoded [`RdmaOffer`] for the `KvHandle`, with the checksums the lease store computed.
    pub fn publish(
        &self,
        lease_id: u64,
        kv: &LeasedKv,
        deadline: Instant,
    ) -> Result<Vec<u8>, RdmaError> {
        self.retire_expired(Instant::now());
        let block_bytes = kv.block_bytes();
        if block_bytes == 0 || !block_bytes.is_multiple_of(4) {
            return Err(RdmaError::BlockSize {
                theirs: 0,
                ours: block_bytes as u64,
            });
        }
        // The staging copy: the lease's blocks back to back (from wherever they lie).
        let mut buf: Box<[f32]> = vec![0f32; kv.num_blocks() * block_bytes / 4].into_boxed_slice();
        for (i, block) in bytemuck::cast_slice_mut::<f32, u8>(&mut buf)
            .chunks_exact_mut(block_bytes)
            .enumerate()
        {
            kv.copy_block(i, block);
        }
        let bytes: &[u8] = bytemuck::cast_slice(&buf);
        let checksums = kv.checksums.clone();
        let len = bytes.len();
        // SAFETY: the boxed slice's heap memory does not move and is freed only after the
        // region (field order of `Published`).
        let mr = unsafe {
            self.device.register(
                buf.as_mut_ptr().cast::<u8>(),
                len,
                AccessFlags::LocalWrite | AccessFlags::RemoteRead,
            )?
        };
        let offer = RdmaOffer {
            fabric: self.device.fabric(),
            connect_addr: self.connect_addr.clone(),
            block_bytes: block_bytes as u64,
            regions: vec![RemoteRegion {
                addr: buf.as_ptr() as u64,
                len: len as u64,
                rkey: mr.rkey(),
            }],
            checksums,
        };
        lock(&self.leases).insert(
            lease_id,
            Published {
                _mr: mr,
                _buf: buf,
                deadline,
            },
        );
        Ok(offer.encode())
    }

    /// Deregister a lease's blocks (released). Whether it was registered.
    pub fn retire(&self, lease_id: u64) -> bool {
        lock(&self.leases).remove(&lease_id).is_some()
    }

    /// Deregister every lease past its deadline; how many.
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
