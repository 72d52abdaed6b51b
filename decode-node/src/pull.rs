//! The decode node's KV pull: the blocks of a prompt this node does not cache, fetched from
//! the prefill node that holds them (RDMA where both nodes run it, else TCP) before the
//! lease's deadline, and placed where the engine takes them (`pull`); what was pulled is
//! counted in [`TransferStats`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pd_engine::kv::handoff::host_buffer::HostBuffer;
use pd_engine::kv::handoff::reservation::{
    DeviceReservation, ImportReservation, Landing, ReservedBlocks,
};
use pd_engine::serve::{EngineRequest, ImportedBlocks, ImportedKv, LeaseSecret};
use pd_proto::pb;
use pd_transport::{PathUsed, PullRequest};
use tonic::Status;

use crate::{DecodeNodeService, peers};

/// The longest a KV pull may take, whatever the lease's deadline.
pub const MAX_PULL_TIME: Duration = Duration::from_secs(5);
/// The shortest deadline a pull gets, so that clocks a little apart between the nodes do not
/// fail a pull the prefill node would still serve (it enforces the lease itself).
pub const MIN_PULL_TIME: Duration = Duration::from_millis(500);

/// Cumulative KV-transfer counters of a decode node.
#[derive(Debug, Default)]
pub struct TransferStats {
    pulls_ok: AtomicU64,
    pulls_failed: AtomicU64,
    blocks_pulled: AtomicU64,
    bytes_pulled: AtomicU64,
    /// Blocks not pulled because this node cached them already.
    blocks_cached: AtomicU64,
}

/// A snapshot of [`TransferStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferCounts {
    pub pulls_ok: u64,
    pub pulls_failed: u64,
    pub blocks_pulled: u64,
    pub bytes_pulled: u64,
    pub blocks_cached: u64,
}

impl TransferStats {
    pub fn snapshot(&self) -> TransferCounts {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferCounts {
            pulls_ok: r(&self.pulls_ok),
            pulls_failed: r(&self.pulls_failed),
            blocks_pulled: r(&self.blocks_pulled),
            bytes_pulled: r(&self.bytes_pulled),
            blocks_cached: r(&self.blocks_cached),
        }
    }
}

