//! Runs an [`Engine`] on its own thread. Callers submit requests through an
//! [`EngineHandle`] and read each request's events from its own channel. A request whose
//! receiver is dropped (the client went away) is aborted. If anything on the thread panics
//! (a step, or a command such as taking a request), the engine is marked unhealthy, the
//! callbacks given to [`EngineHandle::on_failure`] run (the node turns NOT_SERVING there),
//! every open request (the one whose command panicked included) gets one `Failed` event of
//! kind [`ErrorKind::EnginePanic`], and only then does the thread end; later submissions
//! fail at once with an INTERNAL error that is not a panic's. An optional
//! [`FinishedObserver`] sees every request's end on the engine thread (the node's latency
//! histograms), including requests nobody listens to any more, and a [`StepObserver`]
//! every step. The prefix cache's changes are published here too, after each round of
//! commands and each step ([`super::cache_feed`]).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::ErrorKind;
use crate::kv::handoff::block_buffers::BlockBuffers;
use crate::kv::handoff::host_buffer::HostBuffer;
use crate::kv::handoff::lease_secret::LeaseSecret;
use crate::kv::handoff::lease_store::{LeaseStore, LeasedKv};
use crate::kv::handoff::placement::HostKvMemory;
use crate::kv::handoff::reservation::{ImportReservation, ReleaseFn, ReservationId};

use super::cache_feed::{CacheEventStream, CacheFeed, CacheUpdate};
use super::counters::EngineCounters;
use super::engine::{Engine, StepStats};
use super::panic_hook::PanicHook;
use super::request::{
    EngineRequest, Finished, ImportedBlocks, RequestError, RequestEvent, RequestId,
};

/// How often an idle engine wakes to expire leases.
const IDLE_TICK: Duration = Duration::from_millis(50);

/// Called on the engine thread with every `Finished` event, before the counters that include
/// it are published and before it is delivered, whether or not its caller still listens (a request whose client went away, or that was aborted,
/// ends here too). It runs between engine steps: keep it cheap.
pub type FinishedObserver = Box<dyn Fn(&Finished) + Send>;

/// Called once, on the engine thread, when something on it panicked, with the panic's message:
/// after the engine is marked unhealthy, before any open request is failed and before the
/// thread ends.
pub type FailureObserver = Box<dyn FnOnce(&str) + Send>;

/// Whether the engine thread panicked (and with what message), and who wants to know.
#[derive(Default)]
struct Failure {
    message: Option<String>,
    observers: Vec<FailureObserver>,
}

impl std::fmt::Debug for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failure")
            .field("message", &self.message)
            .field("observers", &self.observers.len())
            .finish()
    }
}

/// Called on the engine thread after every step that ran, with what it computed (the
/// node's tokens-per-step histogram). Keep it cheap.
pub type StepObserver = Box<dyn Fn(&StepStats) + Send>;

enum Command {
    Submit(Box<EngineRequest>, Sender<RequestEvent>),
    Abort(RequestId),
    ReleaseLease(u64, LeaseSecret, Sender<bool>),
    CachedPrefix(Vec<u32>, Option<String>, Sender<usize>),
    /// The last field gives the reservation's blocks back if it is dropped unadmitted.
    Reserve(
        Vec<u32>,
        Option<String>,
        Sender<Option<ImportReservation>>,
        Sender<Command>,
    ),
    ReleaseReservation(ReservationId),
    /// A new cache-events subscriber: its channel and the flag set when it falls behind.
    SubscribeCache(mpsc::SyncSender<CacheUpdate>, Arc<AtomicBool>),
    Shutdown,
}

/// A cloneable handle to a running engine thread.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: Sender<Command>,
    healthy: Arc<AtomicBool>,
    failure: Arc<Mutex<Failure>>,
    counters: Arc<Mutex<EngineCounters>>,
    leases: LeaseStore,
    import_buffers: BlockBuffers,
    host_kv: Option<HostKvMemory>,
    /// Whether the engine can reserve blocks for imports ([`Engine::can_reserve`]).
    can_reserve: bool,
}

