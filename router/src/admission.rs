//! Admission control: how many client requests the router serves at once (`--max-inflight`),
//! how many more may wait for a slot (`--max-queue`) and for how long (`--queue-timeout`),
//! and the refusal past that: RESOURCE_EXHAUSTED over gRPC, HTTP 429 with `Retry-After` over
//! the HTTP API, decided at arrival (a full queue refuses without waiting).
//!
//! One [`Admission`] is shared by both APIs, so `--max-inflight` bounds their sum. The unit is
//! a client request: a gRPC `Generate` call or an HTTP completion, whatever its `n` or number
//! of prompts. A slot is held from admission until the response stream ends (or the client
//! goes away): [`Holding`] keeps the [`Permit`] inside the response body.
//!
//! Slots are handed out first come, first served (tokio's semaphore queues its waiters in
//! order). A refusal is counted on `pd_router_requests_rejected_total{reason}`, and as a
//! request that ended with `resource_exhausted` on `pd_router_requests_total` and the
//! tenant's `pd_router_tenant_requests_total`, like any other request refused before its
//! stream started.
//!
//! The same gate checks a request against its tenant's limits first (`--tenant-limits`,
//! [`crate::limits`]), when there are any: a tenant over a limit is refused the same way (its
//! retry hint the seconds until its bucket has room) without taking a slot or a place in the
//! queue, and an admitted request carries its [`Account`] in its extensions, to be charged
//! what it uses.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;
use tonic::body::Body as GrpcBody;
use tonic::codegen::http;
use tonic::server::NamedService;

use crate::auth::KeyId;
use crate::limits::{Account, LimitRefusal, TenantLimits};
use crate::metrics::{RejectReason, RouterMetrics};
use crate::tenant::Tenant;

/// What a refused client is told to wait before it tries again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The limits (`--max-inflight`, `--max-queue`, `--queue-timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Client requests served at once; `None`: no limit (nothing ever queues).
    pub max_inflight: Option<usize>,
    /// Requests that may wait for a slot; 0: none wait, a request without a slot is refused.
    pub max_queue: usize,
    /// The longest a request waits for a slot before it is refused.
    pub queue_timeout: Duration,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self {
            max_inflight: Some(256),
            max_queue: 128,
            queue_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error(
        "the router is at capacity ({max_inflight} requests in flight, {max_queue} waiting); \
         retry after {}s (the router's --max-inflight and --max-queue)",
        RETRY_AFTER.as_secs()
    )]
    QueueFull {
        max_inflight: usize,
        max_queue: usize,
    },
    #[error(
        "the router is at capacity: no slot freed within the queue timeout ({timeout:?}); \
         retry after {}s (the router's --max-inflight and --queue-timeout)",
        RETRY_AFTER.as_secs()
    )]
    QueueTimeout { timeout: Duration },
}

impl Refusal {
    /// The metric label of the refusal.
    pub fn reason(&self) -> RejectReason {
        match self {
            Refusal::QueueFull { .. } => RejectReason::QueueFull,
            Refusal::QueueTimeout { .. } => RejectReason::QueueTimeout,
        }
    }

    /// The gRPC status: RESOURCE_EXHAUSTED, with the retry hint gRPC clients read
    /// (`grpc-retry-pushback-ms`, honoured by retry policies) and `retry-after` in seconds.
    pub fn status(&self) -> Status {
        exhausted(&self.to_string(), RETRY_AFTER)
    }
}

/// RESOURCE_EXHAUSTED with `message` and the retry hint `retry_after` (whole seconds) as
/// `grpc-retry-pushback-ms` and `retry-after`.
pub fn exhausted(message: &str, retry_after: Duration) -> Status {
    let mut status = Status::resource_exhausted(message);
    let metadata = status.metadata_mut();
    let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
    metadata.insert("grpc-retry-pushback-ms", millis.into());
    metadata.insert("retry-after", retry_after.as_secs().into());
    status
}

/// HTTP 429 with OpenAI's error body of `message` and `Retry-After` in whole seconds.
pub fn too_many_requests(message: &str, retry_after: Duration) -> Response {
    let mut response = crate::openai::error(StatusCode::TOO_MANY_REQUESTS, message);
    response.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(retry_after.as_secs()),
    );
    response
}

impl LimitRefusal {
    /// The gRPC status of the refusal: as admission's, with this refusal's retry hint.
    pub fn status(&self) -> Status {
        exhausted(&self.to_string(), self.retry_after())
    }
}

