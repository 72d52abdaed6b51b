//! TLS and mTLS through the real binaries on 127.0.0.1 with ephemeral ports: nodes serve
//! only callers with a cluster certificate (UNAUTHENTICATED otherwise, health left open);
//! TLS ports refuse plaintext clients; a cluster whose every hop is TLS answers exactly what
//! a plaintext one does; rotated certificate files reach new connections while a stream
//! opened before keeps streaming; a node or router bound beyond loopback without its
//! security refuses to start unless --insecure.

use std::path::Path;
use std::process::Command;

use pd_proto::pb;
use pd_tests::tls::{TlsFiles, channel, wait_serving};
use pd_tests::{Process, bin_dir, greedy};
use pd_tls::{Alpn, ClientTls};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

const MODEL: &str = "synthetic:tiny";

fn start(bin: &str, cache: &Path, flags: &[String]) -> Process {
    let mut args: Vec<&str> = vec!["--model", MODEL];
    args.extend(flags.iter().map(String::as_str));
    Process::start(bin, cache, &args).unwrap_or_else(|e| panic!("{bin}: {e:#}"))
}

/// Router flags: TLS to its clients, TLS with the member certificate to the nodes (clients
/// are not cluster members: no --tls-client-ca).
fn router_flags(tls: &TlsFiles) -> Vec<String> {
    let p = |p: &Path| p.display().to_string();
    vec![
        "--tls-cert".into(),
        p(&tls.cert),
        "--tls-key".into(),
        p(&tls.key),
        "--tls-ca".into(),
        p(&tls.ca),
    ]
}

/// A prefill node, a decode node and a router, with mTLS between them when `tls` is given.
async fn cluster(cache: &Path, tls: Option<&TlsFiles>) -> [Process; 3] {
    let member = tls.map(TlsFiles::member_flags).unwrap_or_default();
    let prefill = start("prefill-node", cache, &member);
    let decode = start("decode-node", cache, &member);
    let mut flags = tls.map(router_flags).unwrap_or_default();
    flags.extend([
        "--health-interval-ms".into(),
        "200".into(),
        "--prefill".into(),
        prefill.addr(),
        "--decode".into(),
        decode.addr(),
    ]);
    let router = start("router", cache, &flags);
    let client_tls = tls.map(|t| t.client(false));
    wait_serving(&router.addr(), client_tls.as_ref())
        .await
        .expect("the router serves");
    [prefill, decode, router]
}

fn prompt() -> Vec<u32> {
    (0..40).map(|t| (t * 7919 + 11) % 150_000).collect()
}

async fn generate(addr: &str, tls: Option<&ClientTls>, max_tokens: u32) -> Vec<u32> {
    let mut client =
        pb::generation_client::GenerationClient::new(channel(addr, tls).await.unwrap());
    let mut stream = client
        .generate(greedy(prompt(), max_tokens))
        .await
        .expect("generate")
        .into_inner();
    let mut ids = Vec::new();
    while let Some(chunk) = stream.message().await.expect("a chunk") {
        ids.extend(chunk.token_ids);
    }
    ids
}

fn assert_unauthenticated<T: std::fmt::Debug>(what: &str, result: Result<T, tonic::Status>) {
    match result {
        Err(status) => assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}"),
        Ok(answer) => panic!("{what} answered a caller without a certificate: {answer:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_serve_only_callers_with_a_cluster_certificate() {
    let cache = tempfile::tempdir().unwrap();
    let tls = TlsFiles::generate();
    let prefill = start("prefill-node", cache.path(), &tls.member_flags());
    let decode = start("decode-node", cache.path(), &tls.member_flags());

    let anonymous = tls.client(false);
    let ch = channel(&prefill.addr(), Some(&anonymous)).await.unwrap();
    let mut p = pb::prefill_service_client::PrefillServiceClient::new(ch.clone());
    assert_unauthenticated("Prefill", p.prefill(pb::PrefillRequest::default()).await);
    assert_unauthenticated(
        "ReleaseKv",
        p.release_kv(pb::ReleaseKvRequest::default()).await,
    );
    assert_unauthenticated("Abort", p.abort(pb::NodeAbortRequest::default()).await);
    assert_unauthenticated("Info", p.info(pb::InfoRequest {}).await);
    assert_unauthenticated(
        "RdmaConnect",
        p.rdma_connect(pb::RdmaConnectRequest::default()).await,
    );
    // Server reflection would describe the node's API: closed too.
    let mut raw = tonic::client::Grpc::new(ch.clone());
    raw.ready().await.unwrap();
    let reflection = raw
        .unary(
            tonic::Request::new(pb::InfoRequest {}),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            ),
            tonic_prost::ProstCodec::<pb::InfoRequest, pb::NodeInfo>::default(),
        )
        .await;
    assert_unauthenticated("reflection", reflection);
    // Health stays open for probes.
    assert!(pd_proto::health::is_serving(ch).await);

    let ch = channel(&decode.addr(), Some(&anonymous)).await.unwrap();
    let mut d = pb::decode_service_client::DecodeServiceClient::new(ch);
    assert_unauthenticated("Decode", d.decode(pb::DecodeRequest::default()).await);
    assert_unauthenticated("Abort", d.abort(pb::NodeAbortRequest::default()).await);
    assert_unauthenticated("Info", d.info(pb::InfoRequest {}).await);

    // A cluster member is served.
    let member = tls.client(true);
    let ch = channel(&prefill.addr(), Some(&member)).await.unwrap();
    let info = pb::prefill_service_client::PrefillServiceClient::new(ch)
        .info(pb::InfoRequest {})
        .await
        .expect("a member calls Info")
        .into_inner();
    assert!(info.num_blocks > 0);
    let ch = channel(&decode.addr(), Some(&member)).await.unwrap();
    pb::decode_service_client::DecodeServiceClient::new(ch)
        .info(pb::InfoRequest {})
        .await
        .expect("a member calls Info");

    // A plaintext gRPC client gets nowhere on the TLS port.
    let plain = match channel(&prefill.addr(), None).await {
        Ok(ch) => pb::prefill_service_client::PrefillServiceClient::new(ch)
            .info(pb::InfoRequest {})
            .await
            .map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(plain.is_err(), "plaintext gRPC to a TLS port");
}

/// What a server answers to a plaintext HTTP/1.1 request (until it closes or 5 s pass).
async fn plaintext_http_answer(addr: &str) -> Vec<u8> {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut conn = pd_tls::dial(None, host, port.parse().unwrap())
        .await
        .unwrap();
    let _ = conn
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await;
    let mut answer = Vec::new();
    let read = conn.read_to_end(&mut answer);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), read).await;
    answer
}

