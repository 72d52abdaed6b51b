//! Certificate files into rustls configurations: reading and parsing the PEM files named by
//! the flags (every failure names the file), and building the server and client configs.
//! Only the `ring` provider is used.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::TlsError;

/// The one crypto provider of the project: ring. rustls marks it deprecated because it has
/// no post-quantum key exchange (only the aws-lc-rs provider has); the project builds without
/// aws-lc-rs (no cmake or per-target C toolchain), so classical X25519/P-256 it is.
///
/// AES-128-GCM is offered first (ring's default puts AES-256-GCM first): KV pulls move
/// gigabytes through one core's cipher on each side, AES-128 runs 10 rounds where AES-256
/// runs 14, and 128-bit keys are what TLS recommends for bulk data. Both ends use this order.
#[allow(deprecated)]
pub(crate) fn provider() -> Arc<CryptoProvider> {
    use rustls::CipherSuite;
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|s| {
        !matches!(
            s.suite(),
            CipherSuite::TLS13_AES_128_GCM_SHA256
                | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        )
    });
    Arc::new(provider)
}

/// The bytes of one file a configuration is built from, kept to notice when it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileBytes {
    pub what: &'static str,
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl FileBytes {
    pub fn read(what: &'static str, path: &Path) -> Result<Self, TlsError> {
        let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
            what,
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            what,
            path: path.to_path_buf(),
            bytes,
        })
    }

    fn pem_error(&self, message: impl Into<String>) -> TlsError {
        TlsError::Pem {
            what: self.what,
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// Every certificate in the file, in order; at least one.
    pub fn certificates(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let certs = CertificateDer::pem_slice_iter(&self.bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.pem_error(e.to_string()))?;
        if certs.is_empty() {
            return Err(self.pem_error("no PEM CERTIFICATE block in it"));
        }
        Ok(certs)
    }

    /// The private key in the file.
    pub fn private_key(&self) -> Result<PrivateKeyDer<'static>, TlsError> {
        PrivateKeyDer::from_pem_slice(&self.bytes).map_err(|e| self.pem_error(e.to_string()))
    }

    /// The certificates of a CA file as trust roots.
    pub fn roots(&self) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        for cert in self.certificates()? {
            roots
                .add(cert)
                .map_err(|e| self.pem_error(format!("not a usable CA certificate: {e}")))?;
        }
        Ok(Arc::new(roots))
    }
}

/// What a server configuration is built from: certificate, key, optional client CA.
pub(crate) fn server_config(files: &[FileBytes], alpn: &[&[u8]]) -> Result<ServerConfig, TlsError> {
    let (cert, key, client_ca) = match files {
        [cert, key] => (cert, key, None),
        [cert, key, ca] => (cert, key, Some(ca)),
        _ => unreachable!("a server configuration is built from 2 or 3 files"),
    };
    let chain = cert.certificates()?;
    let key_der = key.private_key()?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            context: "the TLS provider".into(),
            source,
        })?;
    let builder = match client_ca {
        // Clients without a certificate still complete the handshake, so that the gRPC
        // layer can answer UNAUTHENTICATED (a handshake failure tells a caller nothing); a
        // certificate that is presented must verify against the CA.
        Some(ca) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(ca.roots()?, provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Verifier {
                    path: ca.path.clone(),
                    message: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config =
        builder
            .with_single_cert(chain, key_der)
            .map_err(|source| TlsError::Rustls {
                context: format!(
                    "{} and {} do not make a usable certificate and key",
                    cert.path.display(),
                    key.path.display()
                ),
                source,
            })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// What a client configuration is built from: the CA, and optionally this process's
/// certificate and key (its client identity).
pub(crate) fn client_config(files: &[FileBytes], alpn: &[&[u8]]) -> Result<ClientConfig, TlsError> {
    let (ca, identity) = match files {
        [ca] => (ca, None),
        [ca, cert, key] => (ca, Some((cert, key))),
        _ => unreachable!("a client configuration is built from 1 or 3 files"),
    };
    let provider = provider();
    let verifier = WebPkiServerVerifier::builder_with_provider(ca.roots()?, Arc::clone(&provider))
        .build()
        .map_err(|e| TlsError::Verifier {
            path: ca.path.clone(),
            message: e.to_string(),
        })?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            context: "the TLS provider".into(),
            source,
        })?
        .with_webpki_verifier(verifier);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(cert.certificates()?, key.private_key()?)
            .map_err(|source| TlsError::Rustls {
                context: format!(
                    "{} and {} do not make a usable client certificate and key",
                    cert.path.display(),
                    key.path.display()
                ),
                source,
            })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}