/// The router's admission state (one per router, shared by the gRPC and HTTP APIs).
#[derive(Debug)]
pub struct Admission {
    limits: AdmissionLimits,
    /// `None` without `--max-inflight`.
    slots: Option<Arc<Semaphore>>,
    /// Requests waiting for a slot now.
    queued: AtomicUsize,
    metrics: Arc<RouterMetrics>,
    /// `--tenant-limits`, checked before a slot is taken.
    tenant_limits: Option<Arc<TenantLimits>>,
}

/// A request's slot; given back on drop.
#[derive(Debug)]
pub struct Permit {
    _slot: Option<OwnedSemaphorePermit>,
}

/// One waiting request: counted in the queue until dropped.
struct Waiting<'a>(&'a Admission);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.model.queued.decrement(1.0);
    }
}

impl Admission {
    pub fn new(limits: AdmissionLimits, metrics: Arc<RouterMetrics>) -> Self {
        Self {
            slots: limits.max_inflight.map(|n| Arc::new(Semaphore::new(n))),
            limits,
            queued: AtomicUsize::new(0),
            metrics,
            tenant_limits: None,
        }
    }

    /// This admission, checking requests against `limits` first.
    pub fn with_limits(mut self, limits: Option<Arc<TenantLimits>>) -> Self {
        self.tenant_limits = limits;
        self
    }

    /// Checks a request of `tenant` (and `key`) against the tenant limits: its account to
    /// charge (`None` without limits on it), or the refusal (counted).
    pub fn check_limits(
        &self,
        tenant: &Tenant,
        key: Option<&KeyId>,
    ) -> Result<Option<Account>, LimitRefusal> {
        match &self.tenant_limits {
            None => Ok(None),
            Some(limits) => limits.admit(tenant, key),
        }
    }

    /// A slot for `tenant`'s request: at once if one is free, after a wait in the queue if
    /// the queue has room, else refused at once. A refusal is counted here.
    pub async fn admit(&self, tenant: &Tenant) -> Result<Permit, Refusal> {
        let result = self.acquire().await;
        if let Err(refusal) = &result {
            tracing::debug!(%tenant, reason = refusal.reason().as_str(), "request refused");
            self.metrics.rejected(tenant, refusal.reason());
        }
        result
    }

    async fn acquire(&self) -> Result<Permit, Refusal> {
        let Some(slots) = &self.slots else {
            return Ok(Permit { _slot: None });
        };
        // With waiters queued, try_acquire finds no permit: released slots go to them first.
        if let Ok(slot) = slots.clone().try_acquire_owned() {
            return Ok(Permit { _slot: Some(slot) });
        }
        let max_inflight = self.limits.max_inflight.unwrap_or_default();
        let max_queue = self.limits.max_queue;
        // Reserve a place in the queue, or refuse without waiting.
        let reserved = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < max_queue).then_some(q + 1)
            });
        if reserved.is_err() {
            return Err(Refusal::QueueFull {
                max_inflight,
                max_queue,
            });
        }
        self.metrics.model.queued.increment(1.0);
        let waiting = Waiting(self);
        let timeout = self.limits.queue_timeout;
        let slot = tokio::time::timeout(timeout, slots.clone().acquire_owned()).await;
        drop(waiting);
        match slot {
            Ok(Ok(slot)) => Ok(Permit { _slot: Some(slot) }),
            // The semaphore is never closed; were it, no slot would ever come.
            Ok(Err(_)) | Err(_) => Err(Refusal::QueueTimeout { timeout }),
        }
    }
}

/// A response body that holds its request's [`Permit`] until it ends or is dropped.
#[derive(Debug)]
pub struct Holding<B> {
    inner: B,
    permit: Option<Permit>,
}

impl<B> Holding<B> {
    pub fn new(inner: B, permit: Permit) -> Self {
        Self {
            inner,
            permit: Some(permit),
        }
    }
}

impl<B> HttpBody for Holding<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            // The body ended: the slot is free even if the connection lingers.
            this.permit = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The gRPC path of `Generate`, the one call admission applies to.
const GENERATE_PATH: &str = "/pd.v1.Generation/Generate";

/// The gRPC service `S` (`pd.v1.Generation`) with admission on `Generate`: a call takes a
/// slot before its message is even read, and holds it in its response body; a refused one
/// is answered RESOURCE_EXHAUSTED with a retry hint. Other calls (`Abort`, `Tokenize`,
/// `ListModels`) pass: cheap, and an `Abort` must never wait behind the work it cancels.
#[derive(Debug, Clone)]
pub struct Admitted<S> {
    inner: S,
    admission: Arc<Admission>,
}

