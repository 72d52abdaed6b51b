//! The engine's prefix-cache feed: subscribers get a [`Snapshot`] of both tiers, then one
//! [`EventBatch`] per engine step that changed them, numbered without gaps under this
//! process's epoch. The feed lives on the engine thread ([`super::driver`]), so a snapshot is
//! taken between steps with every earlier change already numbered and sent: nothing is missed
//! or counted twice.
//!
//! Each subscriber has a bounded channel. One whose channel is full (it fell behind) is
//! dropped rather than waited for or buffered without bound: its [`CacheEventStream`] ends
//! with [`FeedEnded::Lagged`] and it subscribes again for a fresh snapshot. While nobody
//! subscribes, the tiers record nothing ([`crate::kv::prefix::journal`]).
//!
//! Not here: where changes are recorded (the tiers), serving the feed over gRPC (the nodes).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::Duration;

use crate::backend::Backend;
use crate::kv::prefix::events::{EventBatch, Snapshot, Tier};

use super::engine::Engine;

/// One message of the feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheUpdate {
    /// Both tiers as they are; the changes that follow start at `seq + 1`.
    Snapshot(Snapshot),
    /// Changes following the last message.
    Batch(EventBatch),
}

/// Why a [`CacheEventStream`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FeedEnded {
    /// The subscriber did not keep up and was dropped: subscribe again for a new snapshot.
    #[error("the cache-events subscriber fell behind and was dropped; subscribe again")]
    Lagged,
    /// The engine stopped (shut down or failed).
    #[error("the engine stopped (it failed or shut down)")]
    EngineStopped,
}

/// A subscriber's end of the feed ([`super::EngineHandle::subscribe_cache_events`]).
#[derive(Debug)]
pub struct CacheEventStream {
    rx: Receiver<CacheUpdate>,
    lagged: Arc<AtomicBool>,
}

impl CacheEventStream {
    /// Half of a subscription: the engine keeps the other ([`CacheFeed::subscribe`]).
    pub(super) fn new(rx: Receiver<CacheUpdate>, lagged: Arc<AtomicBool>) -> Self {
        Self { rx, lagged }
    }

    /// The next message, blocking until there is one or the stream ends.
    pub fn recv(&self) -> Result<CacheUpdate, FeedEnded> {
        self.rx.recv().map_err(|_| self.ended())
    }

    /// The next message within `timeout` (`None`: none came), or why the stream ended.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<CacheUpdate>, FeedEnded> {
        match self.rx.recv_timeout(timeout) {
            Ok(update) => Ok(Some(update)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.ended()),
        }
    }

    fn ended(&self) -> FeedEnded {
        if self.lagged.load(Ordering::Acquire) {
            FeedEnded::Lagged
        } else {
            FeedEnded::EngineStopped
        }
    }
}

/// The engine's end of one subscription.
struct Subscriber {
    tx: SyncSender<CacheUpdate>,
    lagged: Arc<AtomicBool>,
}

/// The subscribers, the epoch and the next sequence number (see the module doc).
pub(super) struct CacheFeed {
    epoch: u64,
    /// The number of the next change; a snapshot says `next_seq - 1`.
    next_seq: u64,
    subscribers: Vec<Subscriber>,
}

impl std::fmt::Debug for CacheFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheFeed")
            .field("epoch", &self.epoch)
            .field("next_seq", &self.next_seq)
            .field("subscribers", &self.subscribers.len())
            .finish()
    }
}

impl CacheFeed {
    /// A feed under a new random epoch (one per engine: a restarted node's changes are not
    /// mistaken for the old process's).
    pub(super) fn new() -> Self {
        Self {
            epoch: rand::random(),
            next_seq: 1,
            subscribers: Vec::new(),
        }
    }

    /// Add a subscriber: publish what is pending to the others first, then send it the
    /// snapshot (its channel is empty, so it fits), and record changes from now on.
    pub(super) fn subscribe<B: Backend>(
        &mut self,
        engine: &mut Engine<B>,
        tx: SyncSender<CacheUpdate>,
        lagged: Arc<AtomicBool>,
    ) {
        self.publish(engine);
        let snapshot = Snapshot {
            epoch: self.epoch,
            seq: self.next_seq - 1,
            block_size: engine.block_size(),
            device_capacity: engine.cache_capacity(Tier::Device),
            host_capacity: engine.cache_capacity(Tier::Host),
            device: engine.cached_hashes(Tier::Device),
            host: engine.cached_hashes(Tier::Host),
        };
        let subscriber = Subscriber { tx, lagged };
        if subscriber.send(CacheUpdate::Snapshot(snapshot)) {
            self.subscribers.push(subscriber);
        }
        engine.record_cache_changes(!self.subscribers.is_empty());
    }

    /// Number and send the changes recorded since the last call as one batch (nothing when
    /// there are none). Subscribers that are gone or full are dropped.
    pub(super) fn publish<B: Backend>(&mut self, engine: &mut Engine<B>) {
        if self.subscribers.is_empty() {
            return;
        }
        let events = engine.drain_cache_changes();
        if events.is_empty() {
            return;
        }
        let batch = EventBatch {
            epoch: self.epoch,
            first_seq: self.next_seq,
            events,
        };
        self.next_seq += batch.events.len() as u64;
        let subscribers = std::mem::take(&mut self.subscribers);
        let last = subscribers.len() - 1;
        let mut batch = Some(batch);
        for (i, s) in subscribers.into_iter().enumerate() {
            // The last subscriber takes the batch itself: one subscriber costs no copy.
            let update = if i == last {
                batch.take().expect("taken once")
            } else {
                batch.clone().expect("not taken yet")
            };
            if s.send(CacheUpdate::Batch(update)) {
                self.subscribers.push(s);
            }
        }
        if self.subscribers.is_empty() {
            engine.record_cache_changes(false);
        }
    }
}

impl Subscriber {
    /// Whether the subscriber is still there; one that fell behind is marked lagged.
    fn send(&self, update: CacheUpdate) -> bool {
        match self.tx.try_send(update) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                // Set before the sender is dropped: the stream sees the flag when it ends.
                self.lagged.store(true, Ordering::Release);
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }
}
