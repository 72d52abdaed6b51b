//! `pdctl up --secure`: a cluster with TLS on every port, mTLS between its parts and an API
//! key for clients serves the same tokens as one engine and counts prompt tokens exactly.

use std::path::PathBuf;
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use pd_tests::tls::channel;
use pd_tests::{Cluster, Exposition, collect_as, greedy, reference_tokens, spread_prompts};
use pd_tls::{Alpn, ClientTls, Identity, TlsSettings};

/// TLS trusting the cluster CA of `cluster`'s ready line; with the member certificate as a
/// client identity when `member` (what the router and other nodes present).
fn tls(cluster: &Cluster, alpn: Alpn, member: bool) -> ClientTls {
    let dir = PathBuf::from(cluster.ready["secure_dir"].as_str().expect("secure_dir"));
    let settings = TlsSettings {
        ca: Some(PathBuf::from(cluster.ready["ca"].as_str().expect("ca"))),
        identity: member.then(|| Identity {
            cert: dir.join("node.crt"),
            key: dir.join("node.key"),
        }),
        ..TlsSettings::default()
    };
    ClientTls::new(&settings, alpn).unwrap().unwrap()
}

/// `GET url` (`https://HOST:PORT/PATH`) trusting the cluster CA: (status, body).
async fn https_get(url: &str, tls: &ClientTls) -> (u16, String) {
    let rest = url.strip_prefix("https://").expect("an https URL");
    let (authority, path) = rest.split_once('/').unwrap();
    pd_tests::tls::https_get(authority, tls, &format!("/{path}"))
        .await
        .expect("an HTTPS answer")
}

/// The prefill node's cumulative counters, over mTLS with the member certificate.
async fn prefill_counters(cluster: &Cluster) -> pb::CounterReport {
    let addr = &cluster.nodes("prefill")[0];
    let ch = channel(addr, Some(&tls(cluster, Alpn::Grpc, true)))
        .await
        .unwrap();
    pb::prefill_service_client::PrefillServiceClient::new(ch)
        .info(pb::InfoRequest {})
        .await
        .expect("a cluster member reads Info")
        .into_inner()
        .counters
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdctl_up_secure_serves_one_engine_s_tokens_to_its_key_and_counts_exactly() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(
        cache.path(),
        &["--secure", "--prefill", "1", "--decode", "1"],
    )
    .unwrap();
    let ready = &cluster.ready;
    assert_eq!(ready["tenant"], "local");
    let key = ready["api_key"].as_str().expect("api_key").to_string();
    assert!(key.len() >= 32, "{key}");
    for url in ["openai", "router_metrics"] {
        assert!(
            ready[url].as_str().unwrap().starts_with("https://"),
            "{url}"
        );
    }

    let grpc = tls(&cluster, Alpn::Grpc, false);
    let mut c = GenerationClient::new(channel(&cluster.router(), Some(&grpc)).await.unwrap());
    // Without the key: UNAUTHENTICATED, and nothing ran.
    let refused = collect_as(&mut c, greedy(vec![1, 2, 3], 4), None).await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::Unauthenticated);
    // A client without a cluster certificate cannot reach a node at all.
    let node = channel(&cluster.nodes("prefill")[0], Some(&grpc))
        .await
        .unwrap();
    let info = pb::prefill_service_client::PrefillServiceClient::new(node.clone())
        .info(pb::InfoRequest {})
        .await;
    assert_eq!(info.unwrap_err().code(), tonic::Code::Unauthenticated);
    // Nor read what a node's cache holds (its cache events), prefill or decode.
    let events = pb::prefill_service_client::PrefillServiceClient::new(node)
        .cache_events(pb::CacheEventsRequest {})
        .await;
    assert_eq!(events.unwrap_err().code(), tonic::Code::Unauthenticated);
    let decode = channel(&cluster.nodes("decode")[0], Some(&grpc))
        .await
        .unwrap();
    let events = pb::decode_service_client::DecodeServiceClient::new(decode)
        .cache_events(pb::CacheEventsRequest {})
        .await;
    assert_eq!(events.unwrap_err().code(), tonic::Code::Unauthenticated);

    // The keystone: with the key, every prompt gets one engine's greedy tokens.
    let before = prefill_counters(&cluster).await;
    let mut prompts = spread_prompts(4, 5, 29, 23);
    prompts.push(prompts[3].clone());
    let (mut prompt_tokens, mut cached, mut local, mut external) = (0u32, 0u32, 0u32, 0u32);
    for ids in &prompts {
        let (got, last) = collect_as(&mut c, greedy(ids.clone(), 8), Some(&key))
            .await
            .unwrap();
        assert_eq!(
            got,
            reference_tokens(cache.path(), ids, 8),
            "{} tokens",
            ids.len()
        );
        let usage = last.usage.unwrap();
        assert_eq!(usage.prompt_tokens as usize, ids.len());
        prompt_tokens += usage.prompt_tokens;
        cached += usage.cached_tokens;
        local += usage.local_cached_tokens;
        external += usage.external_cached_tokens;
    }
    // The repeated prompt hit the prefill node's cache: its whole blocks.
    let repeated = prompts.last().unwrap().len();
    assert_eq!(local, ((repeated - 1) / 16 * 16) as u32);
    assert_eq!(cached, local + external);

    // The prefill node counted what the clients were told, and the router's per-tenant
    // counters (scraped over TLS) say the same, once its health checks have seen the reports.
    let after = prefill_counters(&cluster).await;
    assert_eq!(
        after.prefix_cache_hits - before.prefix_cache_hits,
        u64::from(local)
    );
    let https = tls(&cluster, Alpn::Http1, false);
    let metrics = ready["router_metrics"].as_str().unwrap().to_string();
    let want = [
        ("computed", f64::from(prompt_tokens - cached)),
        ("local_hit", f64::from(local)),
        ("external_hit", f64::from(external)),
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, text) = https_get(&metrics, &https).await;
        assert_eq!(status, 200);
        let e = Exposition::parse(&text).unwrap();
        let got: Vec<_> = want
            .iter()
            .map(|(source, _)| {
                e.sum(
                    "pd_router_tenant_prompt_tokens_total",
                    &[("tenant", "local"), ("source", source)],
                )
            })
            .collect();
        if got.iter().zip(&want).all(|(g, (_, w))| g == w) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "tenant counters {got:?}, usage says {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The probes' endpoint on the metrics port answers over TLS without a certificate.
    let health = metrics.replace("/metrics", "/health");
    assert_eq!(https_get(&health, &https).await.0, 200);
    let node_health = format!(
        "https://{}/health",
        cluster.node_metrics("decode")[0].trim_start_matches("https://")
    );
    assert_eq!(
        https_get(&node_health, &https).await,
        (200, "SERVING\n".into())
    );
    assert!(cluster.stop(), "pdctl up --secure exits 0 on SIGTERM");
}
