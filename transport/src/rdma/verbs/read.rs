//! The decode node's side: connect to a prefill node once, then READ offered blocks, with a
//! bounded window of READs in flight ([`super::transfer`]), either in place into the KV
//! blocks the engine reserved (the node's host KV memory, registered once:
//! [`super::host_kv`]) or into a registered landing buffer kept for later transfers
//! ([`super::landing`]) whose blocks are then copied out.
//!
//! This owns the reader's connections, the choice between the two landings and the
//! checksum verification; not the posting loop, the registrations or the plans.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::host_buffer::{HostBuffer, heap_buffer};
use pd_engine::kv::handoff::placement::{HostKvMemory, KvReservation};

use super::device::RdmaDevice;
use super::host_kv::HostKvRegistration;
use super::landing::{Landing, LandingPool};
use super::qp::Connection;
use super::transfer::{StopSignal, stop_pair, transfer};
use crate::importer::OneSidedReader;
use crate::rdma::scatter::{LocalSpan, ScatterError, ScatterRead, scatter_reads};
use crate::rdma::{
    BoxFuture, Fabric, QpEndpoint, RdmaConfig, RdmaConnector, RdmaError, RdmaOffer, ReadOp,
    block_checksum, plan_reads,
};
use crate::{LayoutFingerprint, PullRequest};

/// One prefill node's connection; `None` until connected, and again after an error.
type PeerSlot = Arc<tokio::sync::Mutex<Option<Connection>>>;

/// Reads offered leases over RC queue pairs, one per prefill node.
pub struct RdmaReader {
    device: RdmaDevice,
    connector: Arc<dyn RdmaConnector>,
    fingerprint: LayoutFingerprint,
    max_op_bytes: u32,
    max_in_flight: usize,
    peers: Mutex<HashMap<String, PeerSlot>>,
    next_tag: AtomicU32,
    landings: Arc<LandingPool>,
    /// The node's KV memory, registered: reads into reservations of it land in place.
    host_kv: Option<HostKvRegistration>,
}

impl std::fmt::Debug for RdmaReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReader")
            .field("device", &self.device)
            .field("in_place", &self.host_kv.is_some())
            .finish_non_exhaustive()
    }
}

impl RdmaReader {
    /// A reader whose READs land in registered landing buffers (see
    /// [`RdmaReader::with_host_kv`] for in place).
    pub fn new(
        device: &RdmaDevice,
        connector: Arc<dyn RdmaConnector>,
        fingerprint: LayoutFingerprint,
        config: &RdmaConfig,
    ) -> Result<Self, RdmaError> {
        Ok(Self {
            device: device.clone(),
            connector,
            fingerprint,
            max_op_bytes: config.max_op_bytes.max(1),
            max_in_flight: config.max_in_flight.max(1),
            peers: Mutex::default(),
            next_tag: AtomicU32::new(1),
            landings: Arc::new(LandingPool::new(device)),
            host_kv: None,
        })
    }

    /// Register the node's host KV memory (the engine's; `None` where KV lives on a GPU) so
    /// that reads into reservations of it land in place, and log once which way reads land.
    /// A registration that fails is logged and leaves the landing buffers. Blocking: the
    /// registration pins every page of the KV memory.
    /// Whether reads into reservations of the node's KV memory land in place (its
    /// registration succeeded).
    pub fn lands_in_place(&self) -> bool {
        self.host_kv.is_some()
    }

    pub fn with_host_kv(mut self, memory: Option<HostKvMemory>) -> Self {
        let Some(memory) = memory else {
            tracing::info!(
                "RDMA reads land through registered landing buffers, then are copied into KV \
                 memory (KV memory is not host memory; GPUDirect RDMA registration is not \
                 implemented)"
            );
            return self;
        };
        match HostKvRegistration::register(&self.device, memory) {
            Ok(registration) => {
                tracing::info!(
                    "RDMA reads land in place in KV memory: {} regions, {} MiB registered",
                    registration.regions(),
                    registration.bytes() >> 20
                );
                self.host_kv = Some(registration);
            }
            Err(e) => tracing::warn!(
                error = %e,
                "cannot register KV memory for RDMA; reads land through registered landing \
                 buffers, then are copied into KV memory"
            ),
        }
        self
    }

    fn slot(&self, addr: &str) -> PeerSlot {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(peers.entry(addr.to_string()).or_default())
    }

