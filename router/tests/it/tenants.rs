//! API keys and tenants over real sockets: keys required on every gRPC call and HTTP route
//! but health, the keys file re-read when it changes, request ids scoped per tenant, cache
//! salts derived from the tenant, and nodes hashing blocks otherwise than the router refused.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pd_proto::pb;
use pd_router::RouterConfig;
use pd_router::registry::NodeHealth;
use pd_router::tenant::{Tenancy, Tenant};
use tonic::Code;

use crate::fake::*;

const KEY_A: &str = "key-of-tenant-a-0001";
const KEY_A2: &str = "key-of-tenant-a-0002";
const KEY_B: &str = "key-of-tenant-b-0001";

/// A keys file in a fresh temporary directory.
fn keys_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api-keys");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// Replaces the file as a Secret volume or an editor does: a new file renamed over it.
fn rewrite(path: &Path, text: &str) {
    let next = path.with_extension("new");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

fn two_tenants() -> String {
    format!("# tenant a has two keys\na {KEY_A}\na {KEY_A2}\n\nb {KEY_B}\n")
}

fn keyed(mut config: RouterConfig, path: &Path) -> RouterConfig {
    config.api_keys = Some(path.to_path_buf());
    config
}

/// `message` with `authorization: Bearer KEY` metadata (none without a key).
fn with_key<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let value = format!("Bearer {key}").parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

async fn generate_as(
    router: &RouterUnderTest,
    key: Option<&str>,
    request: pb::GenerateRequest,
) -> Result<(Vec<pb::GenerateResponse>, Option<tonic::Status>), tonic::Status> {
    let mut client = router.client();
    let mut stream = client.generate(with_key(request, key)).await?.into_inner();
    let mut chunks = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => chunks.push(chunk),
            Ok(None) => return Ok((chunks, None)),
            Err(status) => return Ok((chunks, Some(status))),
        }
    }
}

async fn abort_as(router: &RouterUnderTest, key: &str, id: &str) -> bool {
    let request = pb::AbortRequest {
        request_id: id.into(),
    };
    let response = router.client().abort(with_key(request, Some(key))).await;
    response.unwrap().into_inner().aborted
}

fn completion(prompt: &str) -> String {
    serde_json::json!({"model": "synthetic:tiny", "prompt": prompt, "max_tokens": 4}).to_string()
}

