//! The router's exactness invariant under faults, through real processes: counter reports
//! dropped, repeated and reordered at random (the router's test-only
//! `PD_ROUTER_REPORT_FAULTS` hook), a prefill node killed and restarted mid-run (a new
//! epoch), and the router itself restarted. At every scrape the router's counters never
//! decrease within one router process and every hit ratio lies in [0, 1]; once reports have
//! caught up, the router's totals equal the sum over each node's epochs of what it counted.
//!
//! One test in its own binary: it sets the fault variable in its own environment, which every
//! process it starts inherits.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use pd_tests::{Counts, Exposition, Process, client, collect, exposition, greedy, metrics_addr};

const MODEL: &str = "synthetic:tiny";
const FAULTS: &str = "drop=0.3,dup=0.3,reorder=0.3,seed=7";
const SETTLE: Duration = Duration::from_secs(30);

fn node(role: &str, cache: &Path, port: u16) -> Process {
    let port = port.to_string();
    Process::start(
        &format!("{role}-node"),
        cache,
        &["--model", MODEL, "--port", &port, "--metrics-port", "0"],
    )
    .unwrap_or_else(|e| panic!("{role} node: {e:#}"))
}

fn router(cache: &Path, prefill: &str, decode: &str) -> Process {
    Process::start(
        "router",
        cache,
        &[
            "--model",
            MODEL,
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--metrics-port",
            "0",
            "--health-interval-ms",
            "100",
        ],
    )
    .expect("router")
}

/// What one router process has exported so far: every counter only grows, every hit ratio
/// stays in [0, 1].
#[derive(Default)]
struct Watch {
    last: BTreeMap<String, f64>,
}

impl Watch {
    fn check(&mut self, e: &Exposition) {
        for sample in &e.samples {
            let (name, labels, value) = (&sample.name, &sample.labels, sample.value);
            if !name.ends_with("_total") {
                continue;
            }
            let key = format!("{name}{labels:?}");
            let before = self.last.insert(key.clone(), value).unwrap_or(0.0);
            assert!(value >= before, "{key} went down from {before} to {value}");
        }
        for cache in ["local", "external"] {
            for role in ["prefill", "decode"] {
                let l = [("cache", cache), ("role", role)];
                let q = e.sum("pd_router_prefix_cache_queries_total", &l);
                let h = e.sum("pd_router_prefix_cache_hits_total", &l);
                assert!((0.0..=q).contains(&h), "{cache} {role} hits {h} of {q}");
            }
        }
    }
}

/// A node the router should account for: its address and role, its metrics address, and
/// what earlier epochs of it counted (the router keeps those).
struct Expect<'a> {
    role: &'a str,
    addr: String,
    metrics: String,
    earlier: Counts,
}

