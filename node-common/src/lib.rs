//! pd-node: what the prefill-node and decode-node binaries share, so each node crate holds
//! only its own gRPC service.
//!
//! - [`args::NodeArgs`]: the flags of both roles (`--model`, the engine flags, `--host`,
//!   `--port`, `--metrics-port`, `--kv-transport`, `--drain-timeout`, `--seed`,
//!   `--log-format`).
//! - [`kv_transport`]: `--kv-transport tcp|rdma|auto` and the `--rdma-*` flags: opening
//!   RDMA (or refusing to start), the decode node's importer, the RdmaConnect client.
//! - [`model`]: loading `--model` with progress bars, the engine of a role on its thread, and
//!   the facts a node reports ([`model::ModelFacts`]: layout, fingerprint, limits).
//! - [`requests`]: the node's open requests (abort by id, duplicate ids, draining) and guards
//!   that abort an engine request whose caller went away.
//! - [`metrics`]: the node's `/metrics` (vLLM's families, KV transfer) and its
//!   `CounterReport` for the router, under a random epoch.
//! - [`tls`]: the `--tls-*` flags: TLS on every listener, mTLS between the parts (callers
//!   without a cluster certificate get UNAUTHENTICATED; health stays open), and the refusal
//!   to listen beyond loopback without mTLS unless `--insecure`.
//! - [`cache_events`]: the `CacheEvents` RPC of both roles (the engine's prefix-cache feed,
//!   a bounded number of subscribers, the end on drain).
//! - [`server`]: gRPC on a bound listener (port 0 works) with `grpc.health.v1` and server
//!   reflection, the ready line, and the drain on SIGTERM / Ctrl-C.
//!
//! Start-up order of a node: load the model, start the engine thread, bind the listeners
//! (gRPC, metrics), print the ready line, serve. Shutdown: health NOT_SERVING, new work refused, in-flight
//! work finishes within `--drain-timeout`, the rest is aborted, exit 0.

pub mod args;
pub mod cache_events;
pub mod check;
pub mod guide;
pub mod info;
pub mod kv_transport;
pub mod metrics;
pub mod model;
pub mod requests;
pub mod server;
pub mod tls;

pub use args::{KvTransport, LogFormat, NodeArgs};
pub use metrics::NodeMetrics;
pub use model::{ModelFacts, StartedEngine, start_engine};
pub use requests::{RequestGuard, Requests};
pub use server::{NodeServer, Ready};

use tracing_subscriber::EnvFilter;

/// Logs on stderr, `RUST_LOG` (default `info`), as text or JSON.
pub fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if let Err(e) = result {
        eprintln!("logging not set up: {e}");
    }
}

/// A future that resolves at the first SIGTERM or Ctrl-C (SIGINT). The handlers are
/// installed now (call it inside the runtime, before announcing readiness), so a signal that
/// arrives before the future is first polled is not lost.
#[cfg(unix)]
pub fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("Ctrl-C received"),
        }
    })
}

/// A future that resolves at the first Ctrl-C.
#[cfg(not(unix))]
pub fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send> {
    Ok(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            tracing::info!("Ctrl-C received");
        } else {
            std::future::pending::<()>().await;
        }
    })
}

/// The whole `main` of a node binary: tracing, a runtime, `serve` until SIGTERM / Ctrl-C, and
/// one `error: ...` line with a non-zero exit on failure.
pub fn run_main<F, Fut>(log_format: LogFormat, serve: F) -> std::process::ExitCode
where
    F: FnOnce(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    init_tracing(log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let shutdown = shutdown_signal()?;
        serve(Box::pin(shutdown)).await
    });
    // Model loading left running by a shutdown during start-up is not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
