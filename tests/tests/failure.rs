//! Failure isolation on a real cluster (2 prefill nodes, 1 decode node): a request that makes
//! a prefill node's engine panic (the nodes' test hook `PD_TEST_PANIC_ON_PROMPT`, set on every
//! node, honoured in builds with debug assertions) fails once with INTERNAL; by the time the
//! client has that answer, the node reports NOT_SERVING on gRPC health and on its metrics
//! port's `/health`; the request went to no other node (the other prefill node, armed the
//! same way, still serves and counted no prompt token of it; the router counted no retry);
//! and the cluster goes on serving other requests on the healthy node.

use std::time::Duration;

use pd_proto::pb;
use pd_tests::{Cluster, client, collect, exposition, greedy, metrics_authority};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

/// The prompt (token ids) that makes a node's engine panic.
const POISON: [u32; 6] = [1009, 1013, 1019, 1021, 1031, 1033];

/// Longer than anything here should take: reaching it means something hangs.
const HANG: Duration = Duration::from_secs(90);

/// A node's overall gRPC health (the empty service name).
async fn grpc_health(addr: &str) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("address")
        .connect()
        .await
        .expect("node reachable");
    let mut health = HealthClient::new(channel);
    let answer = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health answers")
        .into_inner();
    answer.status()
}

/// The HTTP status of `GET /health` on a node's metrics port.
async fn http_health(metrics: &str) -> u16 {
    let addr = metrics_authority(metrics);
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(conn);
    let request = hyper::Request::get("/health")
        .header(hyper::header::HOST, addr)
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .expect("request");
    sender
        .send_request(request)
        .await
        .expect("/health answers")
        .status()
        .as_u16()
}

/// Prompt tokens a node counted (`vllm:prompt_tokens_total`).
async fn prompt_tokens(metrics: &str) -> f64 {
    exposition(metrics)
        .await
        .expect("node /metrics")
        .sum("vllm:prompt_tokens_total", &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(debug_assertions),
    ignore = "the nodes honour the panic hook only in builds with debug assertions"
)]
async fn an_engine_panic_fails_its_request_once_takes_its_node_out_and_reaches_no_other_node() {
    let cache = tempfile::tempdir().unwrap();
    let poison = POISON.map(|t| t.to_string()).join(",");
    let cluster = Cluster::up_with_env(
        cache.path(),
        &["--prefill", "2", "--decode", "1"],
        &[("PD_TEST_PANIC_ON_PROMPT", &poison)],
    )
    .unwrap();
    let prefill = cluster.nodes("prefill");
    let prefill_metrics = cluster.node_metrics("prefill");
    let decode_metrics = cluster.node_metrics("decode");
    let mut c = client(&cluster.router()).await;

    // A normal request works, on either prefill node.
    collect(&mut c, greedy((100..140).collect(), 4))
        .await
        .expect("a normal request");
    let mut before = Vec::new();
    for m in prefill_metrics.iter().chain(&decode_metrics) {
        before.push(prompt_tokens(m).await);
    }

    let failed = tokio::time::timeout(HANG, collect(&mut c, greedy(POISON.to_vec(), 4)))
        .await
        .expect("no hang")
        .expect_err("the poison request fails");
    assert_eq!(failed.code(), tonic::Code::Internal, "{failed:?}");
    assert!(failed.message().contains("panic"), "{failed:?}");
    // Not "…; retried: …" (the message of a failure that was tried on a second node).
    assert!(!failed.message().contains("; retried:"), "{failed:?}");

    // Right now, with no waiting: the node that took it is NOT_SERVING, the other serves.
    let mut grpc = Vec::new();
    let mut http = Vec::new();
    for (addr, metrics) in prefill.iter().zip(&prefill_metrics) {
        grpc.push(grpc_health(addr).await);
        http.push(http_health(metrics).await);
    }
    let dead: Vec<usize> = (0..prefill.len())
        .filter(|&i| grpc[i] == ServingStatus::NotServing)
        .collect();
    assert_eq!(dead.len(), 1, "exactly one prefill node failed: {grpc:?}");
    let (dead, alive) = (dead[0], 1 - dead[0]);
    assert_eq!(grpc[alive], ServingStatus::Serving);
    assert_eq!(http[dead], 503, "{http:?}");
    assert_eq!(http[alive], 200, "{http:?}");

    // No other node saw the request: the live prefill node and the decode node counted no
    // prompt token of it.
    assert_eq!(prompt_tokens(&prefill_metrics[alive]).await, before[alive]);
    assert_eq!(prompt_tokens(&decode_metrics[0]).await, before[2]);

    let router = exposition(&cluster.router_metrics()).await.unwrap();
    assert_eq!(router.sum("pd_router_retries_total", &[]), 0.0);
    assert_eq!(
        router.sum("pd_router_requests_total", &[("outcome", "internal")]),
        1.0
    );

    // The cluster goes on serving, on the live node.
    let (ids, last) = tokio::time::timeout(HANG, collect(&mut c, greedy((200..240).collect(), 4)))
        .await
        .expect("no hang")
        .expect("a request after the panic");
    assert_eq!(ids.len(), 4);
    assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    assert!(prompt_tokens(&prefill_metrics[alive]).await > before[alive]);
    assert_eq!(grpc_health(&prefill[alive]).await, ServingStatus::Serving);
}