/// Waits until the router's counters of every node equal the node's own plus its earlier
/// epochs', checking every scrape on the way; returns the router's last page.
async fn settle(router_metrics: &str, nodes: &[Expect<'_>], watch: &mut Watch) -> Exposition {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let page = exposition(router_metrics).await.expect("router /metrics");
        watch.check(&page);
        let mut agree = true;
        for n in nodes {
            let own = Counts::of_node(&exposition(&n.metrics).await.expect("node /metrics"));
            let want = own.plus(&n.earlier);
            let seen = Counts::of_router(&page, n.role, &n.addr);
            assert!(
                tokio::time::Instant::now() < deadline,
                "router: {seen:?}, nodes' epochs: {want:?} ({} {})",
                n.role,
                n.addr
            );
            agree &= seen == want;
        }
        if agree {
            return page;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Requests that hit and miss: a few prompts, each sent twice.
async fn traffic(router: &str, seeds: std::ops::Range<u32>, watch: &mut Watch, metrics: &str) {
    let mut c = client(router).await;
    for seed in seeds {
        let ids: Vec<u32> = (0..(20 + seed % 3 * 17))
            .map(|t| (t * 7919 + seed * 104_729 + 11) % 150_000)
            .collect();
        for _ in 0..2 {
            collect(&mut c, greedy(ids.clone(), 3))
                .await
                .expect("served");
            watch.check(&exposition(metrics).await.unwrap());
        }
    }
}

/// Waits until the router counts `n` restarts of `role` nodes (it has then seen the new
/// epoch's Info, so the node is up again).
async fn restarts_seen(router_metrics: &str, role: &str, n: f64, watch: &mut Watch) {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let page = exposition(router_metrics).await.unwrap();
        watch.check(&page);
        let seen = page.sum("pd_router_node_restarts_total", &[("role", role)]);
        let up = page.sum("pd_router_node_up", &[("role", role)]);
        if seen == n && up == 1.0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "restarts seen: {seen}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn router_totals_are_exact_under_dropped_repeated_reordered_reports_and_restarts() {
    // SAFETY: set before any other thread of this test binary exists (its only test, before
    // the runtime starts); the processes it starts inherit it.
    unsafe {
        std::env::set_var("PD_ROUTER_REPORT_FAULTS", FAULTS);
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run());
}

async fn run() {
    let cache = tempfile::tempdir().unwrap();
    let prefill = node("prefill", cache.path(), 0);
    let decode = node("decode", cache.path(), 0);
    let r1 = router(cache.path(), &prefill.addr(), &decode.addr());
    pd_tests::wait_serving(&r1.addr()).await.unwrap();
    let r1_metrics = metrics_addr(&r1.ready);
    let mut watch = Watch::default();

    // Epoch 1 of the prefill node.
    traffic(&r1.addr(), 0..6, &mut watch, &r1_metrics).await;
    // Same address before and after the restart.
    let prefill_addr = prefill.addr();
    let decode_metrics = metrics_addr(&decode.ready);
    let expect = |prefill_metrics: &str, prefill_earlier: Counts| {
        [
            Expect {
                role: "prefill",
                addr: prefill_addr.clone(),
                metrics: prefill_metrics.to_string(),
                earlier: prefill_earlier,
            },
            Expect {
                role: "decode",
                addr: decode.addr(),
                metrics: decode_metrics.clone(),
                earlier: Counts::default(),
            },
        ]
    };
    let prefill_metrics = metrics_addr(&prefill.ready);
    settle(
        &r1_metrics,
        &expect(&prefill_metrics, Counts::default()),
        &mut watch,
    )
    .await;
    let epoch1 = Counts::of_node(&exposition(&prefill_metrics).await.unwrap());
    assert!(epoch1.queries > 0.0 && epoch1.hits > 0.0, "{epoch1:?}");

    // The prefill node crashes and comes back on the same port: a new epoch from zero.
    let port = prefill.port();
    let addr = prefill.addr();
    prefill.kill();
    let prefill = node("prefill", cache.path(), port);
    assert_eq!(prefill.addr(), addr);
    let prefill_metrics = metrics_addr(&prefill.ready);
    restarts_seen(&r1_metrics, "prefill", 1.0, &mut watch).await;
    traffic(&r1.addr(), 6..10, &mut watch, &r1_metrics).await;
    let page = settle(&r1_metrics, &expect(&prefill_metrics, epoch1), &mut watch).await;
    assert_eq!(
        page.sum("pd_router_node_restarts_total", &[("role", "decode")]),
        0.0
    );

    // The router restarts: it starts from zero and accounts for the nodes' current epochs.
    let nodes = (prefill.addr(), decode.addr());
    r1.kill();
    let r2 = router(cache.path(), &nodes.0, &nodes.1);
    pd_tests::wait_serving(&r2.addr()).await.unwrap();
    let r2_metrics = metrics_addr(&r2.ready);
    let mut watch = Watch::default();
    settle(
        &r2_metrics,
        &expect(&prefill_metrics, Counts::default()),
        &mut watch,
    )
    .await;
    traffic(&r2.addr(), 10..12, &mut watch, &r2_metrics).await;
    let page = settle(
        &r2_metrics,
        &expect(&prefill_metrics, Counts::default()),
        &mut watch,
    )
    .await;
    assert_eq!(page.sum("pd_router_node_restarts_total", &[]), 0.0);
}
