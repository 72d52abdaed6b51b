//! The `/metrics` HTTP endpoint (`--metrics-port`): Prometheus text exposition 0.0.4.

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

/// Serves `GET /metrics` on `listener` (TLS when it has it) until the task is dropped.
pub async fn serve(
    listener: pd_tls::Listener,
    metrics: Arc<RouterMetrics>,
    registry: Arc<Registry>,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route("/metrics", get(scrape))
        .with_state(Scrape { metrics, registry });
    axum::serve(listener, app).await
}

async fn scrape(State(s): State<Scrape>) -> Response {
    match s.metrics.render(&s.registry) {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