/// The engine thread; dropping it shuts the engine down and joins the thread.
#[derive(Debug)]
pub struct EngineThread {
    handle: EngineHandle,
    join: Option<JoinHandle<()>>,
}

impl EngineThread {
    /// Start `engine` on a new thread.
    pub fn spawn<B: Backend>(engine: Engine<B>) -> Self {
        Self::spawn_observed(engine, Box::new(|_| {}), Box::new(|_| {}))
    }

    /// Start `engine` on a new thread; `observer` sees every request's end, `on_step` every
    /// step.
    pub fn spawn_observed<B: Backend>(
        engine: Engine<B>,
        observer: FinishedObserver,
        on_step: StepObserver,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        let healthy = Arc::new(AtomicBool::new(true));
        let failure = Arc::new(Mutex::new(Failure::default()));
        let counters = Arc::new(Mutex::new(engine.counters()));
        let handle = EngineHandle {
            tx,
            healthy: Arc::clone(&healthy),
            failure: Arc::clone(&failure),
            counters: Arc::clone(&counters),
            leases: engine.lease_store(),
            import_buffers: engine.import_buffers(),
            host_kv: engine.host_kv_memory(),
            can_reserve: engine.can_reserve(),
        };
        let join = std::thread::Builder::new()
            .name("pd-engine".into())
            .spawn(move || {
                let thread = ThreadState {
                    healthy,
                    failure,
                    counters,
                    observer,
                    on_step,
                    panic_hook: PanicHook::from_env(),
                };
                run(engine, rx, thread)
            })
            .expect("spawning the engine thread");
        Self {
            handle,
            join: Some(join),
        }
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

fn unavailable() -> RequestError {
    RequestError {
        kind: ErrorKind::Internal,
        message: "the engine is not running (it failed or shut down)".into(),
    }
}

impl EngineHandle {
    /// Submit a request; its events (exactly one terminal) arrive on the returned channel.
    pub fn submit(&self, req: EngineRequest) -> Receiver<RequestEvent> {
        let (tx, rx) = mpsc::channel();
        // A failed engine may not have dropped its receiver yet: a command queued now would
        // be dropped with it, and the caller would see a closed stream instead of the error.
        if !self.is_healthy() {
            let _ = tx.send(RequestEvent::Failed(unavailable()));
            return rx;
        }
        if let Err(mpsc::SendError(Command::Submit(_, tx))) =
            self.tx.send(Command::Submit(Box::new(req), tx))
        {
            let _ = tx.send(RequestEvent::Failed(unavailable()));
        }
        rx
    }

    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Release a prefill lease; false if unknown (already released or expired) or `secret`
    /// is not its secret (nothing is released then).
    pub fn release_lease(&self, lease_id: u64, secret: LeaseSecret) -> bool {
        let (tx, rx) = mpsc::channel();
        if self
            .tx
            .send(Command::ReleaseLease(lease_id, secret, tx))
            .is_err()
        {
            return false;
        }
        rx.recv().unwrap_or(false)
    }

    /// Leading blocks of `tokens` this engine's device cache holds (0 if the engine is gone).
    pub fn cached_prefix_blocks(&self, tokens: Vec<u32>, salt: Option<String>) -> usize {
        let (tx, rx) = mpsc::channel();
        if self
            .tx
            .send(Command::CachedPrefix(tokens, salt, tx))
            .is_err()
        {
            return 0;
        }
        rx.recv().unwrap_or(0)
    }

    /// Reserve the blocks of `tokens`' KV this node does not cache, for a pull to fill
    /// ([`ImportReservation`]: in place in host KV memory, or written into device KV
    /// storage by the puller); `None` if the engine cannot reserve, the pool has no room
    /// now, or the engine is gone: pull into [`Self::import_buffers`] then.
    pub fn reserve_import(
        &self,
        tokens: Vec<u32>,
        salt: Option<String>,
    ) -> Option<ImportReservation> {
        if !self.can_reserve {
            return None;
        }
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Reserve(tokens, salt, tx, self.tx.clone()))
            .ok()?;
        rx.recv().ok().flatten()
    }

    /// Imported KV pulled into buffers (from `first_block` to the prompt's end) because
    /// [`Self::reserve_import`] found no room when the pull began: reserve again now and, if
    /// the pool has room by then, copy the buffers into the reserved blocks here, on the
    /// calling thread, so that admitting the request copies nothing on the engine thread.
    /// Returns the first block of the imported KV and the blocks: placed (from a later
    /// block where more of the prompt is cached here by now; the buffers go back to
    /// [`Self::import_buffers`]), or still the buffers where there is no room, or the
    /// locally cached prefix the pull relied on was evicted meanwhile (admission then sees
    /// to it, as for any import in buffers). Blocking.
    pub fn place_pulled(
        &self,
        tokens: Vec<u32>,
        salt: Option<String>,
        first_block: usize,
        buffers: Vec<HostBuffer>,
    ) -> (usize, ImportedBlocks) {
        let Some(reserved) = self.reserve_import(tokens, salt) else {
            return (first_block, ImportedBlocks::Buffers(buffers));
        };
        let first = reserved.first_block();
        match first.checked_sub(first_block) {
            Some(skip) if skip + reserved.len() == buffers.len() => {
                let placed = reserved.fill(&buffers[skip..]);
                self.import_buffers.give_all(buffers);
                (first, ImportedBlocks::Placed(placed))
            }
            // Dropping the reservation gives its blocks back.
            _ => (first_block, ImportedBlocks::Buffers(buffers)),
        }
    }

    /// Where KV storage lies in host memory (`None` on a GPU): an RDMA reader registers it
    /// once so that reads land in reserved blocks.
    pub fn host_kv_memory(&self) -> Option<&HostKvMemory> {
        self.host_kv.as_ref()
    }

    /// All of a lease's blocks, shared without a copy (`None`: no such lease, or `secret`
    /// is not its secret). Served without waiting for the engine thread ([`LeaseStore`]).
    pub fn lease_blocks(&self, lease_id: u64, secret: &LeaseSecret) -> Option<Arc<LeasedKv>> {
        self.leases.get(lease_id, secret)
    }

    /// The buffers imported KV should arrive in: the engine gives each back once its block
    /// is in KV storage, so steady imports reuse warm memory ([`BlockBuffers`]).
    pub fn import_buffers(&self) -> &BlockBuffers {
        &self.import_buffers
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Runs `observer` with the panic's message when the engine thread panics, on that
    /// thread, before any open request hears of it and before the thread ends; at once, on
    /// this thread, if it panicked already. Where a node turns NOT_SERVING.
    pub fn on_failure(&self, observer: impl FnOnce(&str) + Send + 'static) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        match failure.message.clone() {
            Some(message) => {
                drop(failure);
                observer(&message);
            }
            None => failure.observers.push(Box::new(observer)),
        }
    }

    /// Subscribe to the prefix cache's changes: a snapshot of both tiers, then a batch of
    /// changes per step that made any ([`super::cache_feed`]). At most `buffer` messages
    /// (at least 1) wait unread; one more and the subscription ends with
    /// [`super::FeedEnded::Lagged`]. It ends with [`super::FeedEnded::EngineStopped`] when
    /// the engine stops (at once if it has).
    pub fn subscribe_cache_events(&self, buffer: usize) -> CacheEventStream {
        let (tx, rx) = mpsc::sync_channel(buffer.max(1));
        let lagged = Arc::new(AtomicBool::new(false));
        let stream = CacheEventStream::new(rx, Arc::clone(&lagged));
        // Not sent to a failed engine: dropping `tx` ends the stream at once.
        if self.is_healthy() {
            let _ = self.tx.send(Command::SubscribeCache(tx, lagged));
        }
        stream
    }

    /// The engine's counters as of its last step.
    pub fn counters(&self) -> EngineCounters {
        self.counters.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

/// What the engine thread owns besides the engine and its command channel.
struct ThreadState {
    healthy: Arc<AtomicBool>,
    failure: Arc<Mutex<Failure>>,
    counters: Arc<Mutex<EngineCounters>>,
    observer: FinishedObserver,
    on_step: StepObserver,
    panic_hook: Option<PanicHook>,
}

/// The text of a caught panic.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// The engine thread: serves commands and steps until shutdown; a panic anywhere in that
/// loop ends it through [`fail`].
fn run<B: Backend>(mut engine: Engine<B>, rx: Receiver<Command>, thread: ThreadState) {
    let mut streams: HashMap<RequestId, Sender<RequestEvent>> = HashMap::new();
    // Dropped with the thread: every subscription then ends.
    let mut feed = CacheFeed::new();
    let served = std::panic::catch_unwind(AssertUnwindSafe(|| {
        serve(&mut engine, &rx, &thread, &mut streams, &mut feed)
    }));
    if let Err(panic) = served {
        fail(&thread, &panic_message(&*panic), streams);
    }
    thread.healthy.store(false, Ordering::Release);
    // Submissions queued before callers could see the engine unhealthy get the error, not
    // a closed stream.
    for cmd in rx.try_iter() {
        if let Command::Submit(_, tx) = cmd {
            let _ = tx.send(RequestEvent::Failed(unavailable()));
        }
    }
}

/// After a panic on the engine thread: unhealthy, then the failure observers (the node turns
/// NOT_SERVING), then every open request fails, in that order, so that no caller hears of
/// the failure while its node still reports SERVING.
fn fail(thread: &ThreadState, what: &str, streams: HashMap<RequestId, Sender<RequestEvent>>) {
    tracing::error!(error = %what, "the engine thread panicked; failing every open request");
    thread.healthy.store(false, Ordering::Release);
    let observers = {
        let mut failure = thread.failure.lock().unwrap_or_else(|e| e.into_inner());
        failure.message = Some(what.to_string());
        std::mem::take(&mut failure.observers)
    };
    for observer in observers {
        // One that panics must not keep the open requests from hearing of the failure.
        if std::panic::catch_unwind(AssertUnwindSafe(|| observer(what))).is_err() {
            tracing::error!("a failure observer panicked");
        }
    }
    for (_, tx) in streams {
        let _ = tx.send(RequestEvent::Failed(RequestError {
            kind: ErrorKind::EnginePanic,
            message: format!(
                "the engine failed while this request was open (a panic: {what}); the node \
                 stopped serving, and the request is not retried on another node"
            ),
        }));
    }
}

/// The open requests' event streams, by request.
type Streams = HashMap<RequestId, Sender<RequestEvent>>;

/// Commands and steps until shutdown or until every sender is gone.
fn serve<B: Backend>(
    engine: &mut Engine<B>,
    rx: &Receiver<Command>,
    thread: &ThreadState,
    streams: &mut Streams,
    feed: &mut CacheFeed,
) {
    while let Some(first) = first_command(engine, rx, thread) {
        let mut shutdown = false;
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            shutdown |= handle(engine, cmd, thread, streams, feed);
        }
        // Commands change the cache too (a reservation's allocation evicts blocks).
        feed.publish(engine);
        if shutdown {
            for (id, tx) in streams.drain() {
                if let Some(event) = engine.abort(&id) {
                    observe(thread, &event);
                    let _ = tx.send(event);
                }
            }
            break;
        }
        if !engine.has_work() {
            publish(thread, engine);
            continue;
        }
        step(engine, thread, streams);
        feed.publish(engine);
    }
}

/// The first command of a round: a queued one (if any) while the engine has work, else
/// the next one within [`IDLE_TICK`] (expiring leases when none came). `None` once every
/// sender is gone.
fn first_command<B: Backend>(
    engine: &mut Engine<B>,
    rx: &Receiver<Command>,
    thread: &ThreadState,
) -> Option<Option<Command>> {
    if engine.has_work() {
        return match rx.try_recv() {
            Ok(cmd) => Some(Some(cmd)),
            Err(mpsc::TryRecvError::Empty) => Some(None),
            Err(mpsc::TryRecvError::Disconnected) => None,
        };
    }
    match rx.recv_timeout(IDLE_TICK) {
        Ok(cmd) => Some(Some(cmd)),
        Err(RecvTimeoutError::Timeout) => {
            engine.expire_leases(Instant::now());
            publish(thread, engine);
            Some(None)
        }
        Err(RecvTimeoutError::Disconnected) => None,
    }
}

/// A finished request's event goes to the finished observer.
fn observe(thread: &ThreadState, event: &RequestEvent) {
    if let RequestEvent::Finished(finished) = event {
        (thread.observer)(finished);
    }
}

/// The engine's counters, as callers read them.
fn publish<B: Backend>(thread: &ThreadState, engine: &Engine<B>) {
    if let Ok(mut c) = thread.counters.lock() {
        *c = engine.counters();
    }
}

/// One command; true for [`Command::Shutdown`].
fn handle<B: Backend>(
    engine: &mut Engine<B>,
    cmd: Command,
    thread: &ThreadState,
    streams: &mut Streams,
    feed: &mut CacheFeed,
) -> bool {
    match cmd {
        Command::Submit(req, tx) => {
            let id = req.id.clone();
            // Open before the engine sees it: if taking it panics, it is failed with the
            // others.
            streams.insert(id.clone(), tx);
            if let Some(hook) = &thread.panic_hook {
                hook.check(&req.prompt);
            }
            if let Err(e) = engine.submit(*req)
                && let Some(tx) = streams.remove(&id)
            {
                let _ = tx.send(RequestEvent::Failed(e));
            }
        }
        Command::Abort(id) => {
            if let Some(event) = engine.abort(&id) {
                observe(thread, &event);
                publish(thread, engine);
                if let Some(tx) = streams.remove(&id) {
                    let _ = tx.send(event);
                }
            }
        }
        Command::ReleaseLease(lease, secret, reply) => {
            let released = engine.release_lease(lease, &secret);
            publish(thread, engine);
            let _ = reply.send(released);
        }
        Command::CachedPrefix(tokens, salt, reply) => {
            let _ = reply.send(engine.cached_prefix_blocks(&tokens, salt.as_deref()));
        }
        Command::Reserve(tokens, salt, reply, back) => {
            let release: ReleaseFn = Arc::new(move |id| {
                let _ = back.send(Command::ReleaseReservation(id));
            });
            let reservation = engine.reserve_import(&tokens, salt.as_deref(), release);
            publish(thread, engine);
            if let Err(mpsc::SendError(Some(r))) = reply.send(reservation) {
                // The caller went away: the reservation's drop gives the blocks back.
                drop(r);
            }
        }
        Command::ReleaseReservation(id) => {
            if engine.release_reservation(id) {
                publish(thread, engine);
            }
        }
        Command::SubscribeCache(tx, lagged) => feed.subscribe(engine, tx, lagged),
        Command::Shutdown => return true,
    }
    false
}

/// One engine step and the delivery of its events.
fn step<B: Backend>(engine: &mut Engine<B>, thread: &ThreadState, streams: &mut Streams) {
    let steps_before = engine.model_steps();
    let events = engine.step();
    if engine.model_steps() != steps_before {
        (thread.on_step)(&engine.last_step());
    }
    // Observe, then publish, then deliver: a caller that sees its request end and then
    // asks for the counters must see that end reflected (blocks, leases), and counters
    // that show an end come with its timings.
    events.iter().for_each(|(_, event)| observe(thread, event));
    publish(thread, engine);
    for (id, event) in events {
        let terminal = event.is_terminal();
        let delivered = streams.get(&id).map(|tx| tx.send(event).is_ok());
        if terminal {
            streams.remove(&id);
        } else if delivered == Some(false) {
            // The caller dropped its receiver: nobody wants the rest.
            streams.remove(&id);
            if let Some(end) = engine.abort(&id) {
                observe(thread, &end);
            }
        }
    }
    // Aborts of dropped streams above changed the counters again.
    publish(thread, engine);
}
