//! The node's metrics port (`--metrics-port`): `GET /metrics` for Prometheus and `GET /health` for
//! probes, HTTP/1.1 on its own listener, so neither touches the gRPC port (which, under mTLS, wants
//! a cluster certificate that a kubelet or a scraper does not have).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;

use super::encode;
use super::node::NodeMetrics;

/// The scrape path.
pub const PATH: &str = "/metrics";

/// The probe path.
pub const HEALTH_PATH: &str = "/health";

#[derive(Clone)]
struct Shared {
    metrics: Arc<NodeMetrics>,
    serving: Arc<AtomicBool>,
}

async fn scrape(State(s): State<Shared>) -> impl IntoResponse {
    ([(CONTENT_TYPE, encode::CONTENT_TYPE)], s.metrics.render())
}

/// 200 while the node serves, 503 once its engine failed or it drains: the same answer as its
/// gRPC health service.
async fn health(State(s): State<Shared>) -> impl IntoResponse {
    if s.serving.load(Ordering::Relaxed) {
        (StatusCode::OK, "SERVING\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n")
    }
}

/// Serve `GET /metrics` and `GET /health` on `listener` (TLS when it has it) until `shutdown`
/// resolves (other paths: 404, other methods: 405). `serving` is what `/health` answers.
pub async fn serve(
    listener: pd_tls::Listener,
    metrics: Arc<NodeMetrics>,
    serving: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route(PATH, get(scrape))
        .route(HEALTH_PATH, get(health))
        .with_state(Shared { metrics, serving });
    pd_tls::serve_http(listener, app, pd_tls::HttpLimits::METRICS, shutdown).await
}
