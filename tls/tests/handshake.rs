//! pd-tls over real sockets: who completes a handshake, what the server learns about the
//! client, and certificate rotation with a connection open.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pd_tls::certs::{CertPem, ClusterCa, write_file};
use pd_tls::{Alpn, ClientTls, Conn, Identity, Listener, PeerInfo, ServerTls, TlsSettings, dial};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

struct Files {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn write_member(dir: &Path, name: &str, pem: &CertPem) -> (PathBuf, PathBuf) {
    let (cert, key) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    write_file(&cert, pem.cert.as_bytes(), false).unwrap();
    write_file(&key, pem.key.as_bytes(), true).unwrap();
    (cert, key)
}

fn cluster(ca: &ClusterCa) -> Files {
    let dir = tempfile::tempdir().unwrap();
    let ca_path = dir.path().join("ca.crt");
    write_file(&ca_path, ca.pem().cert.as_bytes(), false).unwrap();
    let (cert, key) = write_member(dir.path(), "node", &ca.issue_member(&[]).unwrap());
    Files {
        _dir: dir,
        ca: ca_path,
        cert,
        key,
    }
}

fn server_settings(f: &Files, mtls: bool) -> TlsSettings {
    TlsSettings {
        identity: Some(Identity {
            cert: f.cert.clone(),
            key: f.key.clone(),
        }),
        client_ca: mtls.then(|| f.ca.clone()),
        ..TlsSettings::default()
    }
}

fn client(ca: &Path, identity: Option<(&Path, &Path)>) -> ClientTls {
    let settings = TlsSettings {
        identity: identity.map(|(cert, key)| Identity {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        }),
        ca: Some(ca.to_path_buf()),
        ..TlsSettings::default()
    };
    ClientTls::new(&settings, Alpn::None).unwrap().unwrap()
}

/// A TLS echo server; each accepted connection's peer info is sent on the channel.
async fn echo_server(tls: ServerTls) -> (u16, tokio::sync::mpsc::UnboundedReceiver<PeerInfo>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut incoming = Listener::new(listener, Some(tls)).unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(mut conn)) = incoming.next().await {
            let _ = tx.send(conn.peer_info());
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                while let Ok(n @ 1..) = conn.read(&mut buf).await {
                    if conn.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, rx)
}

async fn echo(conn: &mut Conn, text: &[u8]) -> Vec<u8> {
    conn.write_all(text).await.unwrap();
    let mut back = vec![0u8; text.len()];
    conn.read_exact(&mut back).await.unwrap();
    back
}

#[tokio::test]
async fn the_server_learns_whether_the_client_presented_a_cluster_certificate() {
    let ca = ClusterCa::new("test CA").unwrap();
    let f = cluster(&ca);
    let tls = ServerTls::new(&server_settings(&f, true), Alpn::None)
        .unwrap()
        .unwrap();
    let (port, mut peers) = echo_server(tls).await;

    let mut member = dial(
        Some(&client(&f.ca, Some((&f.cert, &f.key)))),
        "127.0.0.1",
        port,
    )
    .await
    .unwrap();
    assert_eq!(echo(&mut member, b"hello").await, b"hello");
    assert!(peers.recv().await.unwrap().client_verified);

    let mut anonymous = dial(Some(&client(&f.ca, None)), "127.0.0.1", port)
        .await
        .unwrap();
    assert_eq!(echo(&mut anonymous, b"hi").await, b"hi");
    let peer = peers.recv().await.unwrap();
    assert!(peer.tls && !peer.client_verified);

    // A certificate from another CA does not get through the handshake.
    let other = cluster(&ClusterCa::new("another CA").unwrap());
    let stranger = client(&f.ca, Some((&other.cert, &other.key)));
    let refused = async {
        let mut conn = dial(Some(&stranger), "127.0.0.1", port).await?;
        // TLS 1.3: the server judges the client's certificate after the client finished.
        conn.write_all(b"x").await?;
        let mut buf = [0u8; 1];
        conn.read_exact(&mut buf).await.map(|_| ())
    };
    assert!(refused.await.is_err());
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_ca_or_speaks_plaintext_gets_nowhere() {
    let ca = ClusterCa::new("test CA").unwrap();
    let f = cluster(&ca);
    let tls = ServerTls::new(&server_settings(&f, false), Alpn::None)
        .unwrap()
        .unwrap();
    let (port, _peers) = echo_server(tls).await;
    let other = cluster(&ClusterCa::new("another CA").unwrap());
    assert!(
        dial(Some(&client(&other.ca, None)), "127.0.0.1", port)
            .await
            .is_err()
    );
    // The dialed name must be in the certificate.
    assert!(
        dial(Some(&client(&f.ca, None)), "127.0.0.2", port)
            .await
            .is_err()
    );

    let mut plain = dial(None, "127.0.0.1", port).await.unwrap();
    plain.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer)).await;
    assert!(
        !answer.windows(4).any(|w| w == b"GET "),
        "no echo in the clear"
    );
    assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");
}

#[tokio::test]
async fn rotated_files_are_used_by_new_connections_while_open_ones_keep_working() {
    let ca = ClusterCa::new("test CA").unwrap();
    let f = cluster(&ca);
    let tls = ServerTls::with_check_interval(
        &server_settings(&f, true),
        Alpn::None,
        Duration::from_millis(50),
    )
    .unwrap()
    .unwrap();
    let (port, _peers) = echo_server(tls).await;
    let me = client(&f.ca, Some((&f.cert, &f.key)));
    let mut before = dial(Some(&me), "127.0.0.1", port).await.unwrap();
    let first = before.server_certificates().unwrap();

    // Rewrite the files in place, as cert-manager does.
    let next = ca.issue_member(&[]).unwrap();
    write_file(&f.key, next.key.as_bytes(), true).unwrap();
    write_file(&f.cert, next.cert.as_bytes(), false).unwrap();
    let mut rotated = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let conn = dial(Some(&me), "127.0.0.1", port).await.unwrap();
        if conn.server_certificates().unwrap() != first {
            rotated = Some(conn);
            break;
        }
    }
    let mut rotated = rotated.expect("a new connection sees the new certificate");
    assert_eq!(echo(&mut rotated, b"new").await, b"new");
    assert_eq!(echo(&mut before, b"still here").await, b"still here");

    // A broken rewrite (a key that does not match) keeps the current certificate.
    let stray = ca.issue_member(&[]).unwrap();
    write_file(&f.key, stray.key.as_bytes(), true).unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    let after = dial(Some(&me), "127.0.0.1", port).await.unwrap();
    assert_eq!(after.server_certificates(), rotated.server_certificates());
}

#[test]
fn unreadable_or_invalid_files_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = TlsSettings {
        identity: Some(Identity {
            cert: dir.path().join("none.crt"),
            key: dir.path().join("none.key"),
        }),
        ..TlsSettings::default()
    };
    let err = ServerTls::new(&missing, Alpn::Grpc)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("none.crt") && err.contains("--tls-cert"),
        "{err}"
    );
    let junk = dir.path().join("junk.crt");
    std::fs::write(&junk, "not a certificate").unwrap();
    let key = dir.path().join("junk.key");
    std::fs::write(&key, "not a key").unwrap();
    let invalid = TlsSettings {
        identity: Some(Identity { cert: junk, key }),
        ..TlsSettings::default()
    };
    let err = ServerTls::new(&invalid, Alpn::Grpc)
        .unwrap_err()
        .to_string();
    assert!(err.contains("junk.crt"), "{err}");
    assert!(
        ServerTls::new(&TlsSettings::default(), Alpn::Grpc)
            .unwrap()
            .is_none()
    );
}
