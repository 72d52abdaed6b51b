//! Client authentication: API keys (`--api-keys FILE`), the tenant each key stands for, and
//! the checks on the two client APIs.
//!
//! - gRPC: every `pd.v1.Generation` call must carry the metadata `authorization: Bearer KEY`
//!   ([`GrpcAuth`], wrapping the service); otherwise UNAUTHENTICATED. Health and server
//!   reflection stay open (they say nothing about anyone's requests).
//! - HTTP (the OpenAI-compatible API): `Authorization: Bearer KEY`, what every OpenAI client
//!   sends ([`require_key`], an axum middleware on every route but `/health`); otherwise 401
//!   with OpenAI's error body (`code: invalid_api_key`) and `WWW-Authenticate: Bearer`.
//!
//! A good key puts its [`Tenant`] in the request's extensions, where the service reads it.
//! Without `--api-keys` nothing is checked and every request is the `default` tenant's.
//! Messages never echo the key that was sent.
//!
//! The file is read at start (a bad file stops the router, naming the file and line) and
//! again whenever its modification time, size or inode change, polled every
//! [`RELOAD_INTERVAL`] (a Kubernetes Secret's volume swaps a symlink: the inode changes);
//! a bad new version is logged and the keys in use stay.
//!
//! Not here: what a tenant owns ([`crate::tenant`]).

pub mod keys;

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::extract::{Request as HttpRequest, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;

pub use self::keys::{KeyTable, KeysError};
use crate::tenant::Tenant;

/// How often the keys file's metadata is looked at.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Why a request was not let in. Each is UNAUTHENTICATED (gRPC) / 401 (HTTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error(
        "this router requires an API key: send it as `authorization: Bearer KEY` (the HTTP \
         header, or gRPC metadata); ask the operator for a key"
    )]
    Missing,
    #[error(
        "the authorization value must be `Bearer KEY` (the word Bearer, a space, then the API \
         key)"
    )]
    NotBearer,
    #[error(
        "the API key is not valid: it is not one of the router's keys (it may have been \
         rotated); ask the operator for a current key"
    )]
    Unknown,
}

impl From<AuthError> for Status {
    fn from(e: AuthError) -> Self {
        Status::unauthenticated(e.to_string())
    }
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

/// The keys of `--api-keys`, current as of the last good read of the file.
#[derive(Debug)]
struct ApiKeys {
    path: PathBuf,
    table: RwLock<Arc<KeyTable>>,
    /// The stamp of the version last read (good or bad), or of a failed look (None).
    seen: Mutex<Option<Stamp>>,
}

impl ApiKeys {
    fn table(&self) -> Arc<KeyTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the file again if it changed since the last look.
    fn reload_if_changed(&self) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let stamp = match Stamp::of(&self.path) {
            Ok(s) => s,
            Err(e) => {
                if seen.is_some() {
                    tracing::warn!(path = %self.path.display(), error = %e,
                        "cannot look at the API keys file; the keys in use stay");
                }
                *seen = None;
                return;
            }
        };
        if *seen == Some(stamp) {
            return;
        }
        *seen = Some(stamp);
        match KeyTable::load(&self.path) {
            Ok(table) => {
                tracing::info!(path = %self.path.display(), keys = table.len(),
                    tenants = table.tenants().len(), "API keys reloaded");
                *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
            }
            Err(e) => {
                tracing::warn!(error = %e, "the changed API keys file is not valid; the keys in use stay")
            }
        }
    }
}

/// The router's client authentication: off (everyone is the `default` tenant) or the keys of
/// `--api-keys`.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    keys: Option<Arc<ApiKeys>>,
}

impl Auth {
    /// No authentication.
    pub fn open() -> Self {
        Self::default()
    }

    /// The keys of `path`, read now (errors name the file and line).
    pub fn from_file(path: &Path) -> Result<Self, KeysError> {
        let seen = Stamp::of(path).ok();
        let table = KeyTable::load(path)?;
        tracing::info!(path = %path.display(), keys = table.len(),
            tenants = table.tenants().len(), "API keys loaded");
        Ok(Self {
            keys: Some(Arc::new(ApiKeys {
                path: path.to_path_buf(),
                table: RwLock::new(Arc::new(table)),
                seen: Mutex::new(seen),
            })),
        })
    }

    /// Whether keys are required.
    pub fn is_on(&self) -> bool {
        self.keys.is_some()
    }

    /// The tenants of the current keys (`default` alone without keys).
    pub fn tenants(&self) -> Vec<Tenant> {
        match &self.keys {
            None => vec![Tenant::default()],
            Some(keys) => keys.table().tenants(),
        }
    }

