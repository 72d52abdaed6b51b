//! Tenant limits (`--tenant-limits`, `--cached-token-cost`) over real sockets: computed
//! prompt tokens cost more than cached ones, requests per second refused over gRPC
//! (RESOURCE_EXHAUSTED) and HTTP (429 with Retry-After), the refusals counted by tenant and
//! reason, per-key limits, a client that goes away charged its prompt, and the file re-read
//! when it changes.
//!
//! Every limit here refills at 0.001 per second: nothing refills within a test.

use std::path::{Path, PathBuf};

use pd_proto::pb;
use pd_test_support::metrics::value;
use tonic::Code;

use crate::fake::*;

const KEY_COMPUTED: &str = "key-of-tenant-computed-01";
const KEY_CACHED: &str = "key-of-tenant-cached-0001";

/// A file with `text` in a fresh temporary directory.
fn file(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Replaces the file as a ConfigMap volume or an editor does: a new file renamed over it.
fn rewrite(path: &Path, text: &str) {
    let next = path.with_extension("new");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// A request of 100 prompt tokens and up to 2 generated ones, with `key` if given.
fn request(key: Option<&str>) -> tonic::Request<pb::GenerateRequest> {
    let message = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
            ids: (1000..1100).collect(),
        })),
        max_tokens: Some(2),
        ..Default::default()
    };
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let value = format!("Bearer {key}").parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// Runs a request to its end: its usage, or the status it was refused with.
async fn run(router: &RouterUnderTest, key: Option<&str>) -> Result<pb::Usage, tonic::Status> {
    let mut stream = router.client().generate(request(key)).await?.into_inner();
    let mut usage = None;
    while let Some(chunk) = stream.message().await? {
        usage = chunk.usage.or(usage);
    }
    Ok(usage.expect("the last chunk carries usage"))
}

/// The `Retry-After` of an HTTP response's head, in seconds.
fn retry_after(response: &str) -> Option<u64> {
    let head = response.split("\r\n\r\n").next()?;
    head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("retry-after")
            .then(|| value.trim().parse().ok())?
    })
}

#[tokio::test]
async fn computed_prompt_tokens_exhaust_a_tenant_that_cached_ones_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let keys = file(
        &dir,
        "keys",
        &format!("computed {KEY_COMPUTED}\ncached {KEY_CACHED}\n"),
    );
    // 250 prompt tokens of room each; a cached token costs a tenth of a computed one.
    let limits = file(
        &dir,
        "limits",
        "# every tenant alike\n\
         default prompt_tokens_per_second=0.001 prompt_tokens_per_second_burst=250\n",
    );
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // The prefill node finds 96 of each 100-token prompt of tenant `cached` in its cache,
    // none of tenant `computed`'s.
    *p.state.cached_by_tenant.lock().unwrap() =
        vec![("cached".into(), (64, 32)), ("computed".into(), (0, 0))];
    let mut cfg = config(&[&p], &[&d]);
    cfg.api_keys = Some(keys);
    cfg.tenant_limits = Some(limits);
    let router = RouterUnderTest::start(cfg).await;

    // `computed`: 100 tokens a request. Three pass (the third while the bucket still has 50),
    // leaving it 50 in debt: the fourth is refused.
    for _ in 0..3 {
        let usage = run(&router, Some(KEY_COMPUTED)).await.unwrap();
        assert_eq!((usage.prompt_tokens, usage.cached_tokens), (100, 0));
    }
    let refused = run(&router, Some(KEY_COMPUTED)).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let message = refused.message();
    assert!(message.contains("tenant `computed`"), "{message}");
    assert!(message.contains("prompt tokens"), "{message}");
    assert!(message.contains("--tenant-limits"), "{message}");

    // `cached`: the same 100-token prompts, 96 of them cached: 4 + 9.6 each. The same
    // volume, and more, passes.
    for _ in 0..8 {
        let usage = run(&router, Some(KEY_CACHED)).await.unwrap();
        assert_eq!((usage.prompt_tokens, usage.cached_tokens), (100, 96));
    }

    let text = router.metrics_text().await;
    let rejected = "pd_router_tenant_requests_rejected_total";
    let of = |tenant: &str, reason: &str| {
        let (t, r) = (
            format!("tenant=\"{tenant}\""),
            format!("reason=\"{reason}\""),
        );
        value(&text, rejected, &[&t, &r])
    };
    assert_eq!(of("computed", "prompt_tokens"), Some(1.0), "{text}");
    assert_eq!(of("cached", "prompt_tokens"), Some(0.0), "{text}");
    assert_eq!(of("computed", "requests"), Some(0.0));
    // A refusal is a resource_exhausted request of the tenant, and of the router.
    assert_eq!(
        value(
            &text,
            "pd_router_tenant_requests_total",
            &["tenant=\"computed\"", "outcome=\"resource_exhausted\""],
        ),
        Some(1.0)
    );
    // The refused request never reached a node.
    assert_eq!(p.state.prefill_count(), 11);
}

