//! Configurations rebuilt when their files change. cert-manager (and a kubelet updating a
//! mounted Secret) rewrites certificate files in place; each new handshake asks for the
//! current configuration, which re-reads the files at most once per check interval and
//! rebuilds when their contents differ. Connections already open keep the configuration they
//! were made with. A rebuild that fails (a half-written pair, a key that does not match)
//! keeps the previous configuration and logs a warning once per distinct content.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::TlsError;
use crate::material::FileBytes;

/// How often the files are looked at, at most (one look per new connection otherwise).
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);

type Build<T> = dyn Fn(&[FileBytes]) -> Result<T, TlsError> + Send + Sync;

/// A configuration of type `T` built from files, rebuilt when they change.
pub(crate) struct Reloading<T> {
    files: Vec<(&'static str, PathBuf)>,
    build: Box<Build<T>>,
    check_interval: Duration,
    state: Mutex<State<T>>,
}

struct State<T> {
    current: Arc<T>,
    /// The contents `current` was built from.
    loaded: Vec<FileBytes>,
    checked: Instant,
    /// Contents whose rebuild failed (warned about once).
    rejected: Option<Vec<FileBytes>>,
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("files", &self.files)
            .field("check_interval", &self.check_interval)
            .finish_non_exhaustive()
    }
}

fn read_all(files: &[(&'static str, PathBuf)]) -> Result<Vec<FileBytes>, TlsError> {
    files
        .iter()
        .map(|(what, path)| FileBytes::read(what, path))
        .collect()
}

impl<T> Reloading<T> {
    /// Reads `files` and builds the first configuration: any failure is the caller's (at
    /// start, a process with unusable certificates must not start).
    pub fn new(
        files: Vec<(&'static str, PathBuf)>,
        check_interval: Duration,
        build: impl Fn(&[FileBytes]) -> Result<T, TlsError> + Send + Sync + 'static,
    ) -> Result<Self, TlsError> {
        let loaded = read_all(&files)?;
        let current = Arc::new(build(&loaded)?);
        Ok(Self {
            files,
            build: Box::new(build),
            check_interval,
            state: Mutex::new(State {
                current,
                loaded,
                checked: Instant::now(),
                rejected: None,
            }),
        })
    }

    /// The configuration new connections use, rebuilt first if the files changed.
    pub fn current(&self) -> Arc<T> {
        // A panic while holding the lock cannot leave the state torn: it is replaced whole.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.checked.elapsed() >= self.check_interval {
            state.checked = Instant::now();
            self.refresh(&mut state);
        }
        Arc::clone(&state.current)
    }

    fn refresh(&self, state: &mut State<T>) {
        let read = match read_all(&self.files) {
            Ok(read) => read,
            Err(e) => {
                // Mid-rotation a file can be missing for a moment; the next look retries.
                tracing::debug!(error = %e, "TLS files not readable now; keeping the loaded ones");
                return;
            }
        };
        if read == state.loaded || state.rejected.as_ref() == Some(&read) {
            return;
        }
        match (self.build)(&read) {
            Ok(config) => {
                state.current = Arc::new(config);
                state.loaded = read;
                state.rejected = None;
                tracing::info!(files = ?self.files, "TLS certificates reloaded");
            }
            Err(e) => {
                tracing::warn!(error = %e, "TLS files changed but cannot be used; \
                    new connections keep the previous certificates");
                state.rejected = Some(read);
            }
        }
    }
}
