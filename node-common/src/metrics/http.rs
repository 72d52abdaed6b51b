//! The node's `/metrics` endpoint: plain HTTP/1.1 on its own listener (`--metrics-port`), so
//! Prometheus scrapes it without touching the gRPC port.

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;

use super::encode;
use super::node::NodeMetrics;

/// The scrape path.
pub const PATH: &str = "/metrics";

async fn scrape(State(metrics): State<Arc<NodeMetrics>>) -> impl IntoResponse {
    ([(CONTENT_TYPE, encode::CONTENT_TYPE)], metrics.render())
}

/// Serve `GET /metrics` on `listener` (TLS when it has it) until `shutdown` resolves (other paths: 404, other
/// methods: 405).
pub async fn serve(
    listener: pd_tls::Listener,
    metrics: Arc<NodeMetrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route(PATH, get(scrape))
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
