//! Tenants on a real cluster (`pdctl up` with the router's `--api-keys`): cached KV is a
//! tenant's own unless `--shared-prefix-cache`; per-tenant usage on the router's `/metrics`
//! equals the sums of the tenants' `usage`; SHA-256 block hashing serves the same tokens and
//! still hits the cache.

use std::path::PathBuf;
use std::process::Command;

use pd_proto::pb;
use pd_tests::{
    Cluster, all_blocks_free, bin_dir, client, collect_as, exposition, greedy, http_post_as,
    node_info, pdctl, reference_tokens, spread_prompts, with_key,
};

const KEY_A: &str = "tenant-a-key-0000000001";
const KEY_B: &str = "tenant-b-key-0000000001";

fn keys(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("api-keys");
    std::fs::write(&path, format!("a {KEY_A}\nb {KEY_B}\n")).unwrap();
    path
}

/// A prompt of four and a half 16-token blocks.
fn prompt(salt: u32) -> Vec<u32> {
    spread_prompts(1, 72, 1, salt).remove(0)
}

async fn cached(
    c: &mut pd_proto::pb::generation_client::GenerationClient<tonic::transport::Channel>,
    ids: &[u32],
    key: &str,
) -> u32 {
    let (_, last) = collect_as(c, greedy(ids.to_vec(), 4), Some(key))
        .await
        .unwrap();
    last.usage.unwrap().cached_tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_own_their_cache_and_their_usage_is_counted_exactly() {
    let cache = tempfile::tempdir().unwrap();
    let path = keys(cache.path());
    let cluster = Cluster::up_with_keys(cache.path(), &["--http-port", "0"], &path, &[]).unwrap();
    let mut c = client(&cluster.router()).await;

    // Keys are required, over gRPC and HTTP.
    let refused = c.generate(with_key(greedy(prompt(1), 2), None)).await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::Unauthenticated);
    let body = serde_json::json!({"prompt": "hi", "max_tokens": 2});
    let (status, text) = http_post_as(&cluster.openai(), "/completions", &body, Some("nope"))
        .await
        .unwrap();
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("invalid_api_key"), "{text}");

    // One tenant twice: hits. Another tenant, the same prompt: nothing cached for it.
    let ids = prompt(7);
    assert_eq!(cached(&mut c, &ids, KEY_A).await, 0);
    assert!(cached(&mut c, &ids, KEY_A).await > 0);
    assert_eq!(
        cached(&mut c, &ids, KEY_B).await,
        0,
        "B sees nothing of A's"
    );
    assert!(cached(&mut c, &ids, KEY_B).await > 0, "B's own cache works");

    // A mixed run of the two tenants over both APIs, usage summed per tenant:
    // [prompt, cached (local + external), local, external, completion].
    let metrics = cluster.router_metrics();
    let before = exposition(&metrics).await.unwrap();
    let mut sums = std::collections::HashMap::<&str, [f64; 5]>::new();
    let mut add = |tenant, u: &pb::Usage| {
        let s = sums.entry(tenant).or_default();
        s[0] += f64::from(u.prompt_tokens);
        s[1] += f64::from(u.cached_tokens);
        s[2] += f64::from(u.local_cached_tokens);
        s[3] += f64::from(u.external_cached_tokens);
        s[4] += f64::from(u.completion_tokens);
    };
    for (i, (tenant, key)) in [
        ("a", KEY_A),
        ("b", KEY_B),
        ("a", KEY_A),
        ("b", KEY_B),
        ("a", KEY_A),
    ]
    .into_iter()
    .enumerate()
    {
        let ids = prompt(20 + (i as u32 % 2));
        let (_, last) = collect_as(&mut c, greedy(ids, 3 + i as u32), Some(key))
            .await
            .unwrap();
        add(tenant, last.usage.as_ref().unwrap());
    }
    let mut http_requests = 0.0;
    for (tenant, key) in [("a", KEY_A), ("b", KEY_B)] {
        let body = serde_json::json!({
            "prompt": "Once upon a time, in a land far away, there lived",
            "max_tokens": 5, "n": 2, "ignore_eos": true,
        });
        let (status, text) = http_post_as(&cluster.openai(), "/completions", &body, Some(key))
            .await
            .unwrap();
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let u = &v["usage"];
        let usage = pb::Usage {
            prompt_tokens: u["prompt_tokens"].as_u64().unwrap() as u32,
            completion_tokens: u["completion_tokens"].as_u64().unwrap() as u32,
            cached_tokens: u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0) as u32,
            ..Default::default()
        };
        add(tenant, &usage);
        http_requests += 2.0;
    }
    let after = exposition(&metrics).await.unwrap();
    let delta =
        |name: &str, labels: &[(&str, &str)]| after.sum(name, labels) - before.sum(name, labels);
    for (tenant, s) in &sums {
        let by = |source| {
            delta(
                "pd_router_tenant_prompt_tokens_total",
                &[("tenant", tenant), ("source", source)],
            )
        };
        let t = [("tenant", *tenant)];
        assert_eq!(
            delta("pd_router_tenant_prompt_tokens_total", &t),
            s[0],
            "{tenant}"
        );
        assert_eq!(by("computed"), s[0] - s[1], "{tenant}");
        assert_eq!(by("local_hit") + by("external_hit"), s[1], "{tenant}");
        assert_eq!(
            delta("pd_router_tenant_generation_tokens_total", &t),
            s[4],
            "{tenant}"
        );
        assert!(s[1] > 0.0, "{tenant}: the repeated prompts hit the cache");
    }
    let requests = |tenant| delta("pd_router_tenant_requests_total", &[("tenant", tenant)]);
    assert_eq!(requests("a") + requests("b"), 5.0 + http_requests);
    assert_eq!(requests("a"), 3.0 + 2.0);
    all_blocks_free(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_cache_is_shared_between_tenants() {
    let cache = tempfile::tempdir().unwrap();
    let path = keys(cache.path());
    let env = [("PD_SHARED_PREFIX_CACHE", "true")];
    let cluster = Cluster::up_with_keys(cache.path(), &[], &path, &env).unwrap();
    let mut c = client(&cluster.router()).await;
    let ids = prompt(9);
    assert_eq!(cached(&mut c, &ids, KEY_A).await, 0);
    assert!(cached(&mut c, &ids, KEY_B).await > 0, "B reuses A's prefix");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sha256_cluster_serves_the_same_tokens_and_still_hits_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let env = [("PD_PREFIX_CACHING_HASH_ALGO", "sha256")];
    let cluster = Cluster::up_with_env(cache.path(), &[], &env).unwrap();
    for role in ["prefill", "decode"] {
        let info = node_info(&cluster.nodes(role)[0], role).await;
        assert_eq!(info.prefix_caching_hash_algo, "sha256", "{role}");
    }
    let mut c = client(&cluster.router()).await;
    let ids = prompt(11);
    // The reference engine hashes with xxhash: hashing does not change what is computed.
    let want = reference_tokens(cache.path(), &ids, 8);
    for round in 0..2 {
        let (got, last) = collect_as(&mut c, greedy(ids.clone(), 8), None)
            .await
            .unwrap();
        assert_eq!(got, want, "round {round}");
        let usage = last.usage.unwrap();
        let whole_blocks = ((ids.len() - 1) / 16 * 16) as u32;
        let expected = if round == 0 { 0 } else { whole_blocks };
        assert_eq!(usage.cached_tokens, expected, "round {round}");
    }
    all_blocks_free(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdctl_clients_send_the_api_key() {
    let cache = tempfile::tempdir().unwrap();
    let path = keys(cache.path());
    let cluster = Cluster::up_with_keys(cache.path(), &["--http-port", "0"], &path, &[]).unwrap();
    let router = cluster.router();
    let generate = [
        "generate",
        "--router",
        &router,
        "--prompt",
        "Hello",
        "--max-tokens",
        "3",
    ];
    let out = pdctl(cache.path(), &generate);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Bearer"), "{stderr}");
    let out = pdctl(
        cache.path(),
        &[&generate[..], &["--api-key", KEY_A]].concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(bin_dir().join("pdctl"))
        .args(generate)
        .env("PD_API_KEY", KEY_B)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // pdctl bench over both APIs: every request is tenant a's and succeeds.
    let metrics = cluster.router_metrics();
    let openai = cluster.openai();
    for backend in [
        &["--backend", "grpc"][..],
        &["--backend", "openai", "--openai-url", &openai],
    ] {
        let before = exposition(&metrics).await.unwrap();
        let out = Command::new(bin_dir().join("pdctl"))
            .args([
                "bench",
                "--no-progress",
                "--router",
                &router,
                "--api-key",
                KEY_A,
            ])
            .args([
                "--workload",
                "random",
                "--input-len",
                "8",
                "--output-len",
                "3",
            ])
            .args(["--num-prompts", "3"])
            .args(backend)
            .env("PD_CACHE_DIR", cache.path())
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let after = exposition(&metrics).await.unwrap();
        let ok = [("tenant", "a"), ("outcome", "length")];
        let name = "pd_router_tenant_requests_total";
        assert!(
            after.sum(name, &ok) - before.sum(name, &ok) >= 3.0,
            "{backend:?}"
        );
        let failed = |e: &pd_tests::Exposition| e.sum(name, &[("tenant", "a")]) - e.sum(name, &ok);
        assert_eq!(failed(&after), failed(&before), "{backend:?}");
    }
    // pdctl metrics takes the key too (the metrics port needs none).
    let out = pdctl(
        cache.path(),
        &[
            "metrics",
            "--router-metrics",
            &metrics,
            "--once",
            "--api-key",
            KEY_A,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
