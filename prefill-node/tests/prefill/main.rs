//! The prefill node over real gRPC on 127.0.0.1 with ephemeral ports: the service started in
//! process through the library (fast), and once as the real binary (ready line, health,
//! reflection, SIGTERM). Every test checks that all KV blocks came back.
//!
//! This file holds the request helpers; the in-process node harness is the workspace's
//! (`pd_test_support::node`).

mod abort;
mod binary;
mod cache_events;
mod requests;
mod sealed;

use pd_proto::pb;

pub(crate) use pd_test_support::node::{Node, channel, prefill_node};
pub(crate) use pd_test_support::{cache, prefill_request, prompt};

/// The release of the lease `kv` names, with its secret (as the router sends it).
pub(crate) fn release_of(kv: &pb::KvHandle) -> pb::ReleaseKvRequest {
    pb::ReleaseKvRequest {
        lease_id: kv.lease_id,
        lease_secret: kv.lease_secret.clone(),
    }
}