impl<S> Admitted<S> {
    pub fn new(inner: S, admission: Arc<Admission>) -> Self {
        Self { inner, admission }
    }
}

impl<S: NamedService> NamedService for Admitted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<GrpcBody>> for Admitted<S>
where
    S: tonic::codegen::Service<
            http::Request<GrpcBody>,
            Response = http::Response<GrpcBody>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<GrpcBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<GrpcBody>) -> Self::Future {
        if request.uri().path() != GENERATE_PATH {
            return Box::pin(self.inner.call(request));
        }
        // The service that was made ready goes with this call; its clone stays for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let admission = self.admission.clone();
        Box::pin(async move {
            let mut request = request;
            let tenant = crate::service::tenant_of(request.extensions());
            let key = request.extensions().get::<KeyId>();
            match admission.check_limits(&tenant, key) {
                Ok(Some(account)) => {
                    request.extensions_mut().insert(account);
                }
                Ok(None) => {}
                Err(refusal) => return Ok(refusal.status().into_http()),
            }
            match admission.admit(&tenant).await {
                Ok(permit) => {
                    let response = inner.call(request).await?;
                    Ok(response.map(|body| GrpcBody::new(Holding::new(body, permit))))
                }
                Err(refusal) => Ok(refusal.status().into_http()),
            }
        })
    }
}

/// Axum middleware of the HTTP API's completion routes: admission as for gRPC, answered
/// 429 with `Retry-After` and OpenAI's error body when refused (the request body is not read).
pub async fn admit_http(
    State(admission): State<Arc<Admission>>,
    mut request: axum::extract::Request,
    next: Next,
) -> Response {
    let tenant = request
        .extensions()
        .get::<Tenant>()
        .cloned()
        .unwrap_or_default();
    let key = request.extensions().get::<KeyId>();
    match admission.check_limits(&tenant, key) {
        Ok(Some(account)) => {
            request.extensions_mut().insert(account);
        }
        Ok(None) => {}
        Err(refusal) => {
            return too_many_requests(&refusal.to_string(), refusal.retry_after());
        }
    }
    match admission.admit(&tenant).await {
        Ok(permit) => next
            .run(request)
            .await
            .map(|body| axum::body::Body::new(Holding::new(body, permit))),
        Err(refusal) => too_many_requests(&refusal.to_string(), RETRY_AFTER),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_inflight: usize, max_queue: usize, timeout_ms: u64) -> Admission {
        let metrics = Arc::new(RouterMetrics::new("m", None).unwrap());
        Admission::new(
            AdmissionLimits {
                max_inflight: Some(max_inflight),
                max_queue,
                queue_timeout: Duration::from_millis(timeout_ms),
            },
            metrics,
        )
    }

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_a_freed_slot_goes_to_the_waiter() {
        let a = Arc::new(admission(1, 1, 60_000));
        let t = Tenant::default();
        let first = a.admit(&t).await.unwrap();
        let waiter = {
            let (a, t) = (a.clone(), t.clone());
            tokio::spawn(async move { a.admit(&t).await })
        };
        while a.queued.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        // The queue is full: refused without waiting (the test would hang otherwise).
        assert!(matches!(
            a.admit(&t).await,
            Err(Refusal::QueueFull {
                max_inflight: 1,
                max_queue: 1
            })
        ));
        assert!(!waiter.is_finished());
        drop(first);
        assert!(waiter.await.unwrap().is_ok());
        assert_eq!(a.queued.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn a_wait_past_the_queue_timeout_is_refused() {
        let a = admission(1, 4, 50);
        let t = Tenant::default();
        let _held = a.admit(&t).await.unwrap();
        let refused = a.admit(&t).await.unwrap_err();
        assert_eq!(refused.reason(), RejectReason::QueueTimeout);
        let status = refused.status();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(status.metadata().get("retry-after").unwrap(), "1");
        assert_eq!(a.queued.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn no_limit_never_waits() {
        let metrics = Arc::new(RouterMetrics::new("m", None).unwrap());
        let a = Admission::new(
            AdmissionLimits {
                max_inflight: None,
                max_queue: 0,
                queue_timeout: Duration::from_secs(1),
            },
            metrics,
        );
        let mut held = Vec::new();
        for _ in 0..1000 {
            held.push(a.admit(&Tenant::default()).await.unwrap());
        }
    }
}
