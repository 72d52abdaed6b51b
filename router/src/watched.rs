//! Configuration files the router reads at start and again whenever they change: the API keys
//! (`--api-keys`) and the tenant limits (`--tenant-limits`).
//!
//! A [`Watched`] file is read once at start (a bad file stops the router; the error names the
//! file and line) and then looked at every [`RELOAD_INTERVAL`]: when its modification time,
//! size or inode changed (a Kubernetes Secret or ConfigMap volume swaps a symlink, so the
//! inode changes), it is read again. A valid new version replaces the one in use; a bad one is
//! logged and the version in use stays. Each read of a changed file is counted on
//! `pd_router_file_reloads_total{file,result}`.
//!
//! Not here: what the files mean ([`crate::auth::keys`], [`crate::limits::file`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use crate::metrics::{ReloadResult, RouterMetrics, WatchedFileKind};

/// How often a watched file's metadata is looked at.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// What a watched file's contents become.
pub(crate) trait WatchedFile: Sized + Send + Sync + 'static {
    /// Why a version of the file cannot be used (it names the file and line).
    type Error: std::fmt::Display;
    /// Which file it is, for logs and metrics.
    const KIND: WatchedFileKind;

    /// Reads and parses the file at `path`.
    fn load(path: &Path) -> Result<Self, Self::Error>;
}

/// The file's identity and version, as far as metadata tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl Stamp {
    fn of(path: &Path) -> std::io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Ok(Self {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode,
        })
    }
}

/// What one look at a watched file did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// Unchanged since the last look.
    Unchanged,
    /// Its metadata cannot be read (missing for a moment mid-rotation): nothing changes.
    Unreadable,
    /// Changed and read: `result`.
    Read(ReloadResult),
}

/// The contents of a file, current as of its last good read.
#[derive(Debug)]
pub(crate) struct Watched<T> {
    path: PathBuf,
    current: RwLock<Arc<T>>,
    /// The stamp of the version last read (good or bad), or of a failed look (None).
    seen: Mutex<Option<Stamp>>,
}

impl<T: WatchedFile> Watched<T> {
    /// Reads `path` now.
    pub fn load(path: &Path) -> Result<Self, T::Error> {
        let seen = Stamp::of(path).ok();
        let value = T::load(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(value)),
            seen: Mutex::new(seen),
        })
    }

    /// The version in use.
    pub fn current(&self) -> Arc<T> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Reads the file again if it changed since the last look.
    pub fn reload_if_changed(&self) -> Look {
        let what = T::KIND.as_str();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let stamp = match Stamp::of(&self.path) {
            Ok(s) => s,
            Err(e) => {
                if seen.is_some() {
                    tracing::warn!(file = what, path = %self.path.display(), error = %e,
                        "cannot look at the file; the version in use stays");
                }
                *seen = None;
                return Look::Unreadable;
            }
        };
        if *seen == Some(stamp) {
            return Look::Unchanged;
        }
        *seen = Some(stamp);
        match T::load(&self.path) {
            Ok(value) => {
                tracing::info!(file = what, path = %self.path.display(), "file reloaded");
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(value);
                Look::Read(ReloadResult::Loaded)
            }
            Err(e) => {
                tracing::warn!(file = what, error = %e,
                    "the changed file is not valid; the version in use stays");
                Look::Read(ReloadResult::Refused)
            }
        }
    }

    /// Looks at the file every [`RELOAD_INTERVAL`] until the task is dropped, counting every
    /// read of a changed version on `metrics`.
    pub fn spawn_reload(
        self: &Arc<Self>,
        metrics: Arc<RouterMetrics>,
        tasks: &mut tokio::task::JoinSet<()>,
    ) {
        metrics.add_watched_file(T::KIND);
        let watched = self.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let watched = watched.clone();
                // Reading a file is blocking I/O: off the async threads.
                let look = tokio::task::spawn_blocking(move || watched.reload_if_changed()).await;
                if let Ok(Look::Read(result)) = look {
                    metrics.file_reloaded(T::KIND, result);
                }
            }
        });
    }
}
