//! The metrics port (`--metrics-port`): `GET /metrics` in Prometheus text exposition 0.0.4, and
//! `GET /health` for probes that reach this port only (Kubernetes over mTLS, where the gRPC port
//! wants a client certificate the kubelet does not have).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::RouterMetrics;
use crate::registry::Registry;

/// Prometheus's text format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone)]
struct Scrape {
    metrics: Arc<RouterMetrics>,
    registry: Arc<Registry>,
}

/// Serves `GET /metrics` and `GET /health` on `listener` (TLS when it has it) until the task is
/// dropped.
pub async fn serve(
    listener: pd_tls::Listener,
    metrics: Arc<RouterMetrics>,
    registry: Arc<Registry>,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route("/metrics", get(scrape))
        .route("/health", get(health))
        .with_state(Scrape { metrics, registry });
    // Never stops on its own: the task is dropped with the router.
    pd_tls::serve_http(
        listener,
        app,
        pd_tls::HttpLimits::METRICS,
        std::future::pending(),
    )
    .await
}

async fn scrape(State(s): State<Scrape>) -> Response {
    match s.metrics.render(&s.registry) {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// 200 while the router serves (a healthy path through its nodes), 503 otherwise: the same
/// answer as its gRPC health service.
async fn health(State(s): State<Scrape>) -> Response {
    if *s.registry.serving().borrow() {
        (StatusCode::OK, "SERVING\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n").into_response()
    }
}
