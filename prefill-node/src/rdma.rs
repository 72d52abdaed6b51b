//! The prefill node's RDMA side: each lease's blocks registered for one-sided reads (the
//! offer a `KvHandle` carries), the `RdmaConnect` endpoint exchange with a decode node, and
//! the sweeper that retires expired leases' offers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::serve::LeaseSecret;
use pd_proto::{convert, pb};
use pd_transport::rdma::{RdmaError, RdmaExporter};
use tonic::Status;

use crate::PrefillNodeService;

impl PrefillNodeService {
    /// Register a new lease's blocks for RDMA reads: the `KvHandle.rdma` offer, or empty
    /// (decode nodes then pull over TCP) when this node runs without RDMA or registering
    /// failed.
    pub(crate) async fn offer_rdma(
        &self,
        lease_id: u64,
        secret: LeaseSecret,
        num_blocks: usize,
        deadline: Instant,
    ) -> Vec<u8> {
        let Some(rdma) = &self.rdma else {
            return Vec::new();
        };
        let (rdma, engine) = (Arc::clone(rdma), self.engine().clone());
        let published = tokio::task::spawn_blocking(move || {
            let lease = engine.lease_blocks(lease_id, &secret);
            let blocks = lease
                .filter(|kv| kv.num_blocks() == num_blocks)
                .ok_or_else(|| {
                    RdmaError::Unavailable(format!("lease {lease_id} is gone before registration"))
                })?;
            rdma.publish(lease_id, &blocks, deadline)
        })
        .await;
        match published {
            Ok(Ok((offer, mode))) => {
                self.metrics.transfers().record_rdma_offer(mode);
                offer
            }
            Ok(Err(e)) => {
                tracing::warn!(lease_id, error = %e, "RDMA registration failed; this lease moves over TCP");
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(lease_id, error = %e, "RDMA registration task failed; this lease moves over TCP");
                Vec::new()
            }
        }
    }

    /// `RdmaConnect`: a queue pair for a decode node that holds a live lease of this node and
    /// has this node's layout; its endpoint is the answer.
    pub(crate) async fn connect_rdma(
        &self,
        req: pb::RdmaConnectRequest,
    ) -> Result<pb::RdmaConnectResponse, Status> {
        // Only a holder of a live lease gets a queue pair; an unknown id and a wrong secret
        // get the same answer, and nothing about this node's layout.
        let secret = convert::lease_secret("lease_secret", &req.lease_secret)?;
        if self.engine().lease_blocks(req.lease_id, &secret).is_none() {
            return Err(Status::permission_denied(
                "RdmaConnect needs a live lease of this node (its id and secret)",
            ));
        }
        let theirs: pd_transport::LayoutFingerprint = req
            .layout_fingerprint
            .parse()
            .map_err(|e| Status::invalid_argument(format!("layout_fingerprint: {e}")))?;
        if theirs != self.facts.fingerprint {
            return Err(Status::failed_precondition(format!(
                "KV layout mismatch: the decode node has layout fingerprint {theirs}, this \
                 prefill node {}; no RDMA connection between different layouts",
                self.facts.fingerprint
            )));
        }
        let Some(rdma) = &self.rdma else {
            return Err(Status::failed_precondition(
                "this prefill node runs without RDMA (--kv-transport tcp, or auto without a \
                 usable device); pull its KV over TCP",
            ));
        };
        let rdma = Arc::clone(rdma);
        // Creating and connecting a queue pair is a few blocking verbs calls.
        let answer = tokio::task::spawn_blocking(move || rdma.accept(&req.endpoint))
            .await
            .map_err(|e| Status::internal(format!("RDMA connect task failed: {e}")))?;
        match answer {
            Ok(endpoint) => Ok(pb::RdmaConnectResponse { endpoint }),
            Err(e @ RdmaError::Endpoint(_)) => Err(Status::invalid_argument(e.to_string())),
            Err(e) => Err(Status::unavailable(format!("RDMA connect failed: {e}"))),
        }
    }
}

/// Retire expired leases' RDMA offers every second, so that an idle node does not keep
/// their memory (a staged copy, or the lease's KV blocks) held; ends once the exporter is
/// gone.
pub(crate) fn spawn_rdma_sweeper(exporter: std::sync::Weak<RdmaExporter>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(exporter) = exporter.upgrade() else {
                return;
            };
            let n = exporter.retire_expired(Instant::now());
            if n > 0 {
                tracing::debug!(expired = n, "RDMA regions of expired leases deregistered");
            }
        }
    });
}
