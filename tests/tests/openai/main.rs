//! The router's OpenAI-compatible HTTP API on a real cluster (`pdctl up`): it serves what
//! the gRPC API serves for the same request, streams what it would answer whole, refuses bad
//! bodies with OpenAI's error object, reads chat answers for reasoning and tool calls, and a
//! client that hangs up mid-stream cancels its generation and frees every block.
//!
//! Most tests share one of two clusters started once for this binary ([`plain`], [`hermes`]):
//! each test is its own `#[tokio::test]` so that one failure does not hide the others, and
//! takes its cluster's turn lock, since each checks counter deltas and ends with every block
//! free, which another test's requests would disturb. Every test uses prompts of its own, so
//! none depends on what an earlier one left in a prefix cache.

mod coder;
mod completions;
mod refusals;
mod structured;
mod tool_choice;
mod tools;
mod usage;

use std::sync::OnceLock;
use std::time::Duration;

use pd_proto::pb;
use pd_tests::{Cluster, all_blocks_free, client, exposition, greedy, http_post};
use serde_json::Value;
use tokio::sync::{Mutex, MutexGuard};
use tonic::transport::Channel;

type Grpc = pb::generation_client::GenerationClient<Channel>;

/// A cluster that several tests share, and the lock that gives them turns on it. The cluster's
/// processes are children of this process, so a test on any runtime reaches them; tokio's
/// lock works across runtimes and a test that fails while holding it does not poison it.
struct Shared {
    cluster: Cluster,
    turn: Mutex<()>,
    /// The cluster's own model cache: two clusters starting at once never write one cache.
    _cache: tempfile::TempDir,
}

impl Shared {
    fn start(up: impl FnOnce(&std::path::Path) -> Cluster) -> Self {
        let cache = tempfile::tempdir().expect("tempdir");
        let cluster = up(cache.path());
        cluster.stop_at_exit();
        Shared {
            cluster,
            turn: Mutex::new(()),
            _cache: cache,
        }
    }

    async fn turn(&'static self) -> Turn {
        let turn = self.turn.lock().await;
        let cluster = &self.cluster;
        Turn {
            cluster,
            base: cluster.openai(),
            grpc: client(&cluster.router()).await,
            lengths: outcomes(cluster, "length").await,
            _turn: turn,
        }
    }
}

/// A test's turn on a shared cluster: the cluster, its OpenAI API's base URL, a gRPC client
/// of its router, and how many requests had ended `length` when the turn began.
struct Turn {
    cluster: &'static Cluster,
    base: String,
    grpc: Grpc,
    lengths: f64,
    _turn: MutexGuard<'static, ()>,
}

impl Turn {
    /// Exactly `lengths` requests ended `length` during the turn (each HTTP choice is one
    /// request), and every block is free again.
    async fn end(self, lengths: f64) {
        assert_outcomes(self.cluster, "length", self.lengths, lengths).await;
        self.end_free().await;
    }

    /// Every block free again (for tests that count no requests).
    async fn end_free(self) {
        all_blocks_free(self.cluster).await;
    }
}

/// One prefill and one decode node (disaggregated), and the router: this test's turn on it.
async fn plain() -> Turn {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            Shared::start(|cache| Cluster::up(cache, &["--prefill", "1", "--decode", "1"]).unwrap())
        })
        .turn()
        .await
}

/// Aggregated mode with the router reading reasoning (qwen3) and Hermes tool calls: this
/// test's turn on it.
async fn hermes() -> Turn {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED
        .get_or_init(|| Shared::start(|cache| parsing_cluster(cache, "hermes")))
        .turn()
        .await
}

/// Aggregated mode (decode nodes only), the router reading reasoning (qwen3) and tool calls
/// (`tool_call_parser`).
fn parsing_cluster(cache: &std::path::Path, tool_call_parser: &str) -> Cluster {
    Cluster::up_with_env(
        cache,
        &["--prefill", "0", "--decode", "1"],
        &[
            ("PD_REASONING_PARSER", "qwen3"),
            ("PD_TOOL_CALL_PARSER", tool_call_parser),
        ],
    )
    .unwrap()
}

/// The router's count of requests that ended with `outcome`.
async fn outcomes(cluster: &Cluster, outcome: &str) -> f64 {
    exposition(&cluster.router_metrics())
        .await
        .unwrap()
        .sum("pd_router_requests_total", &[("outcome", outcome)])
}

/// Waits until `want` more requests than `before` ended with `outcome` (the router counts a
/// request as it ends, which may trail its response), then checks that no more did.
async fn assert_outcomes(cluster: &Cluster, outcome: &str, before: f64, want: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let now = outcomes(cluster, outcome).await - before;
        if now >= want {
            assert_eq!(now, want, "requests that ended {outcome}");
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{now} of {want} requests ended {outcome}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The whole text a gRPC request streams.
async fn grpc_text(grpc: &mut Grpc, req: pb::GenerateRequest) -> String {
    let mut stream = grpc
        .generate(req)
        .await
        .expect("gRPC generate")
        .into_inner();
    let mut text = String::new();
    while let Some(chunk) = stream.message().await.expect("gRPC stream") {
        text.push_str(&chunk.text);
    }
    text
}

/// A successful response's JSON.
async fn post_ok(base: &str, path: &str, body: Value) -> Value {
    let (status, text) = http_post(base, path, &body).await.expect("HTTP request");
    assert_eq!(status, 200, "{path} {body}: {text}");
    serde_json::from_str(&text).expect("a JSON response")
}

/// A refusal: its status and message.
async fn post_err(base: &str, path: &str, body: Value) -> (u16, String) {
    let (status, text) = http_post(base, path, &body).await.expect("HTTP request");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("JSON error: {text}"));
    let message = v["error"]["message"].as_str().expect("error.message");
    assert_eq!(v["error"]["code"], status, "{text}");
    (status, message.to_string())
}

fn sampled(ids: Vec<u32>, max_tokens: u32, seed: u64) -> pb::GenerateRequest {
    let mut req = greedy(ids, max_tokens);
    req.sampling = Some(pb::SamplingParams {
        temperature: Some(1.0),
        seed: Some(seed),
        ..Default::default()
    });
    req
}

/// A stream's chunks (its `data:` events but `[DONE]`), parsed.
fn stream_chunks(text: &str) -> Vec<Value> {
    let events = pd_tests::sse_data(text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}