#[tokio::test]
async fn every_grpc_call_needs_a_key_of_the_file() {
    let (_dir, path) = keys_file(&two_tenants());
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(keyed(config(&[&p], &[&d]), &path)).await;

    for (key, wanted) in [(None, "Bearer KEY"), (Some("wrong-key-123"), "not valid")] {
        let status = generate_as(&router, key, text_request("hello"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(status.message().contains(wanted), "{}", status.message());
        assert!(
            !status.message().contains("wrong-key"),
            "never echo the key"
        );
        let mut client = router.client();
        let tokenize = pb::TokenizeRequest {
            text: "hi".into(),
            ..Default::default()
        };
        let abort = pb::AbortRequest {
            request_id: "x".into(),
        };
        let codes = [
            client.tokenize(with_key(tokenize, key)).await.unwrap_err(),
            client.abort(with_key(abort, key)).await.unwrap_err(),
            (client.list_models(with_key(pb::ListModelsRequest {}, key)))
                .await
                .unwrap_err(),
        ]
        .map(|s| s.code());
        assert_eq!(codes, [Code::Unauthenticated; 3]);
    }
    // Not a bearer value.
    let mut request = with_key(text_request("hello"), None);
    let value = KEY_A.parse().unwrap();
    request.metadata_mut().insert("authorization", value);
    let status = router.client().generate(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(status.message().contains("Bearer"), "{}", status.message());
    // Nothing refused reached a node.
    assert!(p.state.prefills.lock().unwrap().is_empty());

    for key in [KEY_A, KEY_A2, KEY_B] {
        let (chunks, error) = generate_as(&router, Some(key), text_request("hello"))
            .await
            .unwrap();
        assert!(error.is_none(), "{error:?}");
        assert_ne!(chunks.last().unwrap().finish_reason, 0);
    }
    let models = router
        .client()
        .list_models(with_key(pb::ListModelsRequest {}, Some(KEY_B)))
        .await
        .unwrap();
    assert_eq!(models.into_inner().models.len(), 1);
}

#[tokio::test]
async fn http_routes_need_a_key_but_health_stays_open_and_metrics_moved() {
    let (_dir, path) = keys_file(&two_tenants());
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(keyed(config(&[&p], &[&d]), &path)).await;
    let body = completion("hello");

    for headers in [
        vec![],
        vec![("Authorization", "Bearer wrong-key-123")],
        vec![("Authorization", KEY_A)],
    ] {
        let (status, text) =
            http_request(router.http, "POST", "/v1/completions", &headers, &body).await;
        assert_eq!(status, 401, "{text}");
        let error: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "invalid_api_key", "{text}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{text}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("Bearer") || message.contains("not valid"),
            "{message}"
        );
        assert!(!text.contains("wrong-key") && !text.contains(KEY_A));
    }
    for (method, route) in [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ] {
        let (status, text) = http_request(router.http, method, route, &[], "{}").await;
        assert_eq!(status, 401, "{route}: {text}");
    }
    let auth = format!("Bearer {KEY_B}");
    let (status, text) = http_request(
        router.http,
        "POST",
        "/v1/completions",
        &[("Authorization", &auth)],
        &body,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = http_request(
        router.http,
        "GET",
        "/v1/models",
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(status, 200);

    let (status, _) = http_request(router.http, "GET", "/health", &[], "").await;
    assert_eq!(status, 200, "/health needs no key");
    // /metrics only on the metrics port (no key there: it is monitoring's).
    let (status, _) = http_request(
        router.http,
        "GET",
        "/metrics",
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(status, 404);
    let (status, text) = http_request(router.metrics, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200);
    assert!(text.contains("pd_router_requests_total"));
}

#[tokio::test]
async fn without_keys_everything_stays_open() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let (_, error) = generate_as(&router, None, text_request("hello"))
        .await
        .unwrap();
    assert!(error.is_none());
    // A key sent anyway is ignored.
    let (_, error) = generate_as(&router, Some("anything"), text_request("hello"))
        .await
        .unwrap();
    assert!(error.is_none());
    let (status, _) = http_request(
        router.http,
        "POST",
        "/v1/completions",
        &[],
        &completion("hi"),
    )
    .await;
    assert_eq!(status, 200);
    // The client's salt reaches the nodes as it is.
    let mut req = text_request("hello");
    req.cache_salt = Some("mine".into());
    generate_as(&router, None, req).await.unwrap();
    let salts: Vec<_> = (p.state.prefills.lock().unwrap().iter())
        .map(|r| r.cache_salt.clone())
        .collect();
    assert_eq!(salts, [None, None, None, Some("mine".into())]);
}

/// Polls until a request with `key` gets `want` (true: served; false: UNAUTHENTICATED).
async fn until_key(router: &RouterUnderTest, key: &str, want: bool) {
    for _ in 0..100 {
        let request = pb::ListModelsRequest {};
        let served = router
            .client()
            .list_models(with_key(request, Some(key)))
            .await
            .is_ok();
        if served == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "key {key} never became {}",
        if want { "valid" } else { "invalid" }
    );
}

#[tokio::test]
async fn a_rotated_keys_file_takes_effect_without_a_restart() {
    let (_dir, path) = keys_file(&format!("a {KEY_A}\n"));
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(keyed(config(&[&p], &[&d]), &path)).await;
    until_key(&router, KEY_A, true).await;
    until_key(&router, KEY_B, false).await;

    rewrite(&path, &format!("b {KEY_B}\n"));
    until_key(&router, KEY_B, true).await;
    until_key(&router, KEY_A, false).await;

    // A broken new version keeps the keys in use: after it, the next good version is the
    // one that takes effect (so the broken one was read, and left the keys alone).
    rewrite(&path, "b\n");
    tokio::time::sleep(pd_router::auth::RELOAD_INTERVAL * 3).await;
    until_key(&router, KEY_B, true).await;
    rewrite(&path, &format!("a {KEY_A}\n"));
    until_key(&router, KEY_A, true).await;
    until_key(&router, KEY_B, false).await;
}

#[tokio::test]
async fn a_bad_keys_file_stops_the_router_at_start_naming_the_line() {
    let (_dir, path) = keys_file(&format!("a {KEY_A}\nb\n"));
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let config = keyed(config(&[&p], &[&d]), &path);
    let error = tokio::task::spawn_blocking(move || pd_router::Router::new(config))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&format!("{} line 2", path.display())),
        "{error}"
    );
}

#[tokio::test]
async fn another_tenants_abort_does_not_reach_a_request_of_the_same_id() {
    let (_dir, path) = keys_file(&two_tenants());
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102], vec![103], vec![104]],
        end: End::Finish(pb::FinishReason::Length),
        delay: Duration::from_millis(150),
    };
    let router = RouterUnderTest::start(keyed(config(&[&p], &[&d]), &path)).await;
    let mut req = text_request("a long story");
    req.request_id = Some("job-1".into());
    let mut client = router.client();
    let mut a = client
        .generate(with_key(req.clone(), Some(KEY_A)))
        .await
        .unwrap()
        .into_inner();
    assert!(a.message().await.unwrap().is_some());

    // B may use the same id while A's request runs, and its Abort finds only its own.
    assert!(!abort_as(&router, KEY_B, "job-1").await);
    let b = tokio::spawn({
        let mut client = router.client();
        async move {
            let mut b = client
                .generate(with_key(req, Some(KEY_B)))
                .await
                .unwrap()
                .into_inner();
            let mut last = None;
            while let Some(chunk) = b.message().await.unwrap() {
                last = Some(chunk);
            }
            last.unwrap()
        }
    });
    let mut last = None;
    while let Some(chunk) = a.message().await.unwrap() {
        last = Some(chunk);
    }
    let last = last.unwrap();
    assert_eq!(
        last.finish_reason(),
        pb::FinishReason::Length,
        "A was not aborted"
    );
    assert_eq!(b.await.unwrap().finish_reason(), pb::FinishReason::Length);
    // A's own key (either of them) aborts A's requests.
    let mut req = text_request("another story");
    req.request_id = Some("job-2".into());
    let mut a = client
        .generate(with_key(req, Some(KEY_A)))
        .await
        .unwrap()
        .into_inner();
    assert!(a.message().await.unwrap().is_some());
    assert!(!abort_as(&router, KEY_B, "job-2").await);
    assert!(abort_as(&router, KEY_A2, "job-2").await);
    let mut last = None;
    while let Some(chunk) = a.message().await.unwrap() {
        last = Some(chunk);
    }
    assert_eq!(last.unwrap().finish_reason(), pb::FinishReason::Abort);

    // The nodes saw distinct ids, each naming its tenant.
    let ids: Vec<String> = (d.state.decodes.lock().unwrap().iter())
        .map(|r| r.request_id.clone())
        .collect();
    assert_eq!(ids.len(), 3);
    assert!(
        ids[0].starts_with("job-1@a/") || ids[0].starts_with("job-1@b/"),
        "{ids:?}"
    );
    assert_ne!(ids[0], ids[1]);
    assert!(ids.iter().any(|i| i.starts_with("job-1@b/")), "{ids:?}");
}

