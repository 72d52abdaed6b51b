//! One connection type for every socket of the cluster, plaintext or TLS, server or client
//! side, so that the code reading and writing it does not care which.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A TCP connection, with or without TLS.
#[derive(Debug)]
pub enum Conn {
    Plain(TcpStream),
    /// Accepted by a TLS listener.
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    /// Dialed with TLS.
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// What a server knows about the peer of a connection (tonic puts it in every request's
/// extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    pub remote_addr: Option<SocketAddr>,
    /// The connection is TLS.
    pub tls: bool,
    /// The peer presented a certificate chain that the configured client CA verified. (The
    /// verifier refuses the handshake of a chain that does not verify, so a presented chain
    /// is a verified one.)
    pub client_verified: bool,
}

impl Conn {
    /// The underlying TCP stream.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(s) => s,
            Conn::Server(s) => s.get_ref().0,
            Conn::Client(s) => s.get_ref().0,
        }
    }

    /// Who is on the other end (see [`PeerInfo`]).
    pub fn peer_info(&self) -> PeerInfo {
        let remote_addr = self.tcp().peer_addr().ok();
        match self {
            Conn::Plain(_) => PeerInfo {
                remote_addr,
                tls: false,
                client_verified: false,
            },
            Conn::Server(s) => PeerInfo {
                remote_addr,
                tls: true,
                client_verified: s
                    .get_ref()
                    .1
                    .peer_certificates()
                    .is_some_and(|c| !c.is_empty()),
            },
            Conn::Client(_) => PeerInfo {
                remote_addr,
                tls: true,
                client_verified: false,
            },
        }
    }

    /// The certificate the server presented, for a dialed TLS connection (DER, end entity
    /// first).
    pub fn server_certificates(&self) -> Option<Vec<Vec<u8>>> {
        match self {
            Conn::Client(s) => s
                .get_ref()
                .1
                .peer_certificates()
                .map(|c| c.iter().map(|c| c.to_vec()).collect()),
            _ => None,
        }
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Server(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Conn::Client(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Server(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Conn::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Server(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Conn::Client(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Server(s) => s.is_write_vectored(),
            Conn::Client(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Server(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Conn::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Server(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Conn::Client(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
