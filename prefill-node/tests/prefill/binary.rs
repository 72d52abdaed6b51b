//! The real `prefill-node` binary: its JSON ready line, health and reflection over gRPC, and
//! a clean exit on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::{cache, channel};

/// The real binary: one JSON ready line on stdout, health SERVING over gRPC, reflection,
/// and exit 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_its_ready_line_serves_health_and_exits_0_on_sigterm() {
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_prefill-node"))
            .args(["--port", "0", "--kv-port", "0"])
            .env("PD_CACHE_DIR", cache())
            .env_remove("PD_MODEL")
            .env_remove("PD_PORT")
            .env_remove("PD_KV_PORT")
            .env_remove("PD_METRICS_PORT")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("prefill-node starts"),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (line, rest) = tokio::task::spawn_blocking(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).expect("reads the ready line");
        (line, reader)
    })
    .await
    .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).expect("the ready line is JSON");
    let obj = ready.as_object().unwrap();
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["fingerprint", "grpc", "kv", "metrics_addr", "model", "role"],
        "{line}"
    );
    assert_eq!(ready["role"], "prefill");
    assert_eq!(ready["model"], "synthetic:tiny");
    let fingerprint = ready["fingerprint"].as_str().unwrap();
    assert!(fingerprint.len() == 16 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()));
    let grpc: std::net::SocketAddr = ready["grpc"].as_str().unwrap().parse().unwrap();
    let kv: std::net::SocketAddr = ready["kv"].as_str().unwrap().parse().unwrap();
    assert!(grpc.ip().is_loopback() && grpc.port() != 0 && kv.port() != 0);
    let metrics: std::net::SocketAddr = ready["metrics_addr"].as_str().unwrap().parse().unwrap();
    assert!(metrics.ip().is_loopback() && metrics.port() != 0);

    let mut health = HealthClient::new(channel(grpc).await);
    for service in ["", "pd.v1.PrefillService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }
    let services = reflected_services(grpc).await;
    for s in ["pd.v1.PrefillService", "grpc.health.v1.Health"] {
        assert!(services.iter().any(|x| x == s), "{s} in {services:?}");
    }
    // Only what this binary serves: not the router's API, nor the other role's.
    for s in ["pd.v1.Generation", "pd.v1.DecodeService"] {
        assert!(!services.iter().any(|x| x == s), "{s} not in {services:?}");
    }
    // A health watch stays open across the shutdown: it must not hold the exit up.
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        watch.message().await.unwrap().unwrap().status,
        ServingStatus::Serving as i32
    );

    let kill = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                panic!("prefill-node did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let mut rest = rest;
    let mut more = String::new();
    std::io::Read::read_to_string(&mut rest, &mut more).unwrap();
    assert!(
        more.is_empty(),
        "exactly one line on stdout, then: {more:?}"
    );
}

/// A child process killed if the test fails before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Service names listed by server reflection (v1).
async fn reflected_services(addr: std::net::SocketAddr) -> Vec<String> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut client = ServerReflectionClient::new(channel(addr).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    match stream.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer: {other:?}"),
    }
}
