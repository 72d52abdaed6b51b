//! pd-tls: TLS for every listener of the cluster and mTLS between its parts.
//!
//! - [`TlsArgs`]: the `--tls-cert`, `--tls-key`, `--tls-client-ca`, `--tls-ca`,
//!   `--tls-server-name` and `--insecure` flags of the router and both node roles, checked
//!   into [`TlsSettings`] (contradictions refused in one sentence).
//! - [`ServerTls`]: one listener's rustls configuration (ALPN `h2` for gRPC, `http/1.1` for
//!   the HTTP servers, none for the KV port), re-read when the certificate, key or client CA
//!   files change; [`Listener`] accepts on a bound socket with the handshakes off the accept
//!   loop, for tonic and axum alike. Client certificates are verified against the client CA
//!   but not demanded by the handshake: [`ClusterOnlyLayer`] answers UNAUTHENTICATED to gRPC
//!   calls without one (health stays open), and the KV server closes such connections.
//! - [`ClientTls`] and [`Connector`]: dialing with TLS (roots from `--tls-ca`, this process's
//!   certificate as its client identity), for tonic channels and raw sockets.
//! - [`GrpcLimits`], [`HttpLimits`] and [`serve_http`]: the connection limits of every
//!   server (concurrent streams, keepalive and connection age for gRPC; a header timeout and
//!   a connection cap for the HTTP/1.1 servers, which `serve_http` runs from a [`Listener`]).
//! - [`GrpcServer`]: the one gRPC server of every part (its API, health, reflection listing
//!   only that API, under [`GrpcLimits`] and [`ClusterOnlyLayer`]).
//! - [`check_exposure`]: the refusal to listen beyond loopback without the role's security.
//! - [`certs`]: generating a cluster CA and member certificates (`pdctl certs`).
//!
//! rustls with the `ring` provider only. Nothing here knows about the cluster's gRPC services
//! (a part names its own and hands over their descriptors), KV or models.

mod args;
mod auth;
pub mod certs;
mod client;
mod conn;
mod error;
mod exposure;
mod grpc;
mod limits;
mod material;
mod reload;
mod server;

pub use args::{Identity, TlsArgs, TlsSettings};
pub use auth::{ClusterOnly, ClusterOnlyLayer};
pub use client::{ClientTls, Connector, dial, scheme};
pub use conn::{Conn, PeerInfo};
pub use error::TlsError;
pub use exposure::{Exposure, check_exposure, is_loopback};
pub use grpc::{Api, GrpcServer, ReflectionError};
pub use limits::{GrpcLimits, HttpLimits, serve_http};
pub use reload::DEFAULT_CHECK_INTERVAL;
pub use rustls_pki_types::ServerName;
pub use server::{Alpn, HANDSHAKE_TIMEOUT, Listener, ServerTls};
