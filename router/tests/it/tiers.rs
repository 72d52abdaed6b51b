//! Prefix-cache hits by tier: `pd_router_prefix_cache_hits_by_tier_total` equals, per node,
//! the sum over the node's epochs of what it reported (device = its local hits, host and peer
//! its external hits by source), and a client's usage carries the prefill node's split.

use std::time::Duration;

use pd_proto::pb;

use crate::fake::*;

const HITS_BY_TIER: &str = "pd_router_prefix_cache_hits_by_tier_total";
const HITS: &str = "pd_router_prefix_cache_hits_total";

/// A node's cumulative report: `local` device hits, `host` and `peer` external hits.
fn report(epoch: u64, local: u64, host: u64, peer: u64) -> pb::CounterReport {
    pb::CounterReport {
        epoch,
        prefix_cache_queries: 4096,
        prefix_cache_hits: local,
        external_prefix_cache_queries: 4096 - local,
        external_prefix_cache_hits: host + peer,
        external_prefix_cache_hits_host: host,
        external_prefix_cache_hits_peer: peer,
        prompt_tokens: 4096,
        ..Default::default()
    }
}

/// The value of the sample of `family` whose labels include `labels` (None if absent).
fn sample(text: &str, family: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn scrape(router: &RouterUnderTest) -> String {
    let (status, text) = http_request(router.metrics, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200);
    text
}

/// `node`'s hits by tier (device, host, peer), and its `cache="external"` hits.
fn tiers(text: &str, node: &FakeNode) -> ((f64, f64, f64), f64) {
    let addr = node.address();
    let tier = |t| sample(text, HITS_BY_TIER, &[("node", &addr), ("tier", t)]).unwrap_or(-1.0);
    let external = sample(text, HITS, &[("node", &addr), ("cache", "external")]).unwrap_or(-1.0);
    ((tier("device"), tier("host"), tier("peer")), external)
}

/// Scrapes until both nodes show `want` (the health poll brings the reports every 50 ms);
/// returns the last scrape either way.
async fn scrape_until(
    router: &RouterUnderTest,
    nodes: [(&FakeNode, (f64, f64, f64)); 2],
) -> String {
    let mut text = String::new();
    for _ in 0..200 {
        text = scrape(router).await;
        if nodes.iter().all(|(n, want)| tiers(&text, n).0 == *want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    text
}

#[tokio::test]
async fn hits_by_tier_are_the_sum_of_the_nodes_reports() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.counters.lock().unwrap() = Some(report(7, 320, 64, 0));
    *d.state.counters.lock().unwrap() = Some(report(9, 160, 0, 480));
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;

    let text = scrape_until(
        &router,
        [(&p, (320.0, 64.0, 0.0)), (&d, (160.0, 0.0, 480.0))],
    )
    .await;
    assert_eq!(tiers(&text, &p), ((320.0, 64.0, 0.0), 64.0));
    assert_eq!(tiers(&text, &d), ((160.0, 0.0, 480.0), 480.0));

    // The decode node counts on; the prefill node restarts (a new epoch, counting from 0):
    // the router adds the new epoch's totals to the old one's.
    *d.state.counters.lock().unwrap() = Some(report(9, 192, 0, 560));
    *p.state.counters.lock().unwrap() = Some(report(11, 16, 32, 0));
    let text = scrape_until(
        &router,
        [(&p, (336.0, 96.0, 0.0)), (&d, (192.0, 0.0, 560.0))],
    )
    .await;
    // host + peer = the external hits, device = the local hits, per node.
    assert_eq!(tiers(&text, &p), ((336.0, 96.0, 0.0), 96.0));
    assert_eq!(tiers(&text, &d), ((192.0, 0.0, 560.0), 560.0));
    let local =
        |n: &FakeNode| sample(&text, HITS, &[("node", &n.address()), ("cache", "local")]).unwrap();
    assert_eq!((local(&p), local(&d)), (336.0, 192.0));

    // A late report of the prefill node's first process adds nothing.
    *p.state.counters.lock().unwrap() = Some(report(7, 320, 64, 0));
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(tiers(&scrape(&router).await, &p).0, (336.0, 96.0, 0.0));
}

#[tokio::test]
async fn the_client_usage_splits_external_hits_by_source_over_http() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let body = serde_json::json!({"model": "synthetic:tiny", "prompt": "hello", "max_tokens": 4})
        .to_string();
    let (status, text) = http_request(router.http, "POST", "/v1/completions", &[], &body).await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let details = &v["usage"]["prompt_tokens_details"];
    let n = |k: &str| details[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
    // The prefill node's hits (its external ones from its host tier), never the decode
    // node's (whose received KV is a peer's).
    assert_eq!(
        (
            n("local_cached_tokens"),
            n("external_host_cached_tokens"),
            n("external_peer_cached_tokens")
        ),
        (u64::from(LOCAL_CACHED), u64::from(EXTERNAL_CACHED), 0)
    );
    assert_eq!(
        n("external_host_cached_tokens") + n("external_peer_cached_tokens"),
        n("external_cached_tokens")
    );
    assert_eq!(
        n("local_cached_tokens") + n("external_cached_tokens"),
        n("cached_tokens")
    );
}
