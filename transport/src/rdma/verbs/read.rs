//! The decode node's side: connect to a prefill node once, then READ offered blocks into a
//! registered landing buffer (kept for later transfers: [`super::landing`]), with a bounded
//! window of READs in flight.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sideway::ibverbs::completion::{PollCompletionQueueError, WorkCompletionStatus};
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};

use super::device::RdmaDevice;
use super::landing::{Landing, LandingPool};
use super::qp::Connection;
use super::verbs_error;
use crate::importer::OneSidedReader;
use crate::rdma::{
    BoxFuture, Fabric, QpEndpoint, RdmaConfig, RdmaConnector, RdmaError, RdmaOffer, ReadOp,
    ReadWindow, block_checksum, plan_reads,
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
}

impl std::fmt::Debug for RdmaReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReader")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl RdmaReader {
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
        })
    }

    fn slot(&self, addr: &str) -> PeerSlot {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(peers.entry(addr.to_string()).or_default())
    }

    /// A connected queue pair to the exporter at `addr` (the endpoint exchange over gRPC).
    async fn connect(&self, addr: &str, deadline: Instant) -> Result<Connection, RdmaError> {
        let depth = u32::try_from(self.max_in_flight).unwrap_or(u32::MAX);
        let mut conn = Connection::create(&self.device, depth, false)?;
        let exchange =
            self.connector
                .connect(addr.to_string(), self.fingerprint, conn.local.encode());
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

    async fn read_blocks(
        &self,
        offer: &RdmaOffer,
        req: PullRequest,
        deadline: Instant,
    ) -> Result<Vec<Vec<f32>>, RdmaError> {
        let block_bytes = req.block_len as u64 * 4;
        if offer.block_bytes != block_bytes {
            return Err(RdmaError::BlockSize {
                theirs: offer.block_bytes,
                ours: block_bytes,
            });
        }
        let ops = plan_reads(
            offer,
            req.first_block as u64,
            req.count as u64,
            self.max_op_bytes,
        )?;
        let slot = self.slot(&offer.connect_addr);
        // One transfer at a time per queue pair: its window bounds the READs in flight.
        let mut guard = slot.lock().await;
        let conn = match guard.take() {
            Some(c) => c,
            None => self.connect(&offer.connect_addr, deadline).await?,
        };
        let landings = Arc::clone(&self.landings);
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let max_in_flight = self.max_in_flight;
        let len = req.count * req.block_len;
        let (conn, landed) = tokio::task::spawn_blocking(move || {
            let landing = match landings.take(len) {
                Ok(l) => l,
                Err(e) => return (Some(conn), Err(e)),
            };
            let (conn, landing, result) =
                transfer(conn, landing, &ops, tag, max_in_flight, deadline);
            let landed = result.map(|()| {
                let blocks = copy_out(&landing, len, req.block_len);
                (landing, blocks)
            });
            // No READ targets the buffer any more (done, or the queue pair is destroyed).
            match landed {
                Ok((landing, blocks)) => {
                    landings.give(landing);
                    (conn, Ok(blocks))
                }
                Err(e) => (conn, Err(e)),
            }
        })
        .await
        .map_err(|e| RdmaError::Verbs {
            op: "the completion thread",
            message: e.to_string(),
        })?;
        // A queue pair that saw an error is in the error state: drop it, reconnect next time.
        *guard = conn;
        drop(guard);
        let blocks = landed?;
        for (i, block) in blocks.iter().enumerate() {
            let index = (req.first_block + i) as u64;
            let sum = block_checksum(index, bytemuck::cast_slice(block));
            if offer.checksums.get(index as usize) != Some(&sum) {
                return Err(RdmaError::Checksum { block: index });
            }
        }
        Ok(blocks)
    }
}

/// The landed values as blocks of `block_len`.
fn copy_out(landing: &Landing, len: usize, block_len: usize) -> Vec<Vec<f32>> {
    landing
        .values(len)
        .chunks_exact(block_len.max(1))
        .map(<[f32]>::to_vec)
        .collect()
}

/// Run `ops` on `conn` into `landing` (registered, large enough for every op). Returns the
/// connection if it is still usable (on an error it is destroyed first, so no READ can write
/// into `landing` afterwards), the landing buffer, and the outcome. Blocking: polls the
/// completion queue until every READ completed or `deadline` passed.
fn transfer(
    mut conn: Connection,
    landing: Landing,
    ops: &[ReadOp],
    tag: u32,
    max_in_flight: usize,
    deadline: Instant,
) -> (Option<Connection>, Landing, Result<(), RdmaError>) {
    let (lkey, base) = (landing.lkey(), landing.base());
    let mut window = ReadWindow::new(tag, ops.len(), max_in_flight);
    let mut idle_polls = 0u32;
    let outcome = loop {
        if window.is_done() {
            break Ok(());
        }
        let batch = window.next_batch();
        if !batch.is_empty() {
            let mut post = conn.qp.start_post_send();
            for i in batch.clone() {
                let op = ops[i];
                let wr = post
                    .construct_wr(window.wr_id(i), WorkRequestFlags::Signaled)
                    .setup_read(op.rkey, op.remote_addr);
                // SAFETY: the SGE lies inside `landing` (the plan fits the transfer, which
                // fits the buffer), registered until the READ completed or the queue pair is
                // destroyed.
                unsafe { wr.setup_sge(lkey, base + op.local_offset, op.len) };
            }
            if let Err(e) = post.post() {
                break Err(verbs_error("ibv_post_send", e));
            }
            window.posted(batch);
        }
        match conn.cq.start_poll() {
            Ok(poller) => {
                idle_polls = 0;
                let mut failed = None;
                for wc in poller {
                    if wc.status() != WorkCompletionStatus::Success as u32 {
                        let status = WorkCompletionStatus::from(wc.status());
                        failed.get_or_insert(RdmaError::Completion {
                            op: wc.wr_id() as u32,
                            remote_access: status == WorkCompletionStatus::RemoteAccessError,
                            status: format!("{status:?}"),
                        });
                    } else if let Err(e) = window.complete(wc.wr_id()) {
                        failed.get_or_insert(e.into());
                    }
                }
                if let Some(e) = failed {
                    break Err(e);
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {
                if Instant::now() >= deadline {
                    break Err(RdmaError::Deadline {
                        done: window.completed(),
                        total: ops.len(),
                    });
                }
                // Spin briefly (a READ of a few MiB completes in well under a millisecond),
                // then yield the core.
                idle_polls += 1;
                if idle_polls > 256 {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            Err(e) => break Err(verbs_error("ibv_poll_cq", e)),
        }
    };
    match outcome {
        Ok(()) => (Some(conn), landing, Ok(())),
        Err(e) => {
            // Destroy the queue pair first: after that no READ can write into `landing`.
            drop(conn);
            (None, landing, Err(e))
        }
    }
}

impl OneSidedReader for RdmaReader {
    fn fabric(&self) -> Fabric {
        self.device.fabric()
    }

    fn read<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, RdmaError>> {
        Box::pin(self.read_blocks(offer, req, deadline))
    }
}