#[tokio::test]
async fn generated_request_ids_are_random() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (chunks, _) = generate_as(&router, None, text_request("hi"))
            .await
            .unwrap();
        ids.push(chunks[0].request_id.clone());
    }
    for id in &ids {
        let hex = id.strip_prefix("req-").unwrap();
        assert_eq!(hex.len(), 32, "{id}: 128 random bits");
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }
    // Not a counter: consecutive ids share no long common prefix.
    let common = ids[0]
        .bytes()
        .zip(ids[1].bytes())
        .take_while(|(x, y)| x == y)
        .count();
    assert!(common < "req-".len() + 8, "{ids:?}");
}

#[tokio::test]
async fn cache_salts_are_derived_from_the_tenant_unless_shared() {
    let (_dir, path) = keys_file(&two_tenants());
    for shared in [false, true] {
        let p = FakeNode::prefill().await;
        let d = FakeNode::decode().await;
        let mut config = keyed(config(&[&p], &[&d]), &path);
        config.shared_prefix_cache = shared;
        let router = RouterUnderTest::start(config).await;
        for (key, salt) in [
            (KEY_A, None),
            (KEY_A2, None),
            (KEY_B, None),
            (KEY_A, Some("s")),
        ] {
            let mut req = text_request("the same prompt");
            req.cache_salt = salt.map(Into::into);
            generate_as(&router, Some(key), req).await.unwrap();
            // Over HTTP too (vLLM's `cache_salt` field).
            let mut body = serde_json::json!({"prompt": "the same prompt", "max_tokens": 2});
            if let Some(salt) = salt {
                body["cache_salt"] = salt.into();
            }
            let auth = format!("Bearer {key}");
            let (status, text) = http_request(
                router.http,
                "POST",
                "/v1/completions",
                &[("Authorization", &auth)],
                &body.to_string(),
            )
            .await;
            assert_eq!(status, 200, "{text}");
        }
        let salts: Vec<Option<String>> = (p.state.prefills.lock().unwrap().iter())
            .map(|r| r.cache_salt.clone())
            .collect();
        let tenancy = Tenancy {
            keys: true,
            shared_prefix_cache: shared,
        };
        let salt = |t: &str, s: Option<&str>| {
            tenancy.cache_salt(&Tenant::new(t).unwrap(), s.map(Into::into))
        };
        let want: Vec<Option<String>> = [
            salt("a", None),
            salt("a", None),
            salt("b", None),
            salt("a", Some("s")),
        ]
        .into_iter()
        .flat_map(|s| [s.clone(), s])
        .collect();
        assert_eq!(salts, want);
        if shared {
            assert_eq!(want[0], None);
            assert_eq!(want[6].as_deref(), Some("s"));
        } else {
            // One tenant's keys share a salt; tenants and client salts do not.
            assert_eq!(want[0], want[2]);
            assert_ne!(want[0], want[4]);
            assert_ne!(want[0], want[6]);
            assert_eq!(want[0].as_ref().unwrap().len(), 64);
        }
    }
}

