//! One `CacheEvents` subscription per registered node (prefill and decode roles alike),
//! feeding the router's one [`SharedIndex`]: the node's snapshot, then its changes, applied
//! as they arrive, each under the index's lock for one synchronous step.
//!
//! The subscription uses the node's own channel (its TLS, its reconnects). When the stream
//! errs, ends, carries a malformed message or one the index cannot apply (a gap, another
//! epoch, more blocks than the node's capacity or the index's bound), the node's view is
//! dropped ([`CacheIndex::lost_stream`]: the policy falls back to its own guess for it) and
//! the subscription is made again after a backoff: [`RETRY_FIRST`] doubling up to
//! [`RETRY_MAX`], jittered, back to the first once a subscription delivered a snapshot. A
//! node that answers UNIMPLEMENTED (a release without cache events) is asked again only every
//! [`RETRY_UNIMPLEMENTED`]. A node that left the registry is forgotten
//! ([`CacheIndex::remove`]) and its subscription ends.
//!
//! Not here: what the index keeps ([`crate::cache_index`]), how it is used
//! ([`crate::policy`]).
//!
//! [`CacheIndex::lost_stream`]: crate::cache_index::CacheIndex::lost_stream
//! [`CacheIndex::remove`]: crate::cache_index::CacheIndex::remove

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pd_proto::cache_events::{CacheMessage, message};
use pd_proto::pb;

use super::{Node, Role};
use crate::cache_index::{OutOfSync, SharedIndex};
use crate::metrics::{LostReason, RouterMetrics};

/// The first retry after a broken subscription.
pub const RETRY_FIRST: Duration = Duration::from_millis(200);
/// The longest wait between two tries (before jitter).
pub const RETRY_MAX: Duration = Duration::from_secs(10);
/// The wait before asking a node that answered UNIMPLEMENTED again (it may be upgraded).
pub const RETRY_UNIMPLEMENTED: Duration = Duration::from_secs(60);
/// How often a waiting subscription looks whether its node left the registry.
const REMOVED_POLL: Duration = Duration::from_millis(500);

/// How one subscription ended.
#[derive(Debug)]
enum Ended {
    /// The node serves no cache events.
    Unimplemented,
    /// Anything else; `synced`: a snapshot was applied first.
    Broken {
        reason: String,
        lost: LostReason,
        synced: bool,
    },
}

/// Follows `node`'s cache events into `index` until the node leaves the registry.
pub(super) async fn follow(node: Arc<Node>, index: Arc<SharedIndex>, metrics: Arc<RouterMetrics>) {
    let mut failures: u32 = 0;
    while !removed(&node) {
        let ended = tokio::select! {
            ended = subscribe(&node, &index) => ended,
            () = wait_removed(&node) => break,
        };
        index.update(|ix| ix.lost_stream(node.id));
        let wait = match ended {
            Ended::Unimplemented => {
                if failures == 0 {
                    tracing::info!(node = %node.addr, role = %node.role,
                        "the node publishes no cache events; routing to it on the router's guess");
                }
                failures = failures.saturating_add(1);
                jitter(RETRY_UNIMPLEMENTED)
            }
            Ended::Broken {
                reason,
                lost,
                synced,
            } => {
                if synced {
                    metrics.cache_events_lost(&node, lost);
                    tracing::warn!(node = %node.addr, role = %node.role, %reason,
                        "cache events lost; routing to the node on the router's guess until it resubscribes");
                    failures = 0;
                } else {
                    tracing::debug!(node = %node.addr, role = %node.role, %reason, "cache events unavailable");
                }
                failures = failures.saturating_add(1);
                jitter(backoff(failures))
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = wait_removed(&node) => break,
        }
    }
    index.update(|ix| ix.remove(node.id));
}

/// The wait before the `failures`-th retry in a row (1-based), before jitter.
fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// Somewhere in `[d/2, d]`, so that a router's subscriptions to nodes that failed together
/// (a network blip) do not come back in lockstep.
fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + 0.5 * rand::random::<f64>())
}

fn removed(node: &Node) -> bool {
    node.removed.load(Ordering::Relaxed)
}

async fn wait_removed(node: &Node) {
    while !removed(node) {
        tokio::time::sleep(REMOVED_POLL).await;
    }
}

/// One subscription: applies every message until the stream breaks.
async fn subscribe(node: &Node, index: &SharedIndex) -> Ended {
    let request = pb::CacheEventsRequest {};
    let response = match node.role {
        Role::Prefill => node.prefill_client().cache_events(request).await,
        Role::Decode | Role::Mixed => node.decode_client().cache_events(request).await,
    };
    let mut stream = match response {
        Ok(r) => r.into_inner(),
        Err(status) if status.code() == tonic::Code::Unimplemented => return Ended::Unimplemented,
        Err(status) => {
            return Ended::Broken {
                reason: format!(
                    "CacheEvents failed: {:?}: {}",
                    status.code(),
                    status.message()
                ),
                lost: LostReason::Broken,
                synced: false,
            };
        }
    };
    let mut synced = false;
    loop {
        let (reason, lost) = match stream.message().await {
            Ok(Some(m)) => match message(&m) {
                Ok(CacheMessage::Snapshot(snap)) => {
                    match index.update(|ix| ix.apply_snapshot(node.id, snap)) {
                        Ok(()) => {
                            if !synced {
                                tracing::debug!(node = %node.addr, "cache events in sync");
                            }
                            synced = true;
                            continue;
                        }
                        Err(e) => (format!("the snapshot cannot be applied: {e:?}"), lost(e)),
                    }
                }
                Ok(CacheMessage::Batch(batch)) => {
                    match index.update(|ix| ix.apply_events(node.id, batch)) {
                        Ok(()) => continue,
                        Err(e) => (format!("the changes cannot be applied: {e:?}"), lost(e)),
                    }
                }
                Err(e) => (
                    format!("malformed cache events: {e}"),
                    LostReason::Malformed,
                ),
            },
            Ok(None) => (
                "the node ended its cache events".to_string(),
                LostReason::Broken,
            ),
            Err(status) => (
                format!(
                    "cache events broke: {:?}: {}",
                    status.code(),
                    status.message()
                ),
                LostReason::Broken,
            ),
        };
        return Ended::Broken {
            reason,
            lost,
            synced,
        };
    }
}

fn lost(e: OutOfSync) -> LostReason {
    match e {
        OutOfSync::NoSnapshot => LostReason::Epoch,
        OutOfSync::Gap => LostReason::Gap,
        OutOfSync::OverCapacity => LostReason::OverCapacity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_first_wait_up_to_the_bound() {
        assert_eq!(backoff(1), RETRY_FIRST);
        assert_eq!(backoff(2), RETRY_FIRST * 2);
        assert_eq!(backoff(4), RETRY_FIRST * 8);
        assert_eq!(backoff(40), RETRY_MAX);
        for _ in 0..100 {
            let j = jitter(RETRY_MAX);
            assert!(j >= RETRY_MAX / 2 && j <= RETRY_MAX);
        }
    }
}