#[tokio::test]
async fn over_requests_per_second_grpc_is_resource_exhausted_and_http_is_429() {
    let dir = tempfile::tempdir().unwrap();
    let limits = file(
        &dir,
        "limits",
        "default requests_per_second=0.001 requests_per_second_burst=2\n",
    );
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.tenant_limits = Some(limits);
    let router = RouterUnderTest::start(cfg).await;

    // Two requests of room: one over gRPC, one over HTTP (one bucket for both APIs).
    run(&router, None).await.unwrap();
    let response = http_completion(router.http, 2).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    let refused = run(&router, None).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("requests per second"),
        "{}",
        refused.message()
    );
    // About 1000 s until the bucket has room for a request.
    let hint: u64 = (refused.metadata().get("retry-after").unwrap())
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((900..=1000).contains(&hint), "{hint}");
    assert!(refused.metadata().get("grpc-retry-pushback-ms").is_some());

    let response = http_completion(router.http, 2).await;
    assert!(
        response.starts_with("HTTP/1.1 429"),
        "refused with 429: {response}"
    );
    let hint = retry_after(&response).expect("a Retry-After header");
    assert!((900..=1000).contains(&hint), "{hint}");
    assert!(response.contains("requests per second"), "{response}");

    let text = router.metrics_text().await;
    assert_eq!(
        value(
            &text,
            "pd_router_tenant_requests_rejected_total",
            &["tenant=\"default\"", "reason=\"requests\""],
        ),
        Some(2.0),
        "{text}"
    );
    // Admission control's own refusals are another family, untouched.
    assert_eq!(
        value(
            &text,
            "pd_router_requests_rejected_total",
            &["reason=\"queue_full\""]
        ),
        Some(0.0)
    );
    assert_eq!(p.state.prefill_count(), 2);
}

#[tokio::test]
async fn a_key_line_limits_that_key_only() {
    let dir = tempfile::tempdir().unwrap();
    let keys = file(
        &dir,
        "keys",
        &format!("acme {KEY_COMPUTED}\nacme {KEY_CACHED}\n"),
    );
    let digest = pd_router::auth::KeyId::of(KEY_COMPUTED);
    let limits = file(
        &dir,
        "limits",
        &format!(
            "key:{} requests_per_second=0.001 requests_per_second_burst=1\n",
            &digest.hex()[..16]
        ),
    );
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.api_keys = Some(keys);
    cfg.tenant_limits = Some(limits);
    let router = RouterUnderTest::start(cfg).await;

    run(&router, Some(KEY_COMPUTED)).await.unwrap();
    let refused = run(&router, Some(KEY_COMPUTED)).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("this API key"),
        "{}",
        refused.message()
    );
    assert!(!refused.message().contains(KEY_COMPUTED), "never the key");
    // Over HTTP too: the key's bucket is the same.
    let bearer = format!("Bearer {KEY_COMPUTED}");
    let body = r#"{"prompt":"hi","max_tokens":2}"#;
    let headers = [("Authorization", bearer.as_str())];
    let (status, text) = http_request(router.http, "POST", "/v1/completions", &headers, body).await;
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("this API key"), "{text}");
    // The tenant's other key is not limited.
    for _ in 0..3 {
        run(&router, Some(KEY_CACHED)).await.unwrap();
    }
}

#[tokio::test]
async fn a_changed_limits_file_is_picked_up_and_a_bad_one_keeps_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let limits = file(
        &dir,
        "limits",
        "default requests_per_second=0.001 requests_per_second_burst=1\n",
    );
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.tenant_limits = Some(limits.clone());
    let router = RouterUnderTest::start(cfg).await;
    run(&router, None).await.unwrap();
    assert_eq!(
        run(&router, None).await.unwrap_err().code(),
        Code::ResourceExhausted
    );

    // A bad version: refused and counted; the limits in use stay.
    rewrite(&limits, "default requests_per_second=lots\n");
    let refused_reloads = || async {
        let text = router.metrics_text().await;
        value(
            &text,
            "pd_router_file_reloads_total",
            &["file=\"tenant_limits\"", "result=\"refused\""],
        )
    };
    for _ in 0..200 {
        if refused_reloads().await == Some(1.0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(refused_reloads().await, Some(1.0));
    assert_eq!(
        run(&router, None).await.unwrap_err().code(),
        Code::ResourceExhausted
    );

    // A good version that limits generated tokens only: requests pass again.
    rewrite(&limits, "default generation_tokens_per_second=1000\n");
    let mut passed = false;
    for _ in 0..200 {
        if run(&router, None).await.is_ok() {
            passed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(passed, "the new limits were never used");
    let text = router.metrics_text().await;
    assert_eq!(
        value(
            &text,
            "pd_router_file_reloads_total",
            &["file=\"tenant_limits\"", "result=\"loaded\""],
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn a_client_that_goes_away_pays_for_its_prompt_as_computed() {
    let dir = tempfile::tempdir().unwrap();
    let limits = file(
        &dir,
        "limits",
        "default prompt_tokens_per_second=0.001 prompt_tokens_per_second_burst=50\n",
    );
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101]; 50],
        delay: std::time::Duration::from_millis(50),
        end: End::Finish(pb::FinishReason::Length),
    };
    let mut cfg = config(&[&p], &[&d]);
    cfg.tenant_limits = Some(limits);
    let router = RouterUnderTest::start(cfg).await;

    // A 100-token prompt (48 of it cached, which the client is never told): the client reads
    // its first token and goes away.
    let mut stream = router
        .client()
        .generate(request(None))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.prompt_tokens, Some(100));
    drop(stream);
    eventually("the decode stream is dropped", || {
        d.state
            .streams_cancelled
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1
    })
    .await;
    // Charged 100 of its 50: in debt.
    let refused = run(&router, None).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("prompt tokens"),
        "{}",
        refused.message()
    );
}
