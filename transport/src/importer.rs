//! [`KvImporter`]: the decode node's pulls, over RDMA when both ends can, over TCP
//! otherwise, and over TCP once more when an RDMA read fails.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::client::{KvPuller, PullRequest};
use crate::error::TransportError;
use crate::rdma::select::{MIN_RDMA_TIME, Path, TcpBecause, choose_path, rdma_deadline};
use crate::rdma::{BoxFuture, Fabric, RdmaError, RdmaOffer};
use crate::stats::TransferStats;

/// A one-sided reader of offered leases: the RDMA backend ([`crate::rdma::RdmaReader`]).
pub trait OneSidedReader: Send + Sync + std::fmt::Debug {
    /// This node's port.
    fn fabric(&self) -> Fabric;

    /// Read `req`'s blocks of `offer` before `deadline`, verified against the offer's
    /// checksums.
    fn read<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<Vec<f32>>, RdmaError>>;
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

    /// TCP pulls receive into `buffers` from now on (see [`KvPuller::with_buffers`]).
    pub fn with_buffers(mut self, buffers: pd_engine::kv::block_buffers::BlockBuffers) -> Self {
        self.tcp = KvPuller::with_buffers(buffers);
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
    ) -> Result<(Vec<Vec<f32>>, PathUsed), TransportError> {
        let local = self.rdma.as_ref().map(|r| r.fabric());
        let now = Instant::now();
        let path = if deadline.saturating_duration_since(now) < MIN_RDMA_TIME * 2 {
            Path::Tcp(TcpBecause::NotOffered)
        } else {
            choose_path(local.as_ref(), rdma_offer)
        };
        let (offer, reader) = match (path, &self.rdma) {
            (Path::Rdma(offer), Some(reader)) => (offer, reader),
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
                let blocks = self.tcp.pull(tcp_addr, req, deadline).await?;
                return Ok((blocks, PathUsed::Tcp));
            }
            (Path::Rdma(_), None) => unreachable!("choose_path needs a local fabric for RDMA"),
        };
        match reader.read(&offer, req, rdma_deadline(now, deadline)).await {
            Ok(blocks) => {
                let bytes = req.payload_bytes().unwrap_or(0);
                self.stats().record_ok(bytes, now.elapsed());
                Ok((blocks, PathUsed::Rdma))
            }
            Err(e) => {
                self.stats().record_failover();
                tracing::warn!(
                    %tcp_addr,
                    rdma_peer = %offer.connect_addr,
                    lease_id = req.lease_id,
                    reason = %e.reason(),
                    error = %e,
                    "RDMA read failed; retrying once over TCP"
                );
                let blocks = self.tcp.pull(tcp_addr, req, deadline).await?;
                Ok((blocks, PathUsed::TcpAfterRdmaFailure))
            }
        }
    }
}
