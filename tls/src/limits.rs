//! Connection limits of every server of the cluster: [`GrpcLimits`] for the tonic servers
//! (concurrent streams per connection, HTTP/2 keepalive, connection age) and [`serve_http`],
//! which serves an axum app from a [`Listener`] with a header-read timeout and a connection
//! cap ([`HttpLimits`]): `axum::serve` has neither, so a client that sends one header byte a
//! second, or opens connections without end, would hold the server's memory forever.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::server::Listener;

/// The HTTP/2 settings of a gRPC server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcLimits {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`: calls one connection may have open at once.
    pub max_concurrent_streams: u32,
    /// How often the server pings a connection (None: never).
    pub keepalive_interval: Option<Duration>,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Age after which a connection gets a GOAWAY (None: no limit).
    pub max_connection_age: Option<Duration>,
    /// How long an aged connection's calls may still run before it is closed (None: until
    /// they end).
    pub max_connection_age_grace: Option<Duration>,
}

impl GrpcLimits {
    /// The default of `--max-concurrent-streams`.
    pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 1024;

    /// These settings on `server`.
    pub fn apply<L>(&self, server: tonic::transport::Server<L>) -> tonic::transport::Server<L> {
        let mut server = server
            .max_concurrent_streams(self.max_concurrent_streams)
            .http2_keepalive_interval(self.keepalive_interval)
            .http2_keepalive_timeout(Some(self.keepalive_timeout));
        if let Some(age) = self.max_connection_age {
            server = server.max_connection_age(age);
            if let Some(grace) = self.max_connection_age_grace {
                server = server.max_connection_age_grace(grace);
            }
        }
        server
    }
}

impl Default for GrpcLimits {
    fn default() -> Self {
        Self {
            max_concurrent_streams: Self::DEFAULT_MAX_CONCURRENT_STREAMS,
            keepalive_interval: Some(Duration::from_secs(20)),
            keepalive_timeout: Duration::from_secs(20),
            max_connection_age: None,
            max_connection_age_grace: None,
        }
    }
}

/// The limits of an HTTP/1.1 server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// How long a client may take to send a request's headers, counted from when the
    /// connection starts waiting for a request (when it opens, and after each response): it
    /// bounds a slow client and an idle keep-alive connection alike.
    pub header_timeout: Duration,
    /// Connections served at once; more wait to be taken until one closes.
    pub max_connections: usize,
}

impl HttpLimits {
    /// The default of `--http-max-connections`.
    pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;

    /// The limits of a `/metrics` server: monitoring needs few connections.
    pub const METRICS: HttpLimits = HttpLimits {
        header_timeout: Duration::from_secs(10),
        max_connections: 64,
    };
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            max_connections: Self::DEFAULT_MAX_CONNECTIONS as usize,
        }
    }
}

/// Serves `app` over HTTP/1.1 on `listener` within `limits` until `shutdown` completes, then
/// stops accepting, lets each connection finish its request in flight and returns once all
/// have closed (as `axum::serve(..).with_graceful_shutdown(..)` does).
pub async fn serve_http(
    mut listener: Listener,
    app: axum::Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop, stopped) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut connections = JoinSet::new();
    loop {
        // A slot first, then a connection: past the cap, clients wait in the accept backlog.
        let slot = tokio::select! {
            () = &mut shutdown => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let conn = tokio::select! {
            () = &mut shutdown => break,
            conn = axum::serve::Listener::accept(&mut listener) => conn.0,
        };
        // Reap the connections that ended, so the set does not grow.
        while connections.try_join_next().is_some() {}
        let service = TowerToHyperService::new(app.clone());
        let mut stopped = stopped.clone();
        connections.spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(conn), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                    }
                    return;
                }
                _ = stopped.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
    // No new connections; the open ones end their request in flight and close.
    drop(listener);
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}
