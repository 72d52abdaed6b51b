//! The OpenAI-compatible HTTP API (`--http-port`): `POST /v1/completions`,
//! `POST /v1/chat/completions` (both streamed as server-sent events with `"stream": true`),
//! `GET /v1/models`, vLLM's `POST /tokenize` and `POST /detokenize`, and `GET /health`.
//! `/metrics` is served on `--metrics-port` only, never on this port: the API port is the
//! one clients reach, the metrics port the one monitoring reaches.
//!
//! With `--api-keys`, every route but `/health` needs `Authorization: Bearer KEY`
//! ([`crate::auth::require_key`]); the key's tenant goes with the request.
//!
//! A request here becomes one `pd.v1.GenerateRequest` per prompt and choice ([`request`]),
//! each run through the very service the gRPC API runs (validation, routing, the
//! prefill/decode flow, the request metrics), so the two APIs accept, refuse, count and
//! cancel alike. A client that disconnects cancels its generations, as a gRPC client that
//! drops its stream does.
//!
//! Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}` with the HTTP status
//! of the gRPC code ([`http_status`]); an error after a stream started is one `data:` event
//! carrying that object, followed by `data: [DONE]`.
//!
//! Chat answers are read for reasoning and tool calls when the router runs with
//! `--reasoning-parser` / `--tool-call-parser` ([`crate::parse`], which the gRPC API shares).
//! Not here: images and audio.

pub mod request;
pub mod response;
mod run;
mod tokens;

use std::future::Future;
use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tonic::Code;

use self::request::{BadRequest, Endpoint};
use crate::metrics::MeteredGeneration;
use crate::service::Shared;

/// What the handlers share.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    generation: MeteredGeneration,
    shared: Arc<Shared>,
    /// `--reasoning-parser` is set.
    reasoning: bool,
    /// `--tool-call-parser` is set.
    tools: bool,
    /// `--tool-call-parser qwen3_coder`.
    coder: bool,
}

impl Api {
    pub fn new(
        generation: MeteredGeneration,
        shared: Arc<Shared>,
        reasoning: Option<crate::parse::ReasoningParser>,
        tools: Option<crate::parse::ToolCallParser>,
    ) -> Self {
        Self {
            generation,
            shared,
            reasoning: reasoning.is_some(),
            tools: tools.is_some(),
            coder: tools == Some(crate::parse::ToolCallParser::Qwen3Coder),
        }
    }

    /// Refuses a model the cluster does not serve with 404, as OpenAI answers it (the gRPC
    /// API says INVALID_ARGUMENT, as for every bad value). Absent or empty: the served one.
    fn refuse_model(&self, model: Option<&str>) -> Option<Response> {
        self.shared
            .validator
            .check_model(model.unwrap_or_default())
            .err()
            .map(|e| error(StatusCode::NOT_FOUND, &e.to_string()))
    }
}

/// Serves the API on `listener` until `shutdown` completes, then lets the requests in flight
/// finish. Bodies above `max_body_bytes` are refused with 413; `limits` bound the
/// connections (header timeout, connection cap).
pub(crate) async fn serve(
    listener: pd_tls::Listener,
    api: Api,
    max_body_bytes: usize,
    limits: pd_tls::HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let auth = api.shared.auth.clone();
    // Completions take an admission slot (after the key check, before the body is read).
    let admit = || {
        axum::middleware::from_fn_with_state(
            api.shared.admission.clone(),
            crate::admission::admit_http,
        )
    };
    let app = axum::Router::new()
        .route("/v1/completions", post(completions).layer(admit()))
        .route(
            "/v1/chat/completions",
            post(chat_completions).layer(admit()),
        )
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        // Every route above needs a key (when there are keys); the ones below do not.
        .route_layer(axum::middleware::from_fn_with_state(
            auth,
            crate::auth::require_key,
        ))
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(api);
    pd_tls::serve_http(listener, app, limits, shutdown).await
}

/// A body the server could not read (too large, cut off): its status, as OpenAI's error.
type BodyResult = Result<Bytes, BytesRejection>;

/// What an admitted request is charged to (`crate::limits`), when its tenant has limits.
type Charged = Option<Extension<crate::limits::Account>>;

async fn completions(
    State(api): State<Api>,
    Extension(tenant): Extension<crate::tenant::Tenant>,
    account: Charged,
    headers: HeaderMap,
    body: BodyResult,
) -> Response {
    let account = account.map(|Extension(a)| a);
    match body {
        Ok(body) => run::handle(api, tenant, account, Endpoint::Completions, &headers, &body).await,
        Err(e) => error(e.status(), &e.body_text()),
    }
}

async fn chat_completions(
    State(api): State<Api>,
    Extension(tenant): Extension<crate::tenant::Tenant>,
    account: Charged,
    headers: HeaderMap,
    body: BodyResult,
) -> Response {
    let account = account.map(|Extension(a)| a);
    match body {
        Ok(body) => {
            run::handle(
                api,
                tenant,
                account,
                Endpoint::ChatCompletions,
                &headers,
                &body,
            )
            .await
        }
        Err(e) => error(e.status(), &e.body_text()),
    }
}

async fn tokenize(State(api): State<Api>, body: BodyResult) -> Response {
    match body {
        Ok(body) => tokens::tokenize(api, &body).await,
        Err(e) => error(e.status(), &e.body_text()),
    }
}

async fn detokenize(State(api): State<Api>, body: BodyResult) -> Response {
    match body {
        Ok(body) => tokens::detokenize(api, &body).await,
        Err(e) => error(e.status(), &e.body_text()),
    }
}

async fn models(State(api): State<Api>) -> Response {
    let model = &api.shared.model;
    let context = api
        .shared
        .registry
        .context_len(model.max_position_embeddings());
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": model.name,
                "object": "model",
                "created": run::unix_now(),
                "owned_by": "pd-cluster",
                "root": model.name,
                "max_model_len": context,
            }],
        }),
    )
}

/// 200 while the router can serve (a healthy prefill/decode path), 503 otherwise: the same
/// answer as its gRPC health check.
async fn health(State(api): State<Api>) -> Response {
    if *api.shared.registry.serving().borrow() {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy path through the cluster's nodes yet",
        )
    }
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "no such route: the API is POST /v1/completions, POST /v1/chat/completions, \
         GET /v1/models, POST /tokenize, POST /detokenize and GET /health (/metrics is on the \
         router's --metrics-port)",
    )
}

/// The HTTP status of a gRPC code.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Ok | Code::Cancelled | Code::Unknown | Code::Internal | Code::DataLoss => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// OpenAI's error object.
pub fn error_body(status: StatusCode, message: &str) -> serde_json::Value {
    let kind = match status.as_u16() {
        400 | 413 => "invalid_request_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 => "service_unavailable_error",
        504 => "timeout_error",
        _ => "server_error",
    };
    json!({
        "error": {
            "message": message,
            "type": kind,
            "param": null,
            "code": status.as_u16(),
        }
    })
}

pub fn error(status: StatusCode, message: &str) -> Response {
    json_response(status, &error_body(status, message))
}

pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        error(StatusCode::BAD_REQUEST, &self.0)
    }
}
