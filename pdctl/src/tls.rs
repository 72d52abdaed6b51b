//! `--ca FILE` (PD_CA) of the commands that talk to a running cluster (`generate`, `bench`,
//! `metrics`): with it they dial the router over TLS (gRPC, the HTTP API and `/metrics`
//! alike), verifying its certificate against this CA.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use pd_tls::{Alpn, ClientTls, TlsSettings};
use tonic::transport::{Channel, Endpoint};

/// The CA flag.
#[derive(Debug, Clone, Default, Args)]
pub struct CaArgs {
    /// Talk to the router over TLS, verifying its certificate against this CA (PEM; `ca.crt`
    /// from `pdctl certs`). Without it: plaintext.
    #[arg(long = "ca", env = "PD_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
}

impl CaArgs {
    /// The TLS of connections speaking `alpn`, or `None` without `--ca`. Reads the file now.
    pub fn client(&self, alpn: Alpn) -> anyhow::Result<Option<ClientTls>> {
        let settings = TlsSettings {
            ca: self.ca.clone(),
            ..TlsSettings::default()
        };
        ClientTls::new(&settings, alpn).context("--ca")
    }
}

/// A gRPC channel to the router at `router` (`HOST:PORT` or a URL), over TLS when `tls` is
/// given, TCP_NODELAY either way.
pub async fn channel(router: &str, tls: Option<&ClientTls>) -> anyhow::Result<Channel> {
    let authority = router
        .split_once("://")
        .map_or(router, |(_, rest)| rest)
        .trim_end_matches('/');
    let url = format!("{}://{authority}", pd_tls::scheme(tls));
    Endpoint::from_shared(url)
        .with_context(|| format!("`{router}` is not a router address (HOST:PORT)"))?
        .connect_timeout(Duration::from_secs(10))
        .connect_with_connector(pd_tls::Connector::new(tls.cloned()))
        .await
        .with_context(|| format!("connecting to the router at {router}"))
}