    /// A connected queue pair to the exporter at `addr` (the endpoint exchange over gRPC),
    /// presenting the lease `req` reads (the exporter connects only a lease's holder).
    async fn connect(
        &self,
        addr: &str,
        req: &PullRequest,
        deadline: Instant,
    ) -> Result<Connection, RdmaError> {
        let depth = u32::try_from(self.max_in_flight).unwrap_or(u32::MAX);
        let mut conn = Connection::create(&self.device, depth, self.device.read_sge(), false)?;
        let exchange = self.connector.connect(
            addr.to_string(),
            self.fingerprint,
            conn.local.encode(),
            (req.lease_id, req.lease_secret),
        );
        let answer = tokio::time::timeout_at(deadline.into(), exchange)
            .await
            .map_err(|_| RdmaError::Deadline { done: 0, total: 0 })?
            .map_err(|message| RdmaError::Connect {
                addr: addr.to_string(),
                message,
            })?;
        let remote = QpEndpoint::decode(&answer)?;
        conn.connect(&self.device, &remote)?;
        tracing::info!(
            peer = %addr,
            qpn = conn.local.qpn,
            peer_qpn = remote.qpn,
            "RDMA queue pair connected to a prefill node"
        );
        Ok(conn)
    }

    /// The READs of `req`'s blocks of `offer`, planned (checked against this node's block
    /// size and the offer's blocks).
    fn plan(&self, offer: &RdmaOffer, req: &PullRequest) -> Result<Vec<ReadOp>, RdmaError> {
        let block_bytes = req.block_bytes as u64;
        if offer.block_bytes != block_bytes {
            return Err(RdmaError::BlockSize {
                theirs: offer.block_bytes,
                ours: block_bytes,
            });
        }
        Ok(plan_reads(
            offer,
            req.first_block as u64,
            req.count as u64,
            self.max_op_bytes,
        )?)
    }

    /// Landing-buffer path: READ into a registered buffer, copy the blocks out, verify them.
    async fn read_blocks(
        &self,
        offer: &RdmaOffer,
        req: PullRequest,
        buffers: Option<&BlockBuffers>,
        deadline: Instant,
    ) -> Result<Vec<HostBuffer>, RdmaError> {
        let ops = self.plan(offer, &req)?;
        let slot = self.slot(&offer.connect_addr);
        // One transfer at a time per queue pair: its window bounds the READs in flight.
        let mut guard = slot.lock().await;
        let conn = match guard.take() {
            Some(c) => c,
            None => self.connect(&offer.connect_addr, &req, deadline).await?,
        };
        let landings = Arc::clone(&self.landings);
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let (max_in_flight, max_sge, max_op) = (
            self.max_in_flight,
            self.device.read_sge() as usize,
            self.max_op_bytes,
        );
        let len = req.count * req.block_bytes;
        let buffers = buffers
            .filter(|b| b.block_bytes() == req.block_bytes)
            .cloned();
        let into = buffers.clone();
        let (conn, landed) = tokio::task::spawn_blocking(move || {
            let landing = match landings.take(len) {
                Ok(l) => l,
                Err(e) => return (Some(conn), Err(e)),
            };
            let reads = match into_landing(&ops, &landing, len, max_sge, max_op) {
                Ok(r) => r,
                Err(e) => {
                    landings.give(landing);
                    return (Some(conn), Err(e.into()));
                }
            };
            // The closure owns the landing buffer: nobody else can be written into, so the
            // transfer is never asked to stop early.
            let (conn, result) = transfer(
                conn,
                &reads,
                tag,
                max_in_flight,
                deadline,
                &StopSignal::never(),
            );
            // No READ targets the buffer any more (done, or the queue pair is destroyed).
            match result {
                Ok(()) => {
                    let blocks = copy_out(landing.bytes(len), req.block_bytes, into.as_ref());
                    landings.give(landing);
                    (conn, Ok(blocks))
                }
                Err(e) => (conn, Err(e)),
            }
        })
        .await
        .map_err(completion_thread)?;
        // A queue pair that saw an error is in the error state: drop it, reconnect next time.
        *guard = conn;
        drop(guard);
        let blocks = landed?;
        for (i, block) in blocks.iter().enumerate() {
            let index = (req.first_block + i) as u64;
            let sum = block_checksum(index, block.as_bytes());
            if offer.checksums.get(index as usize) != Some(&sum) {
                if let Some(b) = buffers {
                    b.give_all(blocks);
                }
                return Err(RdmaError::Checksum { block: index });
            }
        }
        Ok(blocks)
    }

