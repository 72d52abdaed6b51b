//! The KV port with TLS and client certificates, over real sockets: a cluster member pulls;
//! a TLS client without a cluster certificate and a plaintext client are closed before any
//! byte of KV or of the layout (fingerprint, block size) reaches them.

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pd_engine::serve::LeaseSecret;
use pd_tls::certs::{ClusterCa, write_file};
use pd_tls::{Alpn, ClientTls, Identity, ServerTls, TlsSettings, dial};
use pd_transport::wire::PullRequestFrame;
use pd_transport::{ExportConfig, KvExportServer, KvPuller, LayoutFingerprint, PullRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::OneLease;

const FP: LayoutFingerprint = LayoutFingerprint(0x7e57_0000_0000_0042);
const LEASE: u64 = 7;
const SECRET: LeaseSecret = LeaseSecret::from_bytes(*b"tls test secret!");
const BLOCK: usize = 4096;

struct Certs {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn certs() -> Certs {
    let ca = ClusterCa::new("test CA").unwrap();
    let member = ca.issue_member(&[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let paths = ["ca.crt", "node.crt", "node.key"].map(|f| dir.path().join(f));
    write_file(&paths[0], ca.pem().cert.as_bytes(), false).unwrap();
    write_file(&paths[1], member.cert.as_bytes(), false).unwrap();
    write_file(&paths[2], member.key.as_bytes(), true).unwrap();
    let [ca, cert, key] = paths;
    Certs {
        _dir: dir,
        ca,
        cert,
        key,
    }
}

fn identity(c: &Certs) -> Option<Identity> {
    Some(Identity {
        cert: c.cert.clone(),
        key: c.key.clone(),
    })
}

async fn mtls_server(c: &Certs) -> (KvExportServer, SocketAddr) {
    let settings = TlsSettings {
        identity: identity(c),
        client_ca: Some(c.ca.clone()),
        ..TlsSettings::default()
    };
    let config = ExportConfig {
        tls: ServerTls::new(&settings, Alpn::None).unwrap(),
        ..ExportConfig::default()
    };
    let blocks = (0..4u8).map(|i| vec![i; BLOCK]).collect();
    let source = OneLease::new(LEASE, Some(SECRET), blocks);
    KvExportServer::bind_with("127.0.0.1:0".parse().unwrap(), FP, source, config)
        .await
        .unwrap()
}

fn client(c: &Certs, with_cert: bool) -> ClientTls {
    let settings = TlsSettings {
        identity: if with_cert { identity(c) } else { None },
        ca: Some(c.ca.clone()),
        ..TlsSettings::default()
    };
    ClientTls::new(&settings, Alpn::None).unwrap().unwrap()
}

fn req() -> PullRequest {
    PullRequest {
        lease_id: LEASE,
        lease_secret: SECRET,
        fingerprint: FP,
        first_block: 0,
        count: 4,
        block_bytes: BLOCK,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

#[tokio::test]
async fn a_cluster_member_pulls_over_mtls() {
    let c = certs();
    let (_server, addr) = mtls_server(&c).await;
    let puller = KvPuller::new().with_tls(Some(client(&c, true)));
    let blocks = puller.pull(addr, req(), soon()).await.unwrap();
    assert_eq!(blocks.len(), 4);
    assert!(blocks[3].as_bytes().iter().all(|&b| b == 3));
    // And again over the pooled TLS connection.
    assert_eq!(puller.pull(addr, req(), soon()).await.unwrap().len(), 4);
}

/// Everything the server sends after a valid pull request, until it closes.
async fn answer_to_a_pull(mut conn: pd_tls::Conn) -> Vec<u8> {
    let frame = PullRequestFrame {
        lease_id: LEASE,
        lease_secret: SECRET,
        fingerprint: FP,
        first_block: 0,
        count: 4,
        block_bytes: BLOCK as u64,
        timeout_ms: 5000,
    };
    let mut got = Vec::new();
    if conn.write_all(&frame.encode()).await.is_err() {
        return got;
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut got)).await;
    got
}

#[tokio::test]
async fn a_tls_client_without_a_cluster_certificate_gets_no_byte() {
    let c = certs();
    let (server, addr) = mtls_server(&c).await;
    let anonymous = client(&c, false);
    let conn = dial(Some(&anonymous), "127.0.0.1", addr.port())
        .await
        .unwrap();
    assert!(answer_to_a_pull(conn).await.is_empty(), "nothing is sent");
    let err = KvPuller::new()
        .with_tls(Some(anonymous))
        .pull(addr, req(), soon())
        .await
        .unwrap_err()
        .to_string();
    assert!(!err.contains(&FP.to_string()), "{err}");
    assert_eq!(server.stats().pulls_ok + server.stats().pulls_refused, 0);
}

#[tokio::test]
async fn a_plaintext_client_gets_no_kv_and_no_layout() {
    let c = certs();
    let (server, addr) = mtls_server(&c).await;
    let plain = dial(None, "127.0.0.1", addr.port()).await.unwrap();
    let answer = answer_to_a_pull(plain).await;
    // At most a TLS alert: nothing of the pull protocol (its frames carry the fingerprint).
    let fp = FP.0.to_le_bytes();
    assert!(!answer.windows(8).any(|w| w == fp), "{answer:?}");
    assert!(answer.len() < 64, "{} bytes", answer.len());
    assert!(KvPuller::new().pull(addr, req(), soon()).await.is_err());
    assert_eq!(server.stats().pulls_ok + server.stats().pulls_refused, 0);
}
