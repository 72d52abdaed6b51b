//! The server side: a reloadable TLS configuration per listener ([`ServerTls`]), and
//! [`Listener`], which accepts on a bound socket and runs each TLS handshake in its own task
//! with a deadline, so that a slow or silent client never holds up the others. A
//! `Listener` is what tonic (`serve_with_incoming*`: it is a `Stream` of connections) and
//! axum (`axum::serve`: it is an `axum::serve::Listener`) serve from; without TLS it yields
//! plain connections exactly as a bare `TcpListener` would.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::args::TlsSettings;
use crate::conn::Conn;
use crate::error::TlsError;
use crate::reload::{DEFAULT_CHECK_INTERVAL, Reloading};

/// How long a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections accepted and handshaken but not yet taken by the server.
const ACCEPTED_BACKLOG: usize = 64;

/// The application protocol a listener speaks, offered in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// gRPC: HTTP/2 (`h2`; gRPC clients such as grpcio insist on it).
    Grpc,
    /// The HTTP/1.1 servers: the router's OpenAI API and every `/metrics`.
    Http1,
    /// A protocol of our own (the KV export port): no ALPN.
    None,
}

impl Alpn {
    pub(crate) fn protocols(self) -> &'static [&'static [u8]] {
        match self {
            Alpn::Grpc => &[b"h2"],
            Alpn::Http1 => &[b"http/1.1"],
            Alpn::None => &[],
        }
    }
}

/// One listener's TLS: certificate, key and optional client CA, re-read when their files
/// change (new handshakes use the new material; open connections are untouched). Clones
/// share the configuration.
#[derive(Debug, Clone)]
pub struct ServerTls {
    config: Arc<Reloading<ServerConfig>>,
    requires_client_certs: bool,
}

impl ServerTls {
    /// The TLS of a listener speaking `alpn`, or `None` when `settings` serve no TLS.
    /// Reads and checks the files now: an unreadable or invalid one is an error naming it.
    pub fn new(settings: &TlsSettings, alpn: Alpn) -> Result<Option<Self>, TlsError> {
        Self::with_check_interval(settings, alpn, DEFAULT_CHECK_INTERVAL)
    }

    /// [`ServerTls::new`], looking at the files at most every `check_interval`.
    pub fn with_check_interval(
        settings: &TlsSettings,
        alpn: Alpn,
        check_interval: Duration,
    ) -> Result<Option<Self>, TlsError> {
        let Some(identity) = &settings.identity else {
            return Ok(None);
        };
        let mut files: Vec<(&'static str, PathBuf)> = vec![
            ("certificate (--tls-cert)", identity.cert.clone()),
            ("private key (--tls-key)", identity.key.clone()),
        ];
        if let Some(ca) = &settings.client_ca {
            files.push(("client CA (--tls-client-ca)", ca.clone()));
        }
        let config = Reloading::new(files, check_interval, move |files| {
            crate::material::server_config(files, alpn.protocols())
        })?;
        Ok(Some(Self {
            config: Arc::new(config),
            requires_client_certs: settings.client_ca.is_some(),
        }))
    }

    /// Whether clients must present a certificate the client CA signed (checked by the
    /// service, not the handshake: see [`crate::ClusterOnlyLayer`]).
    pub fn requires_client_certs(&self) -> bool {
        self.requires_client_certs
    }

    /// The TLS handshake on an accepted socket, bounded by [`HANDSHAKE_TIMEOUT`].
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<Conn> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.current());
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => Ok(Conn::Server(Box::new(tls))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the TLS handshake took too long",
            )),
        }
    }
}

/// Accepted connections, plain or TLS (see the module docs). Dropping it stops accepting
/// and closes the listening socket.
#[derive(Debug)]
pub struct Listener {
    accepted: mpsc::Receiver<Conn>,
    local_addr: SocketAddr,
}

impl Listener {
    /// Starts accepting on `listener` (inside a Tokio runtime), with TLS when `tls` is given.
    /// Every connection gets TCP_NODELAY: small gRPC and stream messages must not wait for
    /// delayed ACKs.
    pub fn new(listener: TcpListener, tls: Option<ServerTls>) -> io::Result<Self> {
        Self::start(listener, tls, false)
    }

    /// [`Listener::new`], closing every TLS connection whose client presented no certificate
    /// the client CA signed, when the TLS has a client CA (for servers, such as HTTP ones,
    /// that cannot answer such a caller with a status of their own).
    pub fn cluster_only(listener: TcpListener, tls: Option<ServerTls>) -> io::Result<Self> {
        Self::start(listener, tls, true)
    }

    fn start(
        listener: TcpListener,
        tls: Option<ServerTls>,
        drop_anonymous: bool,
    ) -> io::Result<Self> {
        let local_addr = listener.local_addr()?;
        let (tx, accepted) = mpsc::channel(ACCEPTED_BACKLOG);
        let drop_anonymous =
            drop_anonymous && tls.as_ref().is_some_and(|t| t.requires_client_certs());
        tokio::spawn(accept_loop(listener, tls, drop_anonymous, tx));
        Ok(Self {
            accepted,
            local_addr,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<ServerTls>,
    drop_anonymous: bool,
    tx: mpsc::Sender<Conn>,
) {
    loop {
        let accepted = tokio::select! {
            // The server dropped its end: stop, and close the socket at once.
            () = tx.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        match &tls {
            None => {
                if tx.send(Conn::Plain(tcp)).await.is_err() {
                    return;
                }
            }
            Some(tls) => {
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    match tls.accept(tcp).await {
                        Ok(conn) if drop_anonymous && !conn.peer_info().client_verified => {
                            tracing::debug!(%peer, "no client certificate; connection closed");
                        }
                        Ok(conn) => {
                            let _ = tx.send(conn).await;
                        }
                        Err(e) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    }
                });
            }
        }
    }
}

impl tokio_stream::Stream for Listener {
    type Item = Result<Conn, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.accepted.poll_recv(cx).map(|conn| conn.map(Ok))
    }
}

impl axum::serve::Listener for Listener {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        match self.accepted.recv().await {
            Some(conn) => {
                let peer = conn.peer_info().remote_addr.unwrap_or(self.local_addr);
                (conn, peer)
            }
            // The accept task ends only once this listener is dropped: nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local_addr)
    }
}
