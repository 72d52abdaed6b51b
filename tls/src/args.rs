//! The `--tls-*` and `--insecure` flags (each also from a `PD_...` variable) and the typed
//! settings they are checked into. Checking the flags reads no file: the files are read
//! (and refused, naming the file) when the server and client configurations are built.

use std::path::PathBuf;

use clap::Args;
use rustls_pki_types::ServerName;

use crate::error::TlsError;

/// The TLS flags of the router and both node roles.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsArgs {
    /// This process's certificate chain (PEM): served on every listener, and presented as the
    /// client certificate when it dials another part of the cluster. Re-read when the file
    /// changes.
    #[arg(long, env = "PD_TLS_CERT", value_name = "FILE", help_heading = "TLS")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1). Re-read when it changes.
    #[arg(long, env = "PD_TLS_KEY", value_name = "FILE", help_heading = "TLS")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM) on this process's listeners
    /// (mTLS). A node answers UNAUTHENTICATED to callers without one; gRPC health stays open.
    #[arg(
        long,
        env = "PD_TLS_CLIENT_CA",
        value_name = "FILE",
        help_heading = "TLS"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// Dial the other parts of the cluster over TLS, verifying their certificates against
    /// this CA (PEM): router to nodes, decode node to prefill nodes' KV and gRPC.
    #[arg(long, env = "PD_TLS_CA", value_name = "FILE", help_heading = "TLS")]
    pub tls_ca: Option<PathBuf>,
    /// The name dialed servers' certificates are verified against, instead of the dialed
    /// host (for pods dialed by IP whose certificates name a Service).
    #[arg(
        long,
        env = "PD_TLS_SERVER_NAME",
        value_name = "NAME",
        help_heading = "TLS"
    )]
    pub tls_server_name: Option<String>,
    /// Allow listening on a non-loopback address without the required security (nodes:
    /// mTLS; router: TLS or API keys). Without it such a start is refused.
    #[arg(long, env = "PD_INSECURE", help_heading = "TLS")]
    pub insecure: bool,
}

/// This process's certificate chain and key files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The checked TLS settings of one process. The default is plaintext everywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// Serve TLS with this certificate (and present it when dialing).
    pub identity: Option<Identity>,
    /// Require client certificates signed by this CA (needs `identity`).
    pub client_ca: Option<PathBuf>,
    /// Dial TLS, verifying servers against this CA.
    pub ca: Option<PathBuf>,
    /// Verify dialed servers against this name instead of the dialed host (needs `ca`).
    pub server_name: Option<ServerName<'static>>,
    /// `--insecure`.
    pub insecure: bool,
}

impl TlsArgs {
    /// The settings these flags describe, or the first contradiction as one sentence.
    pub fn settings(&self) -> Result<TlsSettings, TlsError> {
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(Identity {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(TlsError::Flags(
                    "--tls-cert needs --tls-key: the certificate is useless without its key".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(TlsError::Flags(
                    "--tls-key needs --tls-cert: a key is served with its certificate".into(),
                ));
            }
        };
        if self.tls_client_ca.is_some() && identity.is_none() {
            return Err(TlsError::Flags(
                "--tls-client-ca needs --tls-cert and --tls-key: only a TLS server can ask its \
                 clients for certificates"
                    .into(),
            ));
        }
        let server_name = match &self.tls_server_name {
            None => None,
            Some(_) if self.tls_ca.is_none() => {
                return Err(TlsError::Flags(
                    "--tls-server-name needs --tls-ca: it names what dialed servers' \
                     certificates are verified against"
                        .into(),
                ));
            }
            Some(name) => Some(ServerName::try_from(name.clone()).map_err(|_| {
                TlsError::Flags(format!(
                    "--tls-server-name {name:?} is neither a DNS name nor an IP address"
                ))
            })?),
        };
        Ok(TlsSettings {
            identity,
            client_ca: self.tls_client_ca.clone(),
            ca: self.tls_ca.clone(),
            server_name,
            insecure: self.insecure,
        })
    }
}

impl TlsSettings {
    /// Whether listeners serve TLS.
    pub fn serves_tls(&self) -> bool {
        self.identity.is_some()
    }

    /// Whether listeners require client certificates (mTLS).
    pub fn requires_client_certs(&self) -> bool {
        self.identity.is_some() && self.client_ca.is_some()
    }

    /// Whether this process dials TLS.
    pub fn dials_tls(&self) -> bool {
        self.ca.is_some()
    }

    /// The settings as `--check-config` shows them: file paths and names, never contents.
    pub fn describe(&self) -> serde_json::Value {
        let path = |p: Option<&PathBuf>| p.map(|p| p.display().to_string());
        serde_json::json!({
            "cert": path(self.identity.as_ref().map(|i| &i.cert)),
            "key": path(self.identity.as_ref().map(|i| &i.key)),
            "client_ca": path(self.client_ca.as_ref()),
            "ca": path(self.ca.as_ref()),
            "server_name": self.server_name.as_ref().map(|n| n.to_str().into_owned()),
            "serves_tls": self.serves_tls(),
            "requires_client_certs": self.requires_client_certs(),
            "dials_tls": self.dials_tls(),
            "insecure": self.insecure,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        tls: TlsArgs,
    }

    fn settings(flags: &[&str]) -> Result<TlsSettings, TlsError> {
        let mut argv = vec!["x"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv).unwrap().tls.settings()
    }

    #[test]
    fn no_flags_is_plaintext() {
        let s = settings(&[]).unwrap();
        assert_eq!(s, TlsSettings::default());
        assert!(!s.serves_tls() && !s.requires_client_certs() && !s.dials_tls());
    }

    #[test]
    fn contradictions_are_refused_in_one_sentence() {
        for (flags, expected) in [
            (&["--tls-cert", "c.pem"][..], "--tls-cert needs --tls-key"),
            (&["--tls-key", "k.pem"], "--tls-key needs --tls-cert"),
            (
                &["--tls-client-ca", "ca.pem"],
                "--tls-client-ca needs --tls-cert",
            ),
            (
                &["--tls-server-name", "pd"],
                "--tls-server-name needs --tls-ca",
            ),
            (
                &["--tls-ca", "ca.pem", "--tls-server-name", "not a name!"],
                "neither a DNS name",
            ),
        ] {
            let message = settings(flags).unwrap_err().to_string();
            assert!(message.contains(expected), "{flags:?}: {message}");
            assert!(!message.contains('\n'), "{message}");
        }
    }

    #[test]
    fn full_mtls_settings() {
        let s = settings(&[
            "--tls-cert",
            "n.crt",
            "--tls-key",
            "n.key",
            "--tls-client-ca",
            "ca.crt",
            "--tls-ca",
            "ca.crt",
            "--tls-server-name",
            "pd-node",
        ])
        .unwrap();
        assert!(s.serves_tls() && s.requires_client_certs() && s.dials_tls());
        assert_eq!(s.describe()["server_name"], "pd-node");
    }
}