/// `GET path` over HTTPS trusting the cluster CA: the status code.
async fn https_get(addr: &str, tls: &ClientTls, path: &str) -> u16 {
    pd_tests::tls::https_get(addr, tls, path)
        .await
        .expect("an HTTPS answer")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_answers_like_a_plaintext_one_and_refuses_plaintext_clients() {
    let cache = tempfile::tempdir().unwrap();
    let tls = TlsFiles::generate();
    let plain = cluster(cache.path(), None).await;
    let expected = generate(&plain[2].addr(), None, 24).await;
    drop(plain);

    let secure = cluster(cache.path(), Some(&tls)).await;
    let router = &secure[2];
    let got = generate(&router.addr(), Some(&tls.client(false)), 24).await;
    assert_eq!(got.len(), 24);
    assert_eq!(got, expected, "the same greedy tokens over TLS");

    // The router's HTTP API and /metrics speak HTTPS, and nothing to plaintext clients.
    let http = router.ready["http"].as_str().unwrap().to_string();
    let metrics = router.ready["metrics_addr"].as_str().unwrap().to_string();
    let https = tls.client_for(false, Alpn::Http1);
    assert_eq!(https_get(&http, &https, "/health").await, 200);
    assert_eq!(https_get(&metrics, &https, "/metrics").await, 200);
    for addr in [&http, &metrics] {
        let answer = plaintext_http_answer(addr).await;
        assert!(!answer.starts_with(b"HTTP/"), "{addr}: {answer:?}");
    }
    // So do the nodes' /metrics.
    let node_metrics = secure[0].ready["metrics_addr"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(https_get(&node_metrics, &https, "/metrics").await, 200);
    assert!(
        !plaintext_http_answer(&node_metrics)
            .await
            .starts_with(b"HTTP/")
    );
    // And a plaintext gRPC client of the router gets no answer.
    let plain_client = match channel(&router.addr(), None).await {
        Ok(ch) => pb::generation_client::GenerationClient::new(ch)
            .list_models(pb::ListModelsRequest {})
            .await
            .map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(plain_client.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificates_reach_new_connections_while_a_stream_keeps_streaming() {
    let cache = tempfile::tempdir().unwrap();
    let tls = TlsFiles::generate();
    let parts = cluster(cache.path(), Some(&tls)).await;
    let router = &parts[2];
    let client_tls = tls.client(false);
    let mut client = pb::generation_client::GenerationClient::new(
        channel(&router.addr(), Some(&client_tls)).await.unwrap(),
    );
    let max_tokens = 1500;
    let mut stream = client
        .generate(greedy(prompt(), max_tokens))
        .await
        .expect("a stream")
        .into_inner();
    let mut received = 0;
    while received < 2 {
        received += stream.message().await.unwrap().unwrap().token_ids.len();
    }

    let port = router.port();
    let certificate = || async {
        pd_tls::dial(Some(&client_tls), "127.0.0.1", port)
            .await
            .expect("a TLS connection")
            .server_certificates()
            .expect("the router's certificate")
    };
    let before = certificate().await;
    tls.rotate();
    let mut rotated = false;
    for _ in 0..200 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        if certificate().await != before {
            rotated = true;
            break;
        }
    }
    assert!(rotated, "a new connection sees the rotated certificate");

    while let Some(chunk) = stream.message().await.expect("the stream keeps going") {
        received += chunk.token_ids.len();
    }
    assert_eq!(received, max_tokens as usize, "the whole stream arrived");
    // New requests work with the rotated certificates on every hop.
    assert_eq!(
        generate(&router.addr(), Some(&tls.client(false)), 8)
            .await
            .len(),
        8
    );
}

fn run(bin: &str, args: &[&str], cache: &Path) -> std::process::Output {
    Command::new(bin_dir().join(bin))
        .args(args)
        .env("PD_CACHE_DIR", cache)
        .env_remove("PD_MODEL")
        .output()
        .expect("the binary runs")
}

#[test]
fn beyond_loopback_without_security_a_part_refuses_to_start_unless_insecure() {
    let cache = tempfile::tempdir().unwrap();
    let c = cache.path();
    for bin in ["prefill-node", "decode-node"] {
        let out = run(bin, &["--host", "0.0.0.0", "--check-config"], c);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bin}: {err}");
        assert!(
            err.contains("without mTLS") && err.contains("--insecure"),
            "{bin}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "one sentence: {err}");
        let ok = run(
            bin,
            &["--host", "0.0.0.0", "--check-config", "--insecure"],
            c,
        );
        assert!(
            ok.status.success(),
            "{bin} --insecure: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
    }
    // A real start fails the same way, before any model is loaded.
    let out = run("decode-node", &["--host", "0.0.0.0", "--port", "0"], c);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("without mTLS"));

    // With mTLS the node may listen anywhere; --check-config shows the TLS settings.
    let tls = TlsFiles::generate();
    let mut args = vec![
        "--host".to_string(),
        "0.0.0.0".into(),
        "--check-config".into(),
    ];
    args.extend(tls.member_flags());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ok = run("prefill-node", &args, c);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let config: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(config["tls"]["requires_client_certs"], true, "{config}");

    let out = run(
        "router",
        &[
            "--host",
            "0.0.0.0",
            "--decode",
            "127.0.0.1:1",
            "--check-config",
        ],
        c,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("neither TLS nor API keys"), "{err}");
    let ok = run(
        "router",
        &[
            "--host",
            "0.0.0.0",
            "--decode",
            "127.0.0.1:1",
            "--check-config",
            "--insecure",
        ],
        c,
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdctl_certs_secure_a_cluster_that_pdctl_reaches_with_ca() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let made = pd_tests::pdctl(
        cache.path(),
        &["certs", "--out", out, "--hosts", "pd-router"],
    );
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let again = pd_tests::pdctl(cache.path(), &["certs", "--out", out, "--hosts", "x"]);
    assert!(
        !again.status.success(),
        "existing files are not overwritten"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));

    let file = |f: &str| dir.path().join(f).display().to_string();
    let member: Vec<String> = [
        "--tls-cert",
        &file("node.crt"),
        "--tls-key",
        &file("node.key"),
        "--tls-client-ca",
        &file("ca.crt"),
        "--tls-ca",
        &file("ca.crt"),
    ]
    .map(String::from)
    .to_vec();
    let prefill = start("prefill-node", cache.path(), &member);
    let decode = start("decode-node", cache.path(), &member);
    let mut flags = member[..4].to_vec();
    flags.extend(member[6..].iter().cloned());
    flags.extend([
        "--prefill".into(),
        prefill.addr(),
        "--decode".into(),
        decode.addr(),
    ]);
    let router = start("router", cache.path(), &flags);
    let ca_only = pd_tls::TlsSettings {
        ca: Some(dir.path().join("ca.crt")),
        ..Default::default()
    };
    let client_tls = ClientTls::new(&ca_only, Alpn::Grpc).unwrap();
    wait_serving(&router.addr(), client_tls.as_ref())
        .await
        .unwrap();

    let addr = router.addr();
    let ca = file("ca.crt");
    let ask = |extra: &[&str]| {
        let mut args = vec!["generate", "--router", &addr, "--token-ids", "5,6,7,8"];
        args.extend(["--max-tokens", "6", "--temperature", "0", "--json"]);
        args.extend_from_slice(extra);
        pd_tests::pdctl(cache.path(), &args)
    };
    let answer = ask(&["--ca", &ca]);
    assert!(
        answer.status.success(),
        "{}",
        String::from_utf8_lossy(&answer.stderr)
    );
    assert_eq!(pd_tests::token_ids(&pd_tests::json_of(&answer)).len(), 6);
    assert!(
        !ask(&[]).status.success(),
        "plaintext to the TLS router fails"
    );

    let metrics = router.ready["metrics_addr"].as_str().unwrap().to_string();
    let scraped = pd_tests::pdctl(
        cache.path(),
        &[
            "metrics",
            "--router-metrics",
            &metrics,
            "--once",
            "--json",
            "--ca",
            &ca,
        ],
    );
    assert!(
        scraped.status.success(),
        "{}",
        String::from_utf8_lossy(&scraped.stderr)
    );
}
