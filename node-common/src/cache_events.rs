//! The `CacheEvents` RPC both node roles serve: the engine's prefix-cache feed
//! ([`pd_engine::serve::cache_feed`]: a snapshot of both tiers, then the changes in order,
//! under the engine's epoch) on the wire ([`pd_proto::cache_events`]).
//!
//! - At most [`MAX_SUBSCRIBERS`] streams at once (the router needs one per node); one more is
//!   refused with RESOURCE_EXHAUSTED. A draining node refuses new ones with UNAVAILABLE.
//! - A subscriber that falls behind is dropped by the engine; the stream then carries a new
//!   snapshot and goes on, so the caller never applies changes with a gap.
//! - The stream ends (OK) when the node starts draining, and with UNAVAILABLE if the engine
//!   stops under it.
//!
//! Who may call it is the gRPC server's business, as for every node RPC (with mTLS, callers
//! without a cluster certificate never reach a handler). Not here: producing the changes (the
//! engine), applying them (the router's index).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pd_engine::serve::{CacheUpdate, FeedEnded};
use pd_proto::cache_events::{wire_batch, wire_snapshot};
use pd_proto::pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::requests::Requests;

/// Most `CacheEvents` streams a node serves at once.
pub const MAX_SUBSCRIBERS: usize = 8;
/// Messages the engine holds for one subscriber before dropping it (each a step's changes).
const ENGINE_BUFFER: usize = 1024;
/// Messages converted and waiting for the gRPC stream.
const WIRE_BUFFER: usize = 16;
/// How often a quiet stream checks whether the node drains or the caller went away.
const POLL: Duration = Duration::from_millis(100);

/// The response stream of `CacheEvents`.
pub type CacheEventsStream =
    Pin<Box<dyn Stream<Item = Result<pb::CacheEventsMessage, Status>> + Send>>;

/// `CacheEvents` for one node: its engine (through its requests, for the drain) and the count
/// of open streams.
#[derive(Debug)]
pub struct CacheEvents {
    requests: Arc<Requests>,
    open: Arc<AtomicUsize>,
}

/// One open stream's place under [`MAX_SUBSCRIBERS`], given back when the stream is dropped.
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CacheEvents {
    pub fn new(requests: Arc<Requests>) -> Self {
        Self {
            requests,
            open: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// A new stream (see the module doc), or why not.
    pub fn subscribe(&self) -> Result<CacheEventsStream, Status> {
        if self.requests.is_draining() {
            return Err(Status::unavailable(
                "this node is draining (shutting down): its cache events end here",
            ));
        }
        if !self.requests.engine().is_healthy() {
            return Err(Status::unavailable(
                "the engine is not running (it failed or shut down)",
            ));
        }
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_SUBSCRIBERS).then_some(n + 1)
            })
            .map_err(|n| {
                Status::resource_exhausted(format!(
                    "this node serves {n} cache-events streams already (at most \
                     {MAX_SUBSCRIBERS}); close one first"
                ))
            })?;
        let slot = Slot(Arc::clone(&self.open));
        let (tx, rx) = mpsc::channel(WIRE_BUFFER);
        let requests = Arc::clone(&self.requests);
        tokio::task::spawn_blocking(move || forward(&requests, &tx));
        let stream = ReceiverStream::new(rx).map(move |message| {
            // The slot lives as long as the stream.
            let _ = &slot;
            message
        });
        Ok(Box::pin(stream))
    }
}

/// Moves the engine's feed to the stream until the caller goes away, the node drains or the
/// engine stops; a subscription the engine dropped for lagging is renewed (a new snapshot).
fn forward(requests: &Requests, tx: &mpsc::Sender<Result<pb::CacheEventsMessage, Status>>) {
    loop {
        let feed = requests.engine().subscribe_cache_events(ENGINE_BUFFER);
        loop {
            if requests.is_draining() || tx.is_closed() {
                return;
            }
            let update = match feed.recv_timeout(POLL) {
                Ok(Some(update)) => update,
                Ok(None) => continue,
                Err(FeedEnded::Lagged) => {
                    tracing::debug!(
                        "a cache-events subscriber fell behind: sending a new snapshot"
                    );
                    break;
                }
                Err(FeedEnded::EngineStopped) => {
                    let _ = tx.blocking_send(Err(Status::unavailable(
                        "the engine stopped (it failed or the node is shutting down)",
                    )));
                    return;
                }
            };
            let message = match &update {
                CacheUpdate::Snapshot(s) => wire_snapshot(s),
                CacheUpdate::Batch(b) => wire_batch(b),
            };
            if tx.blocking_send(Ok(message)).is_err() {
                return;
            }
        }
    }
}
