//! TLS for cluster tests: a cluster CA and member certificate written to a temporary
//! directory (what `pdctl certs` writes), the flags that give a part of the cluster mTLS,
//! and TLS clients (gRPC channels, health checks) trusting that CA.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use pd_tls::certs::{ClusterCa, write_file};
use pd_tls::{Alpn, ClientTls, Identity, TlsSettings};
use tonic::transport::{Channel, Endpoint};

/// A cluster's certificate files: `ca.crt`, and `node.crt` / `node.key` (one member
/// certificate for every part, as `pdctl certs` makes it).
pub struct TlsFiles {
    _dir: tempfile::TempDir,
    ca_issuer: ClusterCa,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// A new CA and member certificate (for localhost and 127.0.0.1).
    pub fn generate() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ca_issuer = ClusterCa::new("pd test CA").expect("a CA");
        let [ca, cert, key] = ["ca.crt", "node.crt", "node.key"].map(|f| dir.path().join(f));
        write_file(&ca, ca_issuer.pem().cert.as_bytes(), false).expect("ca.crt");
        let files = Self {
            _dir: dir,
            ca_issuer,
            ca,
            cert,
            key,
        };
        files.rotate();
        files
    }

    /// A new member certificate and key, written over the old files in place (as
    /// cert-manager rotates them).
    pub fn rotate(&self) {
        let member = self
            .ca_issuer
            .issue_member(&[])
            .expect("a member certificate");
        write_file(&self.key, member.key.as_bytes(), true).expect("node.key");
        write_file(&self.cert, member.cert.as_bytes(), false).expect("node.crt");
    }

    /// The flags of a cluster member with mTLS: serve TLS, demand cluster certificates,
    /// dial TLS with its own certificate.
    pub fn member_flags(&self) -> Vec<String> {
        let mut flags = self.identity_flags();
        flags.extend(["--tls-client-ca".into(), self.ca.display().to_string()]);
        flags
    }

    /// Serve TLS with the member certificate and verify the servers dialled against the CA,
    /// without demanding certificates of callers (a router whose clients bring API keys).
    pub fn identity_flags(&self) -> Vec<String> {
        let p = |p: &PathBuf| p.display().to_string();
        vec![
            "--tls-cert".into(),
            p(&self.cert),
            "--tls-key".into(),
            p(&self.key),
            "--tls-ca".into(),
            p(&self.ca),
        ]
    }

    /// A gRPC client's TLS trusting this CA, with the member certificate as its client
    /// identity when `with_cert`.
    pub fn client(&self, with_cert: bool) -> ClientTls {
        self.client_for(with_cert, Alpn::Grpc)
    }

    /// [`TlsFiles::client`] for a protocol.
    pub fn client_for(&self, with_cert: bool, alpn: Alpn) -> ClientTls {
        let settings = TlsSettings {
            identity: with_cert.then(|| Identity {
                cert: self.cert.clone(),
                key: self.key.clone(),
            }),
            ca: Some(self.ca.clone()),
            ..TlsSettings::default()
        };
        ClientTls::new(&settings, alpn)
            .expect("client TLS")
            .expect("a CA is set")
    }
}

/// A gRPC channel to `addr` (`host:port`), over TLS when `tls` is given.
pub async fn channel(addr: &str, tls: Option<&ClientTls>) -> anyhow::Result<Channel> {
    Endpoint::from_shared(format!("{}://{addr}", pd_tls::scheme(tls)))?
        .connect_timeout(Duration::from_secs(10))
        .connect_with_connector(pd_tls::Connector::new(tls.cloned()))
        .await
        .with_context(|| format!("connecting to {addr}"))
}

/// Waits (up to a minute) until the server at `addr` reports SERVING over `tls`.
pub async fn wait_serving(addr: &str, tls: Option<&ClientTls>) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(ch) = channel(addr, tls).await
            && pd_proto::health::is_serving(ch).await
        {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{addr} never reported SERVING"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A TLS connection to `authority` (HOST:PORT) trusting `tls`'s CA.
async fn dial(
    authority: &str,
    tls: &ClientTls,
) -> anyhow::Result<impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> {
    let (host, port) = authority
        .rsplit_once(':')
        .with_context(|| format!("{authority} is not HOST:PORT"))?;
    pd_tls::dial(Some(tls), host, port.parse()?)
        .await
        .with_context(|| format!("connecting to {authority} over TLS"))
}

/// `GET path` from `authority` (HOST:PORT) over HTTPS trusting `tls`'s CA: (status, body).
pub async fn https_get(
    authority: &str,
    tls: &ClientTls,
    path: &str,
) -> anyhow::Result<(u16, String)> {
    use http_body_util::BodyExt as _;
    let conn = dial(authority, tls).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(conn)).await?;
    tokio::spawn(connection);
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, authority)
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8(body.to_vec())?))
}

/// `GET https://HOST:PORT/metrics` (`addr` as HOST:PORT or as that URL) trusting `tls`'s CA:
/// the exposition text.
pub async fn scrape(addr: &str, tls: &ClientTls) -> anyhow::Result<String> {
    let authority = pd_test_support::metrics::authority(addr);
    let conn = dial(authority, tls).await?;
    Ok(pd_test_support::metrics::fetch_over(conn, authority)
        .await?
        .body)
}