#[tokio::test]
async fn a_node_hashing_blocks_otherwise_is_refused() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.hash_algo.lock().unwrap() = "sha256".into();
    let router = RouterUnderTest::start_unchecked(config(&[&p], &[&d])).await;
    let decode_down = || {
        router
            .registry
            .nodes()
            .into_iter()
            .find(|n| n.addr == d.address())
            .map(|n| n.health())
    };
    eventually("the decode node is refused", || {
        matches!(decode_down(), Some(NodeHealth::Down(reason))
            if reason.contains("sha256") && reason.contains("--prefix-caching-hash-algo"))
    })
    .await;
    let status = generate_as(&router, None, text_request("hi")).await;
    let failed = match status {
        Err(status) => status.code(),
        Ok((_, Some(status))) => status.code(),
        Ok((_, None)) => Code::Ok,
    };
    assert_eq!(failed, Code::Unavailable);
    // Told the same algorithm, it is used.
    *d.state.hash_algo.lock().unwrap() = "xxhash".into();
    router
        .wait_health(tonic_health::pb::health_check_response::ServingStatus::Serving)
        .await;

    // A sha256 router takes sha256 nodes only (an empty report is an xxhash node).
    let p2 = FakeNode::prefill().await;
    let d2 = FakeNode::decode().await;
    *p2.state.hash_algo.lock().unwrap() = "sha256".into();
    *d2.state.hash_algo.lock().unwrap() = "sha256".into();
    let mut sha = config(&[&p2], &[&d2]);
    sha.prefix_caching_hash_algo = "sha256".parse().unwrap();
    let router = RouterUnderTest::start(sha).await;
    let (_, error) = generate_as(&router, None, text_request("hi"))
        .await
        .unwrap();
    assert!(error.is_none());
}

