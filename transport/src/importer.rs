//! [`KvImporter`]: the decode node's pulls, over RDMA when both ends can, over TCP
//! otherwise, and over TCP once more when an RDMA read fails.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::host_buffer::HostBuffer;
use pd_engine::kv::handoff::placement::KvReservation;

use crate::client::{KvPuller, PullRequest, check_reservation};
use crate::error::TransportError;
use crate::rdma::select::{MIN_RDMA_TIME, Path, TcpBecause, choose_path, rdma_deadline};
use crate::rdma::{BoxFuture, Fabric, RdmaError, RdmaOffer};
use crate::stats::TransferStats;

/// A one-sided reader of offered leases: the RDMA backend ([`crate::rdma::RdmaReader`]).
pub trait OneSidedReader: Send + Sync + std::fmt::Debug {
    /// This node's port.
    fn fabric(&self) -> Fabric;

    /// Read `req`'s blocks of `offer` before `deadline`, verified against the offer's
    /// checksums, into buffers from `buffers` (the engine's recycled, page-locked on a GPU)
    /// when given and of the right length, else into new heap buffers.
    fn read<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        buffers: Option<&'a BlockBuffers>,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<HostBuffer>, RdmaError>>;

    /// Read `req`'s blocks of `offer` in place into `into` (KV memory the engine reserved,
    /// as many blocks as `req` reads), verified. This default reads into buffers and copies
    /// them in; a reader that registered the node's KV memory reads straight into it.
    fn read_into<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        into: &'a mut KvReservation,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<(), RdmaError>> {
        Box::pin(async move {
            into.write_blocks(&self.read(offer, req, None, deadline).await?);
            Ok(())
        })
    }
}

/// Which path a pull took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathUsed {
    Rdma,
    Tcp,
    /// RDMA failed; the TCP retry succeeded.
    TcpAfterRdmaFailure,
}

/// The decode node's KV importer. Clones share connections and counters.
#[derive(Debug, Clone, Default)]
pub struct KvImporter {
    tcp: KvPuller,
    rdma: Option<Arc<dyn OneSidedReader>>,
}

impl KvImporter {
    /// TCP only.
    pub fn tcp_only() -> Self {
        Self::default()
    }

    /// RDMA where the exporter offers it, TCP otherwise.
    pub fn with_rdma(reader: Arc<dyn OneSidedReader>) -> Self {
        Self {
            tcp: KvPuller::new(),
            rdma: Some(reader),
        }
    }

    /// Pulls into buffers (TCP, and RDMA through its landing buffer) receive into `buffers`
    /// from now on (see [`KvPuller::with_buffers`]).
    pub fn with_buffers(mut self, buffers: BlockBuffers) -> Self {
        self.tcp = KvPuller::with_buffers(buffers);
        self
    }

    /// TCP pulls dial with TLS when `tls` is given (call after [`KvImporter::with_buffers`]).
    pub fn with_tls(mut self, tls: Option<pd_tls::ClientTls>) -> Self {
        self.tcp = self.tcp.with_tls(tls);
        self
    }

    /// Counters of every pull, both paths, and the failovers.
    pub fn stats(&self) -> &Arc<TransferStats> {
        self.tcp.stats()
    }

    /// This node's RDMA port, if it runs RDMA.
    pub fn rdma_fabric(&self) -> Option<Fabric> {
        self.rdma.as_ref().map(|r| r.fabric())
    }

    /// Pull `req`'s blocks from the exporter whose TCP export server is `tcp_addr` and whose
    /// `KvHandle.rdma` is `rdma_offer` (empty: TCP only), before `deadline`.
    ///
    /// Counting: a completed pull counts once (bytes, latency), whichever path; a failed RDMA
    /// read counts as a failover (not as a failure: the request has not failed yet), then the
    /// TCP retry counts as any TCP pull does.
    pub async fn pull(
        &self,
        tcp_addr: SocketAddr,
        rdma_offer: &[u8],
        req: PullRequest,
        deadline: Instant,
    ) -> Result<(Vec<HostBuffer>, PathUsed), TransportError> {
        let now = Instant::now();
        let Some((offer, reader)) = self.rdma_path(tcp_addr, rdma_offer, deadline) else {
            let blocks = self.tcp.pull(tcp_addr, req, deadline).await?;
            return Ok((blocks, PathUsed::Tcp));
        };
        let buffers = self.tcp.buffers();
        match reader
            .read(&offer, req, buffers, rdma_deadline(now, deadline))
            .await
        {
            Ok(blocks) => {
                self.record_rdma_ok(&req, now);
                Ok((blocks, PathUsed::Rdma))
            }
            Err(e) => {
                self.record_failover(tcp_addr, &offer, &req, &e);
                let blocks = self.tcp.pull(tcp_addr, req, deadline).await?;
                Ok((blocks, PathUsed::TcpAfterRdmaFailure))
            }
        }
    }

