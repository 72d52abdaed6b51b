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
//! A good key also puts its [`KeyId`] there (the hex SHA-256 of the key, never the key), which
//! per-key limits are looked up by ([`crate::limits`]).
//!
//! The file is read at start (a bad file stops the router, naming the file and line) and
//! again whenever it changes (`crate::watched`); a bad new version is logged and the keys
//! in use stay.
//!
//! Not here: what a tenant owns ([`crate::tenant`]).

pub mod keys;

use std::convert::Infallible;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{Request as HttpRequest, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;

pub use self::keys::{KeyId, KeyTable, KeysError};
use crate::metrics::{RouterMetrics, WatchedFileKind};
use crate::tenant::Tenant;
pub use crate::watched::RELOAD_INTERVAL;
use crate::watched::{Watched, WatchedFile};

impl WatchedFile for KeyTable {
    type Error = KeysError;
    const KIND: WatchedFileKind = WatchedFileKind::ApiKeys;

    fn load(path: &Path) -> Result<Self, KeysError> {
        KeyTable::load(path)
    }
}

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

/// The router's client authentication: off (everyone is the `default` tenant) or the keys of
/// `--api-keys`.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    keys: Option<Arc<Watched<KeyTable>>>,
}

impl Auth {
    /// No authentication.
    pub fn open() -> Self {
        Self::default()
    }

    /// The keys of `path`, read now (errors name the file and line).
    pub fn from_file(path: &Path) -> Result<Self, KeysError> {
        let keys = Watched::<KeyTable>::load(path)?;
        let table = keys.current();
        tracing::info!(path = %path.display(), keys = table.len(),
            tenants = table.tenants().len(), "API keys loaded");
        Ok(Self {
            keys: Some(Arc::new(keys)),
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
            Some(keys) => keys.current().tenants(),
        }
    }

    /// The tenant of a request whose `authorization` value is `value` (None: not sent).
    pub fn check(&self, value: Option<&[u8]>) -> Result<Tenant, AuthError> {
        self.caller(value).map(|(tenant, _)| tenant)
    }

    /// The tenant and key of a request whose `authorization` value is `value` (no key
    /// without `--api-keys`).
    pub fn caller(&self, value: Option<&[u8]>) -> Result<(Tenant, Option<KeyId>), AuthError> {
        let Some(keys) = &self.keys else {
            return Ok((Tenant::default(), None));
        };
        let value = value.ok_or(AuthError::Missing)?;
        let value = std::str::from_utf8(value).map_err(|_| AuthError::NotBearer)?;
        let (scheme, key) = value.trim().split_once(' ').ok_or(AuthError::NotBearer)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthError::NotBearer);
        }
        let (tenant, key) = (keys.current())
            .lookup(key.trim_start())
            .ok_or(AuthError::Unknown)?;
        Ok((tenant, Some(key)))
    }

    /// Polls the keys file for changes until the task is dropped (nothing without keys).
    pub fn spawn_reload(&self, metrics: Arc<RouterMetrics>, tasks: &mut tokio::task::JoinSet<()>) {
        if let Some(keys) = &self.keys {
            keys.spawn_reload(metrics, tasks);
        }
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
/// puts the caller's [`Tenant`] and [`KeyId`] in the request's extensions; UNAUTHENTICATED otherwise (the
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
        match self.auth.caller(value) {
            Ok((tenant, key)) => {
                // tonic hands the HTTP request's extensions to the service's request.
                request.extensions_mut().insert(tenant);
                if let Some(key) = key {
                    request.extensions_mut().insert(key);
                }
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
/// [`Tenant`] and [`KeyId`] in its extensions; answers 401 otherwise.
pub async fn require_key(
    State(auth): State<Auth>,
    mut request: HttpRequest,
    next: Next,
) -> Response {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match auth.caller(value) {
        Ok((tenant, key)) => {
            request.extensions_mut().insert(tenant);
            if let Some(key) = key {
                request.extensions_mut().insert(key);
            }
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
        assert_eq!(
            auth.caller(Some(b"Bearer key-two-0123456789"))
                .unwrap()
                .1
                .unwrap()
                .hex(),
            "bddf9699d691b9e1dca55302c88695ccf3da92bf74543804363977e1c3b4e93d"
        );
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
