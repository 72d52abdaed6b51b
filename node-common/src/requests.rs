//! The requests a node is serving: one registry per node (for `Abort`, draining and the
//! duplicate-id check), guards that abort an engine request whose caller went away, and the
//! bridge from the engine's blocking event channel into async code.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use pd_engine::serve::{EngineHandle, RequestError, RequestEvent, RequestId};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tonic::Status;

/// Open requests of a node and whether it is draining.
#[derive(Debug)]
pub struct Requests {
    engine: EngineHandle,
    draining: AtomicBool,
    open: Mutex<HashSet<RequestId>>,
}

impl Requests {
    pub fn new(engine: EngineHandle) -> Arc<Self> {
        Arc::new(Self {
            engine,
            draining: AtomicBool::new(false),
            open: Mutex::new(HashSet::new()),
        })
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    fn open(&self) -> MutexGuard<'_, HashSet<RequestId>> {
        // A panic while holding this lock cannot leave the set inconsistent (single inserts
        // and removes), so a poisoned lock is still usable.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register a new request. Refused with UNAVAILABLE while draining and with
    /// INVALID_ARGUMENT if the id is open already. Dropping the guard before
    /// [`RequestGuard::finished`] aborts the engine request.
    pub fn begin(self: &Arc<Self>, id: &RequestId) -> Result<RequestGuard, Status> {
        if self.is_draining() {
            return Err(Status::unavailable(
                "this node is draining (shutting down) and takes no new requests; send it to another node",
            ));
        }
        if !self.open().insert(id.clone()) {
            return Err(Status::invalid_argument(format!(
                "request id {id:?} is already in use on this node: request ids must be unique among open requests"
            )));
        }
        Ok(RequestGuard {
            requests: Arc::clone(self),
            id: id.clone(),
            finished: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Abort an open request; false if this node has no such request.
    pub fn abort(&self, id: &RequestId) -> bool {
        let open = self.open().contains(id);
        if open {
            self.engine.abort(id.clone());
        }
        open
    }

    /// Abort every open request (the end of a drain).
    pub fn abort_all(&self) {
        let ids: Vec<RequestId> = self.open().iter().cloned().collect();
        for id in ids {
            self.engine.abort(id);
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
    finished: Arc<AtomicBool>,
}

impl RequestGuard {
    pub fn id(&self) -> &RequestId {
        &self.id
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
            let terminal = !matches!(event, RequestEvent::Token(_));
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
    Status::unavailable("the engine stopped before finishing the request (it failed or the node is shutting down)")
}