    /// The same pull, landing in place in `into`: the blocks the decode engine reserved for
    /// it ([`pd_engine::serve::EngineHandle::reserve_import`]), `req.count` blocks of
    /// `req.block_bytes` bytes (checked before anything is sent). On failure `into` holds
    /// partial data and must not be admitted (drop it: its blocks go back to the engine).
    pub async fn pull_into(
        &self,
        tcp_addr: SocketAddr,
        rdma_offer: &[u8],
        req: PullRequest,
        into: &mut KvReservation,
        deadline: Instant,
    ) -> Result<PathUsed, TransportError> {
        check_reservation(&req, into)?;
        let now = Instant::now();
        let Some((offer, reader)) = self.rdma_path(tcp_addr, rdma_offer, deadline) else {
            self.tcp.pull_into(tcp_addr, req, into, deadline).await?;
            return Ok(PathUsed::Tcp);
        };
        match reader
            .read_into(&offer, req, into, rdma_deadline(now, deadline))
            .await
        {
            Ok(()) => {
                self.record_rdma_ok(&req, now);
                Ok(PathUsed::Rdma)
            }
            Err(e) => {
                self.record_failover(tcp_addr, &offer, &req, &e);
                self.tcp.pull_into(tcp_addr, req, into, deadline).await?;
                Ok(PathUsed::TcpAfterRdmaFailure)
            }
        }
    }

    /// The RDMA offer and reader to use, or `None` for TCP (logged when the reason is worth
    /// an operator's attention).
    fn rdma_path(
        &self,
        tcp_addr: SocketAddr,
        rdma_offer: &[u8],
        deadline: Instant,
    ) -> Option<(RdmaOffer, &Arc<dyn OneSidedReader>)> {
        let local = self.rdma.as_ref().map(|r| r.fabric());
        let path = if deadline.saturating_duration_since(Instant::now()) < MIN_RDMA_TIME * 2 {
            Path::Tcp(TcpBecause::NotOffered)
        } else {
            choose_path(local.as_ref(), rdma_offer)
        };
        match (path, &self.rdma) {
            (Path::Rdma(offer), Some(reader)) => Some((offer, reader)),
            (Path::Tcp(because), _) => {
                match because {
                    TcpBecause::BadOffer(e) => {
                        tracing::warn!(%tcp_addr, error = %e, "unusable RDMA offer; pulling over TCP")
                    }
                    TcpBecause::NoCommonFabric { ours, theirs } => tracing::debug!(
                        %tcp_addr, %ours, %theirs, "no common RDMA fabric; pulling over TCP"
                    ),
                    TcpBecause::NoLocalRdma | TcpBecause::NotOffered => {}
                }
                None
            }
            (Path::Rdma(_), None) => unreachable!("choose_path needs a local fabric for RDMA"),
        }
    }

    fn record_rdma_ok(&self, req: &PullRequest, started: Instant) {
        let bytes = req.payload_bytes().unwrap_or(0);
        self.stats().record_ok(bytes, started.elapsed());
    }

    /// A failed RDMA read counts as a failover (not as a failure: the request has not failed
    /// yet); the TCP retry then counts as any TCP pull does.
    fn record_failover(
        &self,
        tcp_addr: SocketAddr,
        offer: &RdmaOffer,
        req: &PullRequest,
        e: &RdmaError,
    ) {
        self.stats().record_failover();
        tracing::warn!(
            %tcp_addr,
            rdma_peer = %offer.connect_addr,
            lease_id = req.lease_id,
            reason = %e.reason(),
            error = %e,
            "RDMA read failed; retrying once over TCP"
        );
    }
}
