//! The leases this node has handed out: the set the drain waits on ([`Leases`]) and the
//! guard that releases a lease nobody received ([`LeaseGuard`]). The engine owns the leased
//! blocks; this only tracks and releases leases.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use pd_engine::serve::{EngineHandle, KvLease};

/// Leases handed out and not released yet, with their deadlines (for the drain: decode
/// nodes may still be pulling them).
#[derive(Debug, Default)]
pub(crate) struct Leases(Mutex<HashMap<u64, Instant>>);

impl Leases {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Instant>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn insert(&self, id: u64, deadline: Instant) {
        self.map().insert(id, deadline);
    }

    pub(crate) fn remove(&self, id: u64) {
        self.map().remove(&id);
    }

    /// No lease is outstanding (expired ones are forgotten).
    pub(crate) fn is_empty(&self) -> bool {
        let now = Instant::now();
        let mut map = self.map();
        map.retain(|_, deadline| *deadline > now);
        map.is_empty()
    }
}

/// A lease not handed to anyone yet: released when dropped unless [`LeaseGuard::keep`] is
/// called (a prefill whose caller went away must not pin blocks until the lease expires).
pub(crate) struct LeaseGuard {
    pub(crate) engine: EngineHandle,
    pub(crate) lease: Option<KvLease>,
}

impl LeaseGuard {
    pub(crate) fn keep(mut self) -> KvLease {
        self.lease
            .take()
            .expect("a guard holds its lease until kept")
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let engine = self.engine.clone();
        let release = move || {
            engine.release_lease(lease.lease_id, lease.secret);
            tracing::debug!(
                lease_id = lease.lease_id,
                "released the lease of a prefill nobody received"
            );
        };
        // Releasing waits for the engine thread: never on an async worker.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(release)),
            Err(_) => release(),
        }
    }
}
