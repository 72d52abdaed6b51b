//! The requests a node is serving: one registry per node (for `Abort`, draining and the
//! duplicate-id check), guards that abort an engine request whose caller went away, and the
//! bridge from the engine's blocking event channel into async code.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use pd_engine::serve::{EngineHandle, EngineRequest, RequestError, RequestEvent, RequestId};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tonic::Status;

/// Open requests of a node (each with its "abort asked" flag) and whether it is draining.
#[derive(Debug)]
pub struct Requests {
    engine: EngineHandle,
    draining: AtomicBool,
    open: Mutex<HashMap<RequestId, Arc<AtomicBool>>>,
    /// Most requests open at once (running and waiting): `--max-num-seqs + --max-waiting`.
    capacity: usize,
}

impl Requests {
    /// The registry of a node that holds at most `capacity` requests open at once.
    pub fn new(engine: EngineHandle, capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            engine,
            draining: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            capacity,
        })
    }

    /// Most requests open at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    fn open(&self) -> MutexGuard<'_, HashMap<RequestId, Arc<AtomicBool>>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts
        // and removes), so a poisoned lock is still usable.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register a new request. Refused with UNAVAILABLE while draining, with
    /// RESOURCE_EXHAUSTED when the node holds its capacity already (its waiting queue is
    /// full: the caller tries another node) and with INVALID_ARGUMENT if the id is open
    /// already. Dropping the guard before
    /// [`RequestGuard::finished`] aborts the engine request.
    pub fn begin(self: &Arc<Self>, id: &RequestId) -> Result<RequestGuard, Status> {
        if self.is_draining() {
            return Err(Status::unavailable(
                "this node is draining (shutting down) and takes no new requests; send it to another node",
            ));
        }
        let aborted = Arc::new(AtomicBool::new(false));
        {
            let mut open = self.open();
            if open.len() >= self.capacity {
                return Err(Status::resource_exhausted(format!(
                    "this node is full ({} requests open: running and waiting, --max-num-seqs \
                     plus --max-waiting); send it to another node",
                    open.len()
                )));
            }
            if open.contains_key(id) {
                return Err(Status::invalid_argument(format!(
                    "request id \"{id}\" is already in use on this node: request ids must be unique among open requests"
                )));
            }
            open.insert(id.clone(), Arc::clone(&aborted));
        }
        Ok(RequestGuard {
            requests: Arc::clone(self),
            id: id.clone(),
            aborted,
            finished: AtomicBool::new(false),
        })
    }

    /// Abort an open request (also one not handed to the engine yet, such as a decode still
    /// pulling its KV); false if this node has no such request.
    pub fn abort(&self, id: &RequestId) -> bool {
        let flag = self.open().get(id).cloned();
        match flag {
            Some(aborted) => {
                // The flag first: a request submitted after this point sees it and aborts
                // itself; one submitted before is reached by the engine abort.
                aborted.store(true, Ordering::Release);
                self.engine.abort(id.clone());
                true
            }
            None => false,
        }
    }

    /// Abort every open request (the end of a drain).
    pub fn abort_all(&self) {
        let ids: Vec<RequestId> = self.open().keys().cloned().collect();
        for id in ids {
            self.abort(&id);
        }
    }

    pub fn len(&self) -> usize {
        self.open().len()
    }

    pub fn is_empty(&self) -> bool {
        self.open().is_empty()
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// An open request. Dropped before the engine ended it (the client cancelled the call or
/// went away), it aborts the engine request; either way it leaves the registry.
#[derive(Debug)]
pub struct RequestGuard {
    requests: Arc<Requests>,
    id: RequestId,
    /// `Abort` was asked for this request.
    aborted: Arc<AtomicBool>,
    finished: AtomicBool,
}

impl RequestGuard {
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    /// Whether `Abort` was asked for this request (check before costly work such as a KV
    /// pull).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Hand the request (whose id is this guard's) to the engine; its events arrive on the
    /// returned channel. An abort asked before the engine had it still takes effect.
    pub fn submit(&self, request: EngineRequest) -> mpsc::Receiver<RequestEvent> {
        debug_assert_eq!(request.id, self.id);
        let engine = self.requests.engine();
        let rx = engine.submit(request);
        if self.is_aborted() {
            // Commands reach the engine in order: this abort follows the submission.
            engine.abort(self.id.clone());
        }
        rx
    }

    /// The engine ended the request (a terminal event arrived): nothing to abort.
    pub fn finished(&self) {
        self.finished.store(true, Ordering::Release);
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.finished.load(Ordering::Acquire) {
            tracing::debug!(request_id = %self.id, "caller went away; aborting the request");
            self.requests.engine.abort(self.id.clone());
        }
        self.requests.open().remove(&self.id);
    }
}

/// Forward a request's engine events into async code. The forwarding runs on tokio's
/// blocking pool until the terminal event, or until the returned receiver is dropped (then
/// the engine's receiver is dropped too, which makes the engine abort the request at its
/// next token). A channel that closes without a terminal event means the engine stopped.
pub fn forward_events(rx: mpsc::Receiver<RequestEvent>) -> UnboundedReceiver<RequestEvent> {
    let (tx, out) = unbounded_channel();
    tokio::task::spawn_blocking(move || {
        while let Ok(event) = rx.recv() {
            let terminal = event.is_terminal();
            if tx.send(event).is_err() || terminal {
                break;
            }
        }
    });
    out
}

/// The status of a request the engine failed.
pub fn engine_status(e: &RequestError) -> Status {
    pd_proto::convert::status(e.kind, e.message.clone())
}

/// The engine's channel closed without a terminal event.
pub fn engine_gone() -> Status {
    Status::unavailable(
        "the engine stopped before finishing the request (it failed or the node is shutting down)",
    )
}