    /// The tenant of a request whose `authorization` value is `value` (None: not sent).
    pub fn check(&self, value: Option<&[u8]>) -> Result<Tenant, AuthError> {
        let Some(keys) = &self.keys else {
            return Ok(Tenant::default());
        };
        let value = value.ok_or(AuthError::Missing)?;
        let value = std::str::from_utf8(value).map_err(|_| AuthError::NotBearer)?;
        let (scheme, key) = value.trim().split_once(' ').ok_or(AuthError::NotBearer)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthError::NotBearer);
        }
        keys.table()
            .tenant_of(key.trim_start())
            .ok_or(AuthError::Unknown)
    }

    /// Polls the keys file for changes until the task is dropped (nothing without keys).
    pub fn spawn_reload(&self, tasks: &mut tokio::task::JoinSet<()>) {
        let Some(keys) = self.keys.clone() else {
            return;
        };
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let keys = keys.clone();
                // Reading a file is blocking I/O: off the async threads.
                let _ = tokio::task::spawn_blocking(move || keys.reload_if_changed()).await;
            }
        });
    }

    /// `service` behind these keys.
    pub fn grpc<S>(&self, service: S) -> GrpcAuth<S> {
        GrpcAuth {
            inner: service,
            auth: self.clone(),
        }
    }
}

/// A gRPC service that checks `authorization` metadata on every call before `S` sees it, and
/// puts the caller's [`Tenant`] in the request's extensions; UNAUTHENTICATED otherwise (the
/// request's body is never read).
#[derive(Debug, Clone)]
pub struct GrpcAuth<S> {
    inner: S,
    auth: Auth,
}

impl<S: NamedService> NamedService for GrpcAuth<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<Body>> for GrpcAuth<S>
where
    S: tonic::codegen::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let value = request
            .headers()
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes);
        match self.auth.check(value) {
            Ok(tenant) => {
                // tonic hands the HTTP request's extensions to the service's request.
                request.extensions_mut().insert(tenant);
                Box::pin(self.inner.call(request))
            }
            Err(e) => {
                let refused = Status::from(e).into_http();
                Box::pin(std::future::ready(Ok(refused)))
            }
        }
    }
}

/// Axum middleware: lets a request with a good `Authorization: Bearer KEY` through with its
/// [`Tenant`] in its extensions; answers 401 otherwise.
pub async fn require_key(
    State(auth): State<Auth>,
    mut request: HttpRequest,
    next: Next,
) -> Response {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match auth.check(value) {
        Ok(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        Err(e) => unauthorized(e),
    }
}

/// 401 with OpenAI's error body for a rejected key.
fn unauthorized(e: AuthError) -> Response {
    let body = json!({
        "error": {
            "message": e.to_string(),
            "type": "invalid_request_error",
            "param": null,
            "code": "invalid_api_key",
        }
    });
    (
        StatusCode::UNAUTHORIZED,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::WWW_AUTHENTICATE, "Bearer"),
        ],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(text: &str) -> (Auth, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, text).unwrap();
        (Auth::from_file(&path).unwrap(), dir)
    }

    #[test]
    fn bearer_keys_name_their_tenant() {
        let (auth, _dir) = auth("acme acme-key-0123456789\n");
        assert!(auth.is_on());
        let ok = |v: &str| auth.check(Some(v.as_bytes()));
        assert_eq!(ok("Bearer acme-key-0123456789").unwrap().as_str(), "acme");
        assert_eq!(ok("bearer  acme-key-0123456789 ").unwrap().as_str(), "acme");
        assert_eq!(auth.check(None), Err(AuthError::Missing));
        assert_eq!(ok("acme-key-0123456789"), Err(AuthError::NotBearer));
        assert_eq!(ok("Basic acme-key-0123456789"), Err(AuthError::NotBearer));
        assert_eq!(ok("Bearer acme-key-012345678"), Err(AuthError::Unknown));
        assert_eq!(auth.check(Some(b"Bearer \xff")), Err(AuthError::NotBearer));
        assert_eq!(Auth::open().check(None).unwrap().as_str(), Tenant::DEFAULT);
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_bad_one_keeps_the_keys() {
        let (auth, dir) = auth("a key-one-0123456789\n");
        let path = dir.path().join("keys");
        let keys = auth.keys.clone().unwrap();
        let check = |k: &str| auth.check(Some(format!("Bearer {k}").as_bytes()));
        // Another inode (a rename over the file, as a Secret volume or an editor does).
        let next = dir.path().join("keys.new");
        std::fs::write(&next, "b key-two-0123456789\n").unwrap();
        std::fs::rename(&next, &path).unwrap();
        keys.reload_if_changed();
        assert_eq!(check("key-one-0123456789"), Err(AuthError::Unknown));
        assert_eq!(check("key-two-0123456789").unwrap().as_str(), "b");
        std::fs::write(&next, "b\n").unwrap();
        std::fs::rename(&next, &path).unwrap();
        keys.reload_if_changed();
        assert_eq!(check("key-two-0123456789").unwrap().as_str(), "b");
        std::fs::remove_file(&path).unwrap();
        keys.reload_if_changed();
        assert_eq!(check("key-two-0123456789").unwrap().as_str(), "b");
    }
}
