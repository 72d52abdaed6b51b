//! Admission control on a real cluster (`pdctl up` with `PD_MAX_INFLIGHT=2 PD_MAX_QUEUE=0`):
//! a third concurrent request is refused at once, RESOURCE_EXHAUSTED over gRPC and 429 with
//! `Retry-After` over HTTP, while the first two are still streaming; both then complete,
//! and the refusals are counted on the router's `/metrics`.

use pd_proto::pb;
use pd_tests::{Cluster, all_blocks_free, client, collect, greedy, http_post};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_inflight_a_request_is_refused_while_two_stream_and_both_complete() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up_with_env(
        cache.path(),
        &["--prefill", "1", "--decode", "1"],
        &[("PD_MAX_INFLIGHT", "2"), ("PD_MAX_QUEUE", "0")],
    )
    .unwrap();
    let mut c = client(&cluster.router()).await;
    // Two long requests, read to their first chunk only: an admission slot is held until
    // the client has its stream's end, so both are in flight whatever the model's speed.
    let mut streams = Vec::new();
    for salt in 0..2 {
        let req = greedy((salt..salt + 40).collect(), 200);
        let mut stream = c.generate(req).await.unwrap().into_inner();
        stream.message().await.unwrap().expect("a first chunk");
        streams.push(stream);
    }

    let refused = collect(&mut c, greedy(vec![1, 2, 3], 4))
        .await
        .expect_err("a third request is refused");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert_eq!(refused.metadata().get("retry-after").unwrap(), "1");
    let body = serde_json::json!({"prompt": "hello", "max_tokens": 4});
    let (status, text) = http_post(&cluster.openai(), "/completions", &body)
        .await
        .unwrap();
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("rate_limit_error"), "{text}");

    // Both streams were still open; they complete.
    for mut stream in streams {
        let mut last = None;
        while let Some(chunk) = stream.message().await.unwrap() {
            last = Some(chunk);
        }
        assert_eq!(last.unwrap().finish_reason(), pb::FinishReason::Length);
    }
    // Slots free again.
    collect(&mut c, greedy(vec![1, 2, 3], 4)).await.unwrap();
    let metrics = cluster.exposition(&cluster.router_metrics()).await.unwrap();
    assert_eq!(
        metrics.sum(
            "pd_router_requests_rejected_total",
            &[("reason", "queue_full")]
        ),
        2.0
    );
    assert_eq!(
        metrics.sum(
            "pd_router_requests_total",
            &[("outcome", "resource_exhausted")]
        ),
        2.0
    );
    all_blocks_free(&cluster).await;
}
