//! What a request holds on the nodes (a prefill in progress, a KV lease, a decode in
//! progress) and the control calls that give it back: `Abort` and `ReleaseKv`, each with its
//! own short deadline, failures logged (the node's lease timeout and its own view of a
//! dropped stream are the backstops).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pd_proto::pb;
use tonic::Status;

use crate::registry::Node;

/// Deadline of the calls that clean up after a request (`Abort`, `ReleaseKv`).
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

/// A KV lease as the prefill node handed it out: its id and the secret that releases it.
#[derive(Clone)]
pub(super) struct Lease {
    pub id: u64,
    pub secret: Vec<u8>,
}

impl Lease {
    pub fn of(kv: &pb::KvHandle) -> Self {
        Self {
            id: kv.lease_id,
            secret: kv.lease_secret.clone(),
        }
    }
}

/// What a request holds on the nodes right now.
#[derive(Default)]
pub(super) struct Held {
    /// A Prefill call in progress: (node, node request id).
    pub prefilling: Option<(Arc<Node>, String)>,
    /// A KV lease on a prefill node.
    pub lease: Option<(Arc<Node>, Lease)>,
    /// A decode in progress: (node, node request id).
    pub decoding: Option<(Arc<Node>, String)>,
}

impl Held {
    /// Aborts what still runs on the nodes and releases the lease, concurrently.
    pub async fn release(self) {
        let prefill = async {
            if let Some((node, id)) = self.prefilling {
                abort_prefill(node, id).await;
            }
        };
        let decode = async {
            if let Some((node, id)) = self.decoding {
                abort_decode(node, id).await;
            }
        };
        let lease = async {
            if let Some((node, lease)) = self.lease {
                release_kv(node, lease).await;
            }
        };
        tokio::join!(prefill, decode, lease);
    }
}

async fn control<T>(
    what: &str,
    node: &Node,
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) {
    match tokio::time::timeout(CONTROL_TIMEOUT, call).await {
        Ok(Ok(_)) => {}
        Ok(Err(status)) => {
            tracing::warn!(node = %node.addr, role = %node.role, code = ?status.code(), message = status.message(), "{what} failed")
        }
        Err(_) => {
            tracing::warn!(node = %node.addr, role = %node.role, "{what} did not answer within {CONTROL_TIMEOUT:?}")
        }
    }
}

fn control_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CONTROL_TIMEOUT);
    request
}

pub(super) async fn abort_prefill(node: Arc<Node>, request_id: String) {
    let mut client = node.prefill_client();
    let request = control_request(pb::NodeAbortRequest { request_id });
    control("Abort", &node, client.abort(request)).await;
}

pub(super) async fn abort_decode(node: Arc<Node>, request_id: String) {
    let mut client = node.decode_client();
    let request = control_request(pb::NodeAbortRequest { request_id });
    control("Abort", &node, client.abort(request)).await;
}

pub(super) async fn release_kv(node: Arc<Node>, lease: Lease) {
    let mut client = node.prefill_client();
    let request = control_request(pb::ReleaseKvRequest {
        lease_id: lease.id,
        lease_secret: lease.secret,
    });
    control("ReleaseKv", &node, client.release_kv(request)).await;
}
