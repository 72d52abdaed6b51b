//! `pdctl up --secure`: what a local cluster needs to run as a production one does — a cluster
//! CA and a member certificate (mTLS between every part, TLS for clients) and an API key for
//! one tenant, written to a fresh private directory that is removed when the cluster stops.
//!
//! Not here: starting the processes (`crate::up`), the TLS and key checks themselves (the
//! binaries' `--tls-*` and `--api-keys` flags).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use pd_tls::{Alpn, ClientTls, TlsSettings};

/// The tenant the generated API key stands for.
pub const TENANT: &str = "local";

/// The files of a secure local cluster; the directory goes when this is dropped.
pub struct Secure {
    dir: tempfile::TempDir,
    /// The API key clients present (`Authorization: Bearer KEY`).
    pub api_key: String,
}

impl Secure {
    /// A new CA, member certificate (for 127.0.0.1 and localhost) and API keys file.
    pub fn create() -> anyhow::Result<Self> {
        // Mode 0700: only this user reads the keys inside.
        let dir = tempfile::Builder::new()
            .prefix("pdctl-up-")
            .tempdir()
            .context("creating the directory for the cluster's certificates")?;
        pd_tls::certs::write_cluster_certs(dir.path(), &[], false)
            .context("writing the cluster's certificates")?;
        // 256 random bits: nothing a client could guess.
        let api_key = format!(
            "pd-{:032x}{:032x}",
            rand::random::<u128>(),
            rand::random::<u128>()
        );
        let secure = Self { dir, api_key };
        pd_tls::certs::write_file(
            &secure.keys_file(),
            format!("{TENANT} {}\n", secure.api_key).as_bytes(),
            true,
        )
        .context("writing the API keys file")?;
        Ok(secure)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// The CA clients trust (`--ca`).
    pub fn ca(&self) -> PathBuf {
        self.path("ca.crt")
    }

    fn keys_file(&self) -> PathBuf {
        self.path("api-keys")
    }

    /// The directory holding every file.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn identity_flags(&self) -> Vec<String> {
        let p = |f: &str| self.path(f).display().to_string();
        vec![
            "--tls-cert".into(),
            p("node.crt"),
            "--tls-key".into(),
            p("node.key"),
            // Trust (when dialing other parts): the cluster CA.
            "--tls-ca".into(),
            p("ca.crt"),
        ]
    }

    /// A node's flags: TLS on every port, cluster certificates demanded of every caller of
    /// its gRPC and KV ports, TLS with its own certificate when it dials.
    pub fn node_flags(&self) -> Vec<String> {
        let mut flags = self.identity_flags();
        flags.extend(["--tls-client-ca".into(), self.ca().display().to_string()]);
        flags
    }

    /// The router's flags: TLS for clients, who authenticate with the API key (not a
    /// certificate), and mTLS to the nodes.
    pub fn router_flags(&self) -> Vec<String> {
        let mut flags = self.identity_flags();
        flags.extend(["--api-keys".into(), self.keys_file().display().to_string()]);
        flags
    }

    /// The TLS a client of the router uses (trusting the cluster CA).
    pub fn client_tls(&self) -> anyhow::Result<ClientTls> {
        let settings = TlsSettings {
            ca: Some(self.ca()),
            ..TlsSettings::default()
        };
        ClientTls::new(&settings, Alpn::Grpc)
            .context("client TLS for the router")?
            .context("client TLS without a CA")
    }
}