    /// In-place path: READ straight into `into`'s blocks (memory `registration` covers),
    /// then verify each block where it landed.
    async fn read_in_place(
        &self,
        registration: &HostKvRegistration,
        offer: &RdmaOffer,
        req: PullRequest,
        into: &mut KvReservation,
        deadline: Instant,
    ) -> Result<(), RdmaError> {
        let ops = self.plan(offer, &req)?;
        let spans = registration.spans(into)?;
        let reads = scatter_reads(
            &ops,
            &spans,
            self.device.read_sge() as usize,
            self.max_op_bytes,
        )?;
        let slot = self.slot(&offer.connect_addr);
        // One transfer at a time per queue pair: its window bounds the READs in flight.
        let mut guard = slot.lock().await;
        let conn = match guard.take() {
            Some(c) => c,
            None => self.connect(&offer.connect_addr, &req, deadline).await?,
        };
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let max_in_flight = self.max_in_flight;
        // The READs land in memory this future only borrows (`into`): if the future is
        // dropped mid-transfer, `_stop` makes the transfer destroy its queue pair and waits
        // for that before the borrow (and so the reservation) can end.
        let (_stop, signal) = stop_pair();
        let (conn, result) = tokio::task::spawn_blocking(move || {
            // `signal` is dropped when this closure returns: after the queue pair is
            // destroyed (a failure) or every READ completed.
            transfer(conn, &reads, tag, max_in_flight, deadline, &signal)
        })
        .await
        .map_err(completion_thread)?;
        // A queue pair that saw an error is in the error state: drop it, reconnect next time.
        *guard = conn;
        drop(guard);
        result?;
        for i in 0..into.len() {
            let index = (req.first_block + i) as u64;
            let sum = into.block_checksum(i, index);
            if offer.checksums.get(index as usize) != Some(&sum) {
                return Err(RdmaError::Checksum { block: index });
            }
        }
        Ok(())
    }
}

fn completion_thread(e: tokio::task::JoinError) -> RdmaError {
    RdmaError::Verbs {
        op: "the completion thread",
        message: e.to_string(),
    }
}

/// `ops` landing at their offsets of the first `bytes` bytes of `landing` (registered):
/// a packed plan's ops one entry each, a strided plan's pieces joined where they continue
/// each other on the exporter.
fn into_landing(
    ops: &[ReadOp],
    landing: &Landing,
    bytes: usize,
    max_sge: usize,
    max_op: u32,
) -> Result<Vec<ScatterRead>, ScatterError> {
    let span = LocalSpan {
        addr: landing.base(),
        len: bytes.min(landing.capacity()) as u64,
        lkey: landing.lkey(),
    };
    scatter_reads(ops, &[span], max_sge, max_op)
}

/// The landed bytes as blocks of `block_bytes`, each copied into a buffer from `buffers`
/// (the engine's: page-locked on a GPU node, whose copy into the device reads them at the
/// link's speed) or a new heap buffer.
fn copy_out(landed: &[u8], block_bytes: usize, buffers: Option<&BlockBuffers>) -> Vec<HostBuffer> {
    landed
        .chunks_exact(block_bytes.max(1))
        .map(|block| {
            let mut buf = buffers.map_or_else(|| heap_buffer(block.len()), BlockBuffers::take);
            buf.as_bytes_mut().copy_from_slice(block);
            buf
        })
        .collect()
}

impl OneSidedReader for RdmaReader {
    fn fabric(&self) -> Fabric {
        self.device.fabric()
    }

    fn read<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        buffers: Option<&'a BlockBuffers>,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<HostBuffer>, RdmaError>> {
        Box::pin(self.read_blocks(offer, req, buffers, deadline))
    }

    /// In place when `into` is memory this reader registered; otherwise (no registration,
    /// or another engine's memory) through a landing buffer and a copy.
    fn read_into<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        into: &'a mut KvReservation,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<(), RdmaError>> {
        Box::pin(async move {
            match &self.host_kv {
                Some(reg) if reg.covers(into.memory()) => {
                    self.read_in_place(reg, offer, req, into, deadline).await
                }
                _ => {
                    into.write_blocks(&self.read_blocks(offer, req, None, deadline).await?);
                    Ok(())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn landed_blocks_are_copied_into_the_engines_buffers_when_given() {
        let landed: Vec<u8> = (0..12u8).collect();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let buffers = BlockBuffers::with_allocator(
            4,
            1 << 20,
            Arc::new(move |len| {
                counted.fetch_add(1, Ordering::Relaxed);
                heap_buffer(len)
            }),
        );
        let blocks = copy_out(&landed, 4, Some(&buffers));
        let bytes: Vec<&[u8]> = blocks.iter().map(|b| b.as_bytes()).collect();
        assert_eq!(bytes, [&landed[..4], &landed[4..8], &landed[8..]]);
        assert_eq!(
            calls.load(Ordering::Relaxed),
            3,
            "one engine buffer per block"
        );
        buffers.give_all(blocks);
        let again = copy_out(&landed[4..], 4, Some(&buffers));
        assert_eq!(again[1].as_bytes(), &landed[8..]);
        assert_eq!(calls.load(Ordering::Relaxed), 3, "given back, reused");
        let heap = copy_out(&landed, 6, None);
        assert_eq!(heap.len(), 2, "without buffers, new heap buffers");
        assert_eq!(heap[1].as_bytes(), &landed[6..]);
    }
}
