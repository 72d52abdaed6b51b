//! The dialing side: [`ClientTls`] verifies servers against `--tls-ca` and presents this
//! process's certificate (`--tls-cert`, `--tls-key`) as its client identity, re-reading the
//! files when they change (new connections use the new material). [`Connector`] is the tonic
//! connector (TCP with TCP_NODELAY, then TLS when configured) for channels to the nodes.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tonic::codegen::http::Uri;

use crate::args::TlsSettings;
use crate::conn::Conn;
use crate::error::TlsError;
use crate::reload::{DEFAULT_CHECK_INTERVAL, Reloading};
use crate::server::{Alpn, HANDSHAKE_TIMEOUT};

/// TLS for the connections this process dials. Clones share the configuration.
#[derive(Debug, Clone)]
pub struct ClientTls {
    config: Arc<Reloading<ClientConfig>>,
    server_name: Option<ServerName<'static>>,
}

impl ClientTls {
    /// The TLS of connections speaking `alpn`, or `None` when `settings` dial plaintext (no
    /// `--tls-ca`). Reads and checks the files now.
    pub fn new(settings: &TlsSettings, alpn: Alpn) -> Result<Option<Self>, TlsError> {
        Self::with_check_interval(settings, alpn, DEFAULT_CHECK_INTERVAL)
    }

    /// [`ClientTls::new`], looking at the files at most every `check_interval`.
    pub fn with_check_interval(
        settings: &TlsSettings,
        alpn: Alpn,
        check_interval: Duration,
    ) -> Result<Option<Self>, TlsError> {
        let Some(ca) = &settings.ca else {
            return Ok(None);
        };
        let mut files: Vec<(&'static str, PathBuf)> = vec![("CA (--tls-ca)", ca.clone())];
        if let Some(identity) = &settings.identity {
            files.push(("certificate (--tls-cert)", identity.cert.clone()));
            files.push(("private key (--tls-key)", identity.key.clone()));
        }
        let config = Reloading::new(files, check_interval, move |files| {
            crate::material::client_config(files, alpn.protocols())
        })?;
        Ok(Some(Self {
            config: Arc::new(config),
            server_name: settings.server_name.clone(),
        }))
    }

    /// The TLS handshake on a dialed socket to `host` (a DNS name or an IP address; the
    /// server's certificate must name it, unless `--tls-server-name` names what it must
    /// name), bounded by the handshake timeout.
    pub async fn connect(&self, tcp: TcpStream, host: &str) -> io::Result<Conn> {
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => {
                let host = host.trim_start_matches('[').trim_end_matches(']');
                ServerName::try_from(host.to_string()).map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{host:?} is not a name a TLS certificate can carry"),
                    )
                })?
            }
        };
        let connector = tokio_rustls::TlsConnector::from(self.config.current());
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp)).await {
            Ok(Ok(tls)) => Ok(Conn::Client(Box::new(tls))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the TLS handshake took too long",
            )),
        }
    }
}

/// Dials `host:port` (TCP_NODELAY), with TLS when `tls` is given.
pub async fn dial(tls: Option<&ClientTls>, host: &str, port: u16) -> io::Result<Conn> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let tcp = TcpStream::connect((bare, port)).await?;
    let _ = tcp.set_nodelay(true);
    match tls {
        Some(tls) => tls.connect(tcp, bare).await,
        None => Ok(Conn::Plain(tcp)),
    }
}

/// A tonic connector: TCP with TCP_NODELAY to the URI's host and port, then TLS when
/// configured. Use it with `Endpoint::connect_with_connector[_lazy]`; the endpoint's connect
/// timeout still applies.
#[derive(Debug, Clone, Default)]
pub struct Connector {
    tls: Option<ClientTls>,
}

impl Connector {
    pub fn new(tls: Option<ClientTls>) -> Self {
        Self { tls }
    }
}

impl tonic::codegen::Service<Uri> for Connector {
    type Response = TokioIo<Conn>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Conn>>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let host = uri.host().ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("no host in {uri}"))
            })?;
            let https = uri.scheme_str() == Some("https");
            let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
            Ok(TokioIo::new(dial(tls.as_ref(), host, port).await?))
        })
    }
}

/// The scheme of URIs for channels dialed with or without TLS.
pub fn scheme(tls: Option<&ClientTls>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}
