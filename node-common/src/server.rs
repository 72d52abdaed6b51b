//! Serving a node's gRPC service with health and reflection on a bound listener (the gRPC
//! server every part shares, `pd_tls::GrpcServer`: reflection lists this node's service, not
//! the other role's or the router's), the ready line, and the drain on shutdown.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio::net::TcpListener;
use tonic::service::Routes;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use pd_engine::serve::Role;

use crate::metrics::NodeMetrics;
use crate::requests::Requests;

/// How long aborted requests get to end after the drain timeout, and the gRPC server to
/// close its connections, before the process stops waiting for them.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How often the drain checks whether the node is idle.
const POLL: Duration = Duration::from_millis(20);
/// HTTP/2 streams per connection beyond the node's request capacity, for control calls.
const CONTROL_STREAMS: usize = 256;

/// The one JSON line a node prints on stdout once it serves (`pdctl up` reads it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Ready {
    /// `prefill` or `decode` on the line.
    pub role: Role,
    /// The gRPC server's address.
    pub grpc: SocketAddr,
    /// The KV export server's address (prefill nodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv: Option<SocketAddr>,
    /// The Prometheus `/metrics` endpoint's address.
    pub metrics_addr: SocketAddr,
    /// The served model name.
    pub model: String,
    /// The KV layout fingerprint (16 hex digits).
    pub fingerprint: String,
}

impl Ready {
    /// The line, without the newline.
    pub fn line(&self) -> String {
        serde_json::to_string(self).expect("plain struct serializes")
    }

    /// Print the line on stdout (flushed) and log it.
    pub fn announce(&self) -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", self.line()).context("writing the ready line")?;
        out.flush().context("writing the ready line")?;
        tracing::info!(
            role = self.role.as_str(),
            grpc = %self.grpc,
            kv = %self.kv.map(|a| a.to_string()).unwrap_or_default(),
            metrics = %self.metrics_addr,
            model = %self.model,
            fingerprint = %self.fingerprint,
            "ready"
        );
        Ok(())
    }
}

/// A node that has started (model loaded, listeners bound): what the prefill and decode
/// nodes share for [`serve`].
pub trait StartedNode: Send + Sized {
    /// What the ready line says.
    fn ready(&self) -> &Ready;

    /// Serve until `shutdown` resolves, drain, then stop.
    fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// Start a node, print its ready line, serve until `shutdown`, drain and stop. A shutdown
/// during start-up (loading a large model takes a while) ends it at once.
pub async fn serve<N: StartedNode>(
    start: impl Future<Output = anyhow::Result<N>> + Send,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let mut shutdown = std::pin::pin!(shutdown);
    let node = tokio::select! {
        node = start => node?,
        () = &mut shutdown => {
            tracing::info!("shutdown requested while starting; exiting");
            return Ok(());
        }
    };
    node.ready().announce()?;
    node.run(shutdown).await
}

/// Bind a TCP listener on `host:port` (port 0: an ephemeral port); returns it and its
/// address.
pub async fn bind(host: &str, port: u16, what: &str) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind((host, port))
        .await
        .with_context(|| format!("binding the {what} on {host}:{port}"))?;
    let addr = listener
        .local_addr()
        .with_context(|| format!("reading the {what}'s address"))?;
    Ok((listener, addr))
}

/// A node's gRPC server, ready to run: the node's service routes plus health and reflection,
/// on a bound listener; and its `/metrics` endpoint on another.
pub struct NodeServer {
    pub listener: TcpListener,
    /// Where `/metrics` is served (until the gRPC server has stopped: scrapes see the drain).
    pub metrics_listener: TcpListener,
    pub metrics: Arc<NodeMetrics>,
    /// The node's own service (health and reflection are added here).
    pub routes: Routes,
    /// Its full gRPC name (`pd.v1.PrefillService`), reported by health.
    pub service_name: &'static str,
    pub requests: Arc<Requests>,
    /// How long in-flight work may take after the shutdown signal.
    pub drain_timeout: Duration,
    /// Work beyond open requests the drain waits for (a prefill node's KV leases): returns
    /// true when there is none.
    pub also_idle: Box<dyn Fn() -> bool + Send + Sync>,
    /// TLS of the gRPC and metrics listeners, and whether gRPC callers need a cluster
    /// certificate.
    pub tls: crate::tls::NodeTls,
}

impl std::fmt::Debug for NodeServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeServer")
            .field("listener", &self.listener)
            .field("metrics_listener", &self.metrics_listener)
            .field("service_name", &self.service_name)
            .field("drain_timeout", &self.drain_timeout)
            .finish_non_exhaustive()
    }
}

/// Sets the gRPC health status and what the metrics port's `/health` answers.
async fn set_status(
    health: &HealthReporter,
    serving: &AtomicBool,
    service: &str,
    status: ServingStatus,
) {
    serving.store(status == ServingStatus::Serving, Ordering::Relaxed);
    health.set_service_status("", status).await;
    health.set_service_status(service, status).await;
}