/// The sum of the samples of `name` whose labels include all of `labels`.
fn sample_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| (labels.iter()).all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test]
async fn per_tenant_metrics_equal_the_sums_of_their_usage() {
    let (_dir, path) = keys_file(&format!("{}c key-of-tenant-c-0001\n", two_tenants()));
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(keyed(config(&[&p], &[&d]), &path)).await;
    let before = router.metrics_text().await;
    // Every tenant of the file is there from the start, at 0.
    for t in ["a", "b", "c"] {
        let at_zero = before.lines().any(|l| {
            l.starts_with("pd_router_tenant_prompt_tokens_total{")
                && l.contains(&format!("tenant=\"{t}\""))
                && l.ends_with(" 0")
        });
        assert!(at_zero, "{t}: {before}");
    }
    // [prompt, computed, local, external, completion] per tenant, from the usage received.
    let mut sums = std::collections::HashMap::<&str, [u64; 5]>::new();
    let mut requests = std::collections::HashMap::<&str, u64>::new();
    // Longer than the fake prefill node's reported hits (16 local + 32 external tokens).
    let prompts = [
        "one two three four five six seven eight nine ten ".repeat(8),
        "a somewhat longer prompt than the first one was, ".repeat(9),
        "x y z ".repeat(30),
    ];
    for (i, (tenant, key)) in [("a", KEY_A), ("b", KEY_B), ("a", KEY_A2), ("b", KEY_B)]
        .into_iter()
        .enumerate()
    {
        let mut req = text_request(&prompts[i % prompts.len()]);
        // Choices count each as a request with its own usage.
        req.n = Some(if i == 1 { 2 } else { 1 });
        let (chunks, error) = generate_as(&router, Some(key), req).await.unwrap();
        assert!(error.is_none(), "{error:?}");
        for usage in chunks.iter().filter_map(|c| c.usage) {
            let s = sums.entry(tenant).or_default();
            let computed = usage.prompt_tokens - usage.cached_tokens;
            for (j, n) in [
                usage.prompt_tokens,
                computed,
                usage.local_cached_tokens,
                usage.external_cached_tokens,
                usage.completion_tokens,
            ]
            .into_iter()
            .enumerate()
            {
                s[j] += u64::from(n);
            }
            *requests.entry(tenant).or_default() += 1;
        }
    }
    // A refused request counts for its tenant, without tokens.
    let mut bad = text_request("x");
    bad.max_tokens = Some(0);
    assert!(generate_as(&router, Some(KEY_B), bad).await.is_err());
    let text = router.metrics_text().await;
    for (tenant, s) in &sums {
        let t = [("tenant", *tenant)];
        let by = |source: &str| {
            sample_sum(
                &text,
                "pd_router_tenant_prompt_tokens_total",
                &[("tenant", tenant), ("source", source)],
            )
        };
        assert!(
            s[0] > 0 && s[2] > 0 && s[3] > 0,
            "the fake reports hits: {s:?}"
        );
        assert_eq!(by("computed"), s[1] as f64, "{tenant}");
        assert_eq!(by("local_hit"), s[2] as f64, "{tenant}");
        assert_eq!(by("external_hit"), s[3] as f64, "{tenant}");
        assert_eq!(
            sample_sum(&text, "pd_router_tenant_prompt_tokens_total", &t),
            s[0] as f64
        );
        assert_eq!(
            sample_sum(&text, "pd_router_tenant_generation_tokens_total", &t),
            s[4] as f64
        );
        assert_eq!(
            sample_sum(
                &text,
                "pd_router_tenant_requests_total",
                &[("tenant", tenant), ("outcome", "length")]
            ),
            requests[tenant] as f64
        );
    }
    assert_eq!(requests["b"], 3, "two choices and one request");
    let refused = [("tenant", "b"), ("outcome", "invalid_argument")];
    assert_eq!(
        sample_sum(&text, "pd_router_tenant_requests_total", &refused),
        1.0
    );
    assert_eq!(
        sample_sum(&text, "pd_router_tenant_requests_total", &[("tenant", "c")]),
        0.0
    );
}
