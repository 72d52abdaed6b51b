//! Tenant limits on a real cluster (`pdctl up` with the router's `--api-keys` and
//! `--tenant-limits`): with the same prompt-token budget, a tenant whose prompts hit the prefix
//! cache keeps being served while a tenant whose prompts are all computed is refused
//! (RESOURCE_EXHAUSTED over gRPC, 429 over HTTP), and the refusals are counted by tenant and
//! reason.

use pd_tests::{
    Cluster, all_blocks_free, client, collect_as, exposition, greedy, http_post_as, spread_prompts,
};

const KEY_REUSE: &str = "tenant-reuse-key-00000001";
const KEY_FRESH: &str = "tenant-fresh-key-00000001";

/// A prompt of four and a half 16-token blocks.
fn prompt(salt: u32) -> Vec<u32> {
    spread_prompts(1, 72, 1, salt).remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prompt_tokens_stretch_a_tenant_s_budget_and_computed_ones_exhaust_it() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("api-keys");
    std::fs::write(&keys, format!("reuse {KEY_REUSE}\nfresh {KEY_FRESH}\n")).unwrap();
    // 200 prompt tokens of room each, refilled at 0.001 a second (nothing refills in a test);
    // a cached token costs a tenth of a computed one (the default).
    let limits = dir.path().join("tenant-limits");
    std::fs::write(
        &limits,
        "default prompt_tokens_per_second=0.001 prompt_tokens_per_second_burst=200\n",
    )
    .unwrap();
    let limits = limits.to_str().unwrap();
    let cluster = Cluster::up_with_keys(
        dir.path(),
        &["--http-port", "0"],
        &keys,
        &[("PD_TENANT_LIMITS_FILE", limits)],
    )
    .unwrap();
    let mut c = client(&cluster.router()).await;

    // `fresh`: a new 72-token prompt each time, all computed: 72 each. Three pass (the third
    // with 56 left), leaving it in debt.
    for salt in 0..3 {
        let (_, last) = collect_as(&mut c, greedy(prompt(100 + salt), 2), Some(KEY_FRESH))
            .await
            .unwrap();
        assert_eq!(last.usage.unwrap().cached_tokens, 0);
    }
    let refused = collect_as(&mut c, greedy(prompt(200), 2), Some(KEY_FRESH))
        .await
        .expect_err("over its prompt tokens");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("prompt tokens"),
        "{}",
        refused.message()
    );
    let body = serde_json::json!({"prompt": "hello", "max_tokens": 2});
    let (status, text) = http_post_as(&cluster.openai(), "/completions", &body, Some(KEY_FRESH))
        .await
        .unwrap();
    assert_eq!(status, 429, "{text}");

    // `reuse`: one 72-token prompt eight times, more prompt tokens than `fresh` sent. The
    // first computes it (72); each later one finds its 64 tokens of whole blocks cached and
    // costs 8 + 6.4: 72 + 7 × 14.4 < 200.
    let ids = prompt(7);
    for i in 0..8 {
        let (_, last) = collect_as(&mut c, greedy(ids.clone(), 2), Some(KEY_REUSE))
            .await
            .unwrap_or_else(|e| panic!("request {i} of `reuse`: {e:?}"));
        if i > 0 {
            assert_eq!(last.usage.unwrap().cached_tokens, 64);
        }
    }

    let metrics = exposition(&cluster.router_metrics()).await.unwrap();
    let rejected = |tenant: &str| {
        metrics.sum(
            "pd_router_tenant_requests_rejected_total",
            &[("tenant", tenant), ("reason", "prompt_tokens")],
        )
    };
    assert_eq!(rejected("fresh"), 2.0);
    assert_eq!(rejected("reuse"), 0.0);
    all_blocks_free(&cluster).await;
}