/// Wait until `idle()` or `deadline`; whether it became idle.
async fn wait_idle(idle: impl Fn() -> bool, deadline: Instant) -> bool {
    loop {
        if idle() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

impl NodeServer {
    /// Serve until `shutdown` resolves, then drain: health turns NOT_SERVING, new work is
    /// refused with UNAVAILABLE (other calls, such as releasing a KV lease, still work), open
    /// requests (and `also_idle` work) get `drain_timeout` to finish, whatever is left is
    /// aborted, and the server stops.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let NodeServer {
            listener,
            metrics_listener,
            metrics,
            routes,
            service_name,
            requests,
            drain_timeout,
            also_idle,
            tls,
        } = self;
        // Streams per connection: every request the node may hold (the router's calls share
        // one connection) plus room for control calls (Info, Abort, ReleaseKv), so a full
        // node answers RESOURCE_EXHAUSTED instead of leaving calls queued in HTTP/2.
        let grpc_limits = pd_tls::GrpcLimits {
            max_concurrent_streams: u32::try_from(
                requests.capacity().saturating_add(CONTROL_STREAMS),
            )
            .unwrap_or(u32::MAX),
            ..pd_tls::GrpcLimits::default()
        };
        // With mTLS: UNAUTHENTICATED to callers without a cluster certificate.
        let (grpc, mut health) = pd_tls::GrpcServer::new(
            routes,
            pd_tls::Api {
                service: service_name,
                descriptor_set: pd_proto::FILE_DESCRIPTOR_SET,
            },
            grpc_limits,
            tls.requires_client_certs(),
        )
        .context("building the gRPC server")?;
        let serving = Arc::new(AtomicBool::new(false));
        set_status(&health, &serving, service_name, ServingStatus::Serving).await;

        let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
        let metrics_listener = pd_tls::Listener::new(metrics_listener, tls.metrics.clone())
            .context("the metrics listener")?;
        let metrics_server = tokio::spawn(crate::metrics::http::serve(
            metrics_listener,
            metrics,
            Arc::clone(&serving),
            async {
                let _ = metrics_stopped.await;
            },
        ));

        // Tokens stream in small messages: the listener sets TCP_NODELAY on every connection.
        let incoming =
            pd_tls::Listener::new(listener, tls.grpc.clone()).context("the gRPC listener")?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(grpc.serve(incoming, async {
            let _ = stop_rx.await;
        }));

        // An engine that fails makes the node NOT_SERVING (gRPC health and /health) before
        // any of its open requests hears of the failure: the engine thread runs this before
        // it fails them and before it ends.
        {
            let health = health.clone();
            let serving = Arc::clone(&serving);
            let runtime = tokio::runtime::Handle::current();
            requests.engine().on_failure(move |what| {
                tracing::error!(error = %what, "the engine failed; reporting NOT_SERVING");
                serving.store(false, Ordering::Relaxed);
                let report = async move {
                    set_status(&health, &serving, service_name, ServingStatus::NotServing).await;
                };
                if tokio::runtime::Handle::try_current().is_ok() {
                    // It had failed already: run here, on the runtime, which cannot block.
                    runtime.spawn(report);
                } else {
                    // The engine thread: waits until health reports it.
                    runtime.block_on(report);
                }
            });
        }

        tokio::select! {
            () = shutdown => {}
            ended = &mut server => {
                metrics_server.abort();
                return match ended {
                    Ok(Ok(())) => Err(anyhow::anyhow!("the gRPC server stopped unexpectedly")),
                    Ok(Err(e)) => Err(e).context("the gRPC server failed"),
                    Err(e) => Err(e).context("the gRPC server task failed"),
                };
            }
        }

        tracing::info!(
            open_requests = requests.len(),
            drain_timeout_s = drain_timeout.as_secs_f64(),
            "shutdown requested: draining"
        );
        requests.start_draining();
        set_status(&health, &serving, service_name, ServingStatus::NotServing).await;
        let idle = || requests.is_empty() && also_idle();
        if wait_idle(idle, Instant::now() + drain_timeout).await {
            tracing::info!("drained");
        } else {
            tracing::warn!(
                open_requests = requests.len(),
                "drain timeout: aborting the requests still open"
            );
            requests.abort_all();
            if !wait_idle(|| requests.is_empty(), Instant::now() + STOP_GRACE).await {
                tracing::warn!(
                    open_requests = requests.len(),
                    "requests did not end after the abort"
                );
            }
        }

        // Removing the statuses ends open health watch streams, which would otherwise keep
        // the graceful shutdown waiting.
        health.clear_service_status("").await;
        health.clear_service_status(service_name).await;
        let _ = stop_tx.send(());
        match tokio::time::timeout(STOP_GRACE, &mut server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the gRPC server failed while stopping"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the gRPC server task failed"),
            Err(_) => {
                tracing::warn!("gRPC connections still open after the drain; closing them");
                server.abort();
            }
        }
        let _ = metrics_stop.send(());
        match tokio::time::timeout(STOP_GRACE, metrics_server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the metrics server failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the metrics server task failed"),
            Err(_) => tracing::warn!("the metrics server did not stop in time"),
        }
        tracing::info!("stopped");
        Ok(())
    }
}