impl DecodeNodeService {
    /// Pull the blocks of the prompt this node does not cache, as the engine's imported KV:
    /// into blocks the engine reserves for them where its pool has room (in place where its
    /// KV is in host memory; on a GPU into buffers this task then copies into the reserved
    /// device blocks, so the engine thread copies nothing), else into buffers: placed in
    /// blocks reserved after the pull if the pool has room by then, or else copied in by the
    /// engine at admission.
    pub(crate) async fn pull(
        &self,
        req: &EngineRequest,
        kv: &pb::KvHandle,
        lease_secret: LeaseSecret,
        first_token: u32,
    ) -> Result<ImportedKv, Status> {
        let addr = resolve(&kv.addr).await?;
        // An RDMA offer is followed only to the known prefill node's host.
        let rdma = peers::rdma_offer_on_peer(&kv.addr, &kv.rdma);
        let engine = self.requests.engine().clone();
        let (prompt, salt) = (req.prompt.clone(), req.cache_salt.clone());
        let total = req.prompt.len().div_ceil(self.facts.block_size());
        let (cached, reservation) = tokio::task::spawn_blocking(move || {
            match engine.reserve_import(prompt.clone(), salt.clone()) {
                Some(r) => (r.first_block(), Some(r)),
                None => (engine.cached_prefix_blocks(prompt, salt), None),
            }
        })
        .await
        .map_err(|e| Status::internal(format!("prefix lookup task failed: {e}")))?;
        // The block holding the last prompt token is never cached here; keep at least it.
        let first_block = cached.min(total - 1);
        let count = total - first_block;
        let pull = PullRequest {
            lease_id: kv.lease_id,
            lease_secret,
            fingerprint: self.facts.fingerprint,
            first_block,
            count,
            block_bytes: self.facts.block_bytes(),
        };
        let started = Instant::now();
        let deadline = started + pull_budget(kv.lease_deadline_unix_ms, SystemTime::now());
        // Where the imported KV starts: `first_block`, or a later block where KV pulled into
        // buffers lands in blocks reserved after the pull and more is cached here by then.
        let mut first_placed = first_block;
        let pulled = match reservation {
            Some(ImportReservation::Host(mut into)) => self
                .importer
                .pull_into(addr, rdma, pull, &mut into, deadline)
                .await
                .map(|path| (ImportedBlocks::Placed(into.filled()), path)),
            Some(ImportReservation::Device(into)) => {
                match self.importer.pull(addr, rdma, pull, deadline).await {
                    Ok((buffers, path)) => {
                        let placed = self.write_in(into, buffers).await?;
                        Ok((ImportedBlocks::Placed(placed), path))
                    }
                    Err(e) => Err(e),
                }
            }
            None => match self.importer.pull(addr, rdma, pull, deadline).await {
                Ok((buffers, path)) => {
                    let (first, blocks) = self.place_pulled(req, first_block, buffers).await?;
                    first_placed = first;
                    Ok((blocks, path))
                }
                Err(e) => Err(e),
            },
        };
        match pulled {
            Ok((blocks, path)) => {
                let s = &self.stats;
                s.pulls_ok.fetch_add(1, Ordering::Relaxed);
                s.blocks_pulled.fetch_add(count as u64, Ordering::Relaxed);
                s.bytes_pulled
                    .fetch_add(pull.payload_bytes().unwrap_or(0), Ordering::Relaxed);
                s.blocks_cached
                    .fetch_add(first_block as u64, Ordering::Relaxed);
                tracing::debug!(
                    request_id = %req.id,
                    %addr,
                    lease_id = kv.lease_id,
                    cached_blocks = first_block,
                    pulled_blocks = count,
                    landing = match &blocks {
                        ImportedBlocks::Placed(r) => match r.landing() {
                            Landing::HostInPlace => "in place",
                            Landing::DeviceCopy => "copied into reserved device blocks",
                            Landing::HostCopy => "copied into blocks reserved after the pull",
                        },
                        ImportedBlocks::Buffers(_) => "buffers",
                    },
                    path = match path {
                        PathUsed::Rdma => "rdma",
                        PathUsed::Tcp => "tcp",
                        PathUsed::TcpAfterRdmaFailure => "tcp after rdma failure",
                    },
                    elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                    "KV pulled"
                );
                Ok(ImportedKv {
                    first_block: first_placed,
                    blocks,
                    first_token,
                })
            }
            Err(e) => {
                self.stats.pulls_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    request_id = %req.id,
                    %addr,
                    lease_id = kv.lease_id,
                    reason = %e.reason(),
                    error = %e,
                    "KV pull failed"
                );
                Err(pd_proto::failure::FailureCause::KvPull.status(
                    tonic::Code::Unavailable,
                    format!(
                        "pulling the prompt's KV ({count} blocks of lease {}) from the prefill \
                         node at {addr} failed [{}]: {e}",
                        kv.lease_id,
                        e.reason()
                    ),
                ))
            }
        }
    }

    /// KV pulled into buffers because the pool had no room when the pull began: into
    /// blocks reserved now if it has room by then, copied on a blocking thread
    /// ([`pd_engine::serve::EngineHandle::place_pulled`]), else left in the buffers.
    async fn place_pulled(
        &self,
        req: &EngineRequest,
        first_block: usize,
        buffers: Vec<HostBuffer>,
    ) -> Result<(usize, ImportedBlocks), Status> {
        let engine = self.requests.engine().clone();
        let (prompt, salt) = (req.prompt.clone(), req.cache_salt.clone());
        tokio::task::spawn_blocking(move || engine.place_pulled(prompt, salt, first_block, buffers))
            .await
            .map_err(|e| Status::internal(format!("placing the pulled KV failed: {e}")))
    }

    /// Copy pulled blocks into the device blocks reserved for them (the backend's import
    /// stream), on a blocking thread since the copy waits for the device, then give the
    /// buffers back for the next import.
    async fn write_in(
        &self,
        into: DeviceReservation,
        buffers: Vec<HostBuffer>,
    ) -> Result<ReservedBlocks, Status> {
        let engine = self.requests.engine().clone();
        tokio::task::spawn_blocking(move || {
            let placed = into.write(&buffers);
            engine.import_buffers().give_all(buffers);
            placed
        })
        .await
        .map_err(|e| {
            Status::internal(format!(
                "copying the pulled KV into device memory failed: {e}"
            ))
        })
    }
}

/// How long a pull may take: until the lease's deadline (by this node's clock), within
/// [`MIN_PULL_TIME`, `MAX_PULL_TIME`]; an unset deadline (0) gets the maximum.
fn pull_budget(lease_deadline_unix_ms: u64, now: SystemTime) -> Duration {
    if lease_deadline_unix_ms == 0 {
        return MAX_PULL_TIME;
    }
    let deadline = UNIX_EPOCH + Duration::from_millis(lease_deadline_unix_ms);
    deadline
        .duration_since(now)
        .unwrap_or(Duration::ZERO)
        .clamp(MIN_PULL_TIME, MAX_PULL_TIME)
}

/// `host:port` of a KV export server.
async fn resolve(addr: &str) -> Result<SocketAddr, Status> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    if addr
        .rsplit_once(':')
        .is_none_or(|(_, port)| port.parse::<u16>().is_err())
    {
        return Err(Status::invalid_argument(format!(
            "kv.addr {addr:?} is not host:port"
        )));
    }
    let found = tokio::time::timeout(MAX_PULL_TIME, tokio::net::lookup_host(addr)).await;
    match found {
        Ok(Ok(mut addrs)) => addrs
            .next()
            .ok_or_else(|| Status::unavailable(format!("kv.addr {addr:?} resolves to no address"))),
        Ok(Err(e)) => Err(Status::unavailable(format!(
            "cannot resolve kv.addr {addr:?}: {e}"
        ))),
        Err(_) => Err(Status::unavailable(format!(
            "resolving kv.addr {addr:?} timed out"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_budget_follows_the_lease_within_bounds() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let ms = |d: Duration| (now + d).duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        assert_eq!(
            pull_budget(ms(Duration::from_secs(2)), now),
            Duration::from_secs(2)
        );
        assert_eq!(pull_budget(ms(Duration::from_secs(60)), now), MAX_PULL_TIME);
        assert_eq!(pull_budget(ms(Duration::ZERO) - 10_000, now), MIN_PULL_TIME);
        assert_eq!(pull_budget(0, now), MAX_PULL_TIME);
    }
}
