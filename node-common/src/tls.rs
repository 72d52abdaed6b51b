//! A node's TLS, from its `--tls-*` flags: the refusal to listen beyond loopback without
//! mTLS (unless `--insecure`), the server configurations of its listeners (gRPC: `h2`;
//! `/metrics`: `http/1.1`; the prefill node's KV port: no ALPN) and the client
//! configurations it dials with (the decode node: prefill nodes' KV port and gRPC).
//! Every file is read and checked here, at start.

use anyhow::Context as _;
use pd_tls::{Alpn, ClientTls, Exposure, ServerTls, TlsSettings};

use crate::NodeArgs;

/// Everything TLS of one node. With no `--tls-*` flag, every field is `None`: plaintext.
#[derive(Debug, Clone, Default)]
pub struct NodeTls {
    pub settings: TlsSettings,
    /// The gRPC listener.
    pub grpc: Option<ServerTls>,
    /// The `/metrics` listener (TLS when configured; client certificates not demanded:
    /// monitoring is not a cluster member).
    pub metrics: Option<ServerTls>,
    /// The KV export port (prefill nodes).
    pub kv: Option<ServerTls>,
    /// Dialing other nodes' gRPC (RdmaConnect).
    pub dial_grpc: Option<ClientTls>,
    /// Dialing prefill nodes' KV ports.
    pub dial_kv: Option<ClientTls>,
}

impl NodeTls {
    /// Checks the flags and the exposure, and loads every configuration.
    pub fn load(args: &NodeArgs) -> anyhow::Result<Self> {
        let settings = checked_settings(args)?;
        let context = "loading the TLS certificates";
        Ok(Self {
            grpc: ServerTls::new(&settings, Alpn::Grpc).context(context)?,
            metrics: ServerTls::new(&settings, Alpn::Http1).context(context)?,
            kv: ServerTls::new(&settings, Alpn::None).context(context)?,
            dial_grpc: ClientTls::new(&settings, Alpn::Grpc).context(context)?,
            dial_kv: ClientTls::new(&settings, Alpn::None).context(context)?,
            settings,
        })
    }

    /// Whether gRPC callers and KV pullers must present a cluster certificate.
    pub fn requires_client_certs(&self) -> bool {
        self.settings.requires_client_certs()
    }
}

/// The TLS flags checked, and the node allowed to listen on `--host` with them.
pub fn checked_settings(args: &NodeArgs) -> anyhow::Result<TlsSettings> {
    let settings = args.tls.settings()?;
    pd_tls::check_exposure(&args.host, &settings, Exposure::Node)?;
    Ok(settings)
}
