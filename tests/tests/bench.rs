//! `pdctl bench` against live local clusters (synthetic:tiny, small numbers): the report is
//! consistent with itself, with the usage of its requests and with the router's counters over
//! exactly its window; failed requests are counted when a node dies mid-run; `compare` reads
//! two reports. Timeouts here only detect hangs; nothing asserts how fast anything is.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pd_tests::{Cluster, Process, bin_dir, wait_serving};
use serde_json::Value;

const MODEL: &str = "synthetic:tiny";
const HANG: Duration = Duration::from_secs(90);

fn pdctl_bench(cache: &Path, args: &[&str]) -> Output {
    Command::new(bin_dir().join("pdctl"))
        .arg("bench")
        .args(args)
        .args(["--no-progress"])
        .env("PD_CACHE_DIR", cache)
        .env("RUST_LOG", "warn")
        .env_remove("PD_MODEL")
        .env_remove("PD_ROUTER")
        .output()
        .expect("pdctl runs")
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "pdctl bench failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("report written")).expect("JSON")
}

/// Sum of `family` over every series carrying `label`.
fn sum(text: &str, family: &str, label: &str) -> f64 {
    pd_test_support::metrics::sum(text, family, &[label])
}

/// (hits, queries) of one cache, all roles and nodes.
fn cache(text: &str, tier: &str) -> (f64, f64) {
    let label = format!("cache=\"{tier}\"");
    (
        sum(text, "pd_router_prefix_cache_hits_total", &label),
        sum(text, "pd_router_prefix_cache_queries_total", &label),
    )
}

fn assert_ordered(report: &Value, name: &str) {
    let d = &report["summary"][name];
    let f = |k: &str| d[k].as_f64().unwrap_or_else(|| panic!("{name}.{k}"));
    assert!(d["count"].as_u64().unwrap() > 0, "{name}: no samples");
    assert!(
        f("min") <= f("median") && f("median") <= f("p90") && f("p90") <= f("p99"),
        "{name} percentiles out of order: {d}"
    );
    assert!(
        f("p99") <= f("max") && f("min") <= f("mean") && f("mean") <= f("max"),
        "{d}"
    );
}

fn column(report: &Value, key: &str) -> Vec<u64> {
    report["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r[key].as_u64().unwrap())
        .collect()
}

#[test]
fn reports_agree_with_usage_and_with_the_router_counters_over_the_window() {
    let cache_dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache_dir.path(), &["--model", MODEL]).expect("cluster");
    let router = cluster.router();
    let metrics = cluster.ready["router_metrics"]
        .as_str()
        .expect("router_metrics in the ready line")
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    let plots = dir.path().join("plots");

    let before = pd_test_support::metrics::scrape_blocking(&metrics).unwrap();
    let out = pdctl_bench(
        cache_dir.path(),
        &[
            "--router",
            &router,
            "--router-metrics",
            &metrics,
            "--workload",
            "prefix-repetition",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--output-len",
            "6",
            "--num-prompts",
            "16",
            "--max-concurrency",
            "4",
            "--goodput",
            "ttft:600000",
            "tpot:600000",
            "--label",
            "prefix",
            "--json",
            a.to_str().unwrap(),
            "--plot",
            plots.to_str().unwrap(),
        ],
    );
    ok(&out);
    let after = pd_test_support::metrics::scrape_blocking(&metrics).unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("Router local hit rate (window)"), "{table}");

    let r = read_json(&a);
    assert_eq!(r["schema"], "pdctl-bench");
    assert_eq!(r["schema_version"], 1);
    let s = &r["summary"];
    assert_eq!(s["successful"], 16);
    assert_eq!(s["failed"], 0);
    assert_eq!(r["requests"].as_array().unwrap().len(), 16);
    // Token counts are the sums of the requests' usage.
    let prompt: u64 = column(&r, "prompt_tokens").iter().sum();
    let completion: u64 = column(&r, "completion_tokens").iter().sum();
    assert_eq!(prompt, 16 * 72);
    assert_eq!(s["total_input_tokens"], prompt);
    assert_eq!(s["total_output_tokens"], completion);
    assert_eq!(completion, 16 * 6);
    assert_eq!(
        s["usage_cache"]["cached_tokens"],
        column(&r, "cached_tokens").iter().sum::<u64>()
    );
    for name in ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"] {
        assert_ordered(&r, name);
    }
    assert_eq!(s["goodput"]["good_requests"], 16);

    // Hit rates over the window are the change of the router's counters, not their totals.
    let c = &r["router_prefix_cache"];
    for tier in ["local", "external"] {
        let (h1, q1) = cache(&before, tier);
        let (h2, q2) = cache(&after, tier);
        assert_eq!(c[tier]["hits"].as_f64().unwrap(), h2 - h1, "{tier} hits");
        assert_eq!(
            c[tier]["queries"].as_f64().unwrap(),
            q2 - q1,
            "{tier} queries"
        );
    }
    // Two shared 64-token prefixes: after the first prompt of each, the prefill node finds
    // its blocks; and the router saw exactly the cached tokens the clients were told about.
    assert!(c["local"]["hit_rate"].as_f64().unwrap() > 0.0, "{c}");
    assert_eq!(
        c["prefill_hits"].as_f64().unwrap(),
        c["usage_cached_tokens"].as_f64().unwrap()
    );
    // The KV the decode node pulled over the window: the change of the router's counter, in
    // whole blocks (synthetic:tiny, f32: 3 layers x K and V x 16 tokens x 2 x 32 x 4 bytes).
    let kv = &r["router_kv_transfer"];
    let pulled = |t: &str| sum(t, "pd_router_kv_transfer_bytes_total", "role=\"decode\"");
    let moved = pulled(&after) - pulled(&before);
    assert_eq!(kv["bytes"].as_f64().unwrap(), moved, "{kv}");
    assert!(moved > 0.0 && moved % 24576.0 == 0.0, "{kv}");
    assert!(kv["transfers"].as_f64().unwrap() >= 1.0, "{kv}");
    assert!(kv["mean_transfer_ms"].as_f64().unwrap() > 0.0, "{kv}");
    assert!(table.contains("KV transfer (decode nodes)"), "{table}");
    for chart in ["ttft_cdf", "itl_cdf", "throughput", "hit_rate"] {
        let svg = std::fs::read_to_string(plots.join(format!("{chart}.svg"))).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("polyline"),
            "{chart}"
        );
    }

    // The same workload through the router's OpenAI-compatible HTTP API: every request
    // succeeds, and the cached tokens the clients read in the HTTP usage are again exactly
    // the prefill node's hits.
    let openai = cluster.openai();
    let h = dir.path().join("h.json");
    ok(&pdctl_bench(
        cache_dir.path(),
        &[
            "--router",
            &router,
            "--router-metrics",
            &metrics,
            "--backend",
            "openai",
            "--openai-url",
            &openai,
            "--workload",
            "prefix-repetition",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--output-len",
            "6",
            "--num-prompts",
            "8",
            "--json",
            h.to_str().unwrap(),
        ],
    ));
    let r = read_json(&h);
    assert_eq!(r["config"]["backend"], "openai");
    assert_eq!(r["summary"]["successful"], 8);
    assert_eq!(column(&r, "completion_tokens").iter().sum::<u64>(), 8 * 6);
    assert_eq!(column(&r, "prompt_tokens").iter().sum::<u64>(), 8 * 72);
    assert_ordered(&r, "ttft_ms");
    let c = &r["router_prefix_cache"];
    assert!(c["usage_cached_tokens"].as_f64().unwrap() > 0.0, "{c}");
    assert_eq!(
        c["prefill_hits"].as_f64().unwrap(),
        c["usage_cached_tokens"].as_f64().unwrap()
    );

    // Warm-up requests are sent first and left out; the conversation workload sends every
    // turn after the previous one, with its history (here through the HTTP API's chat
    // completions).
    let b = dir.path().join("b.json");
    ok(&pdctl_bench(
        cache_dir.path(),
        &[
            "--router",
            &router,
            "--backend",
            "openai",
            "--openai-url",
            &openai,
            "--workload",
            "conversation",
            "--output-len",
            "4",
            "--num-prompts",
            "3",
            "--warmup",
            "2",
            "--request-rate",
            "50",
            "--json",
            b.to_str().unwrap(),
        ],
    ));
    let r = read_json(&b);
    let requests = r["requests"].as_array().unwrap();
    let sessions: std::collections::BTreeSet<u64> = requests
        .iter()
        .map(|q| q["session"].as_u64().unwrap())
        .collect();
    assert_eq!(sessions.len(), 3, "warm-up sessions are not in the report");
    assert!(
        requests.len() > 3,
        "every turn of each conversation is sent"
    );
    assert!(requests.iter().any(|q| q["turn"].as_u64().unwrap() > 0));
    assert_eq!(r["summary"]["failed"], 0);
    assert!(
        r["router_prefix_cache"].is_null(),
        "no --router-metrics: no hit rates"
    );

    let out = Command::new(bin_dir().join("pdctl"))
        .args(["bench", "compare"])
        .args([&a, &b])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("B/A") && text.contains("TTFT p50 (ms)"),
        "{text}"
    );
    let not_a_report = dir.path().join("x.json");
    std::fs::write(&not_a_report, "{}").unwrap();
    let out = Command::new(bin_dir().join("pdctl"))
        .args(["bench", "compare"])
        .args([&a, &not_a_report])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a pdctl bench report"));
    assert!(cluster.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_failed_when_a_node_dies_mid_run_are_counted_by_code() {
    let cache = tempfile::tempdir().unwrap();
    let node = |role: &str| {
        Process::start(
            &format!("{role}-node"),
            cache.path(),
            &["--model", MODEL, "--port", "0"],
        )
        .unwrap_or_else(|e| panic!("{role} node: {e:#}"))
    };
    let prefill = node("prefill");
    let decode = node("decode");
    let router = Process::start(
        "router",
        cache.path(),
        &[
            "--model",
            MODEL,
            "--health-interval-ms",
            "200",
            "--metrics-port",
            "0",
            "--prefill",
            &prefill.addr(),
            "--decode",
            &decode.addr(),
        ],
    )
    .expect("router");
    wait_serving(&router.addr()).await.unwrap();
    let metrics = router.ready["metrics_addr"].as_str().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    let bench = Command::new(bin_dir().join("pdctl"))
        .args(["bench", "--no-progress", "--router", &router.addr()])
        .args(["--router-metrics", &metrics, "--workload", "random"])
        .args([
            "--input-len",
            "32",
            "--output-len",
            "200",
            "--num-prompts",
            "12",
        ])
        .args(["--max-concurrency", "2", "--json", report.to_str().unwrap()])
        .env("PD_CACHE_DIR", cache.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the decode node once the benchmark is under way: the first request has finished.
    let start = Instant::now();
    loop {
        let text = pd_test_support::metrics::scrape(&metrics).await.unwrap();
        if sum(&text, "pd_router_requests_total", "outcome=\"length\"") >= 1.0 {
            break;
        }
        assert!(start.elapsed() < HANG, "no request finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    decode.kill();
    let out = tokio::task::spawn_blocking(move || bench.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    ok(&out);
    let r = read_json(&report);
    let s = &r["summary"];
    let sent = s["requests_sent"].as_u64().unwrap();
    let (good, bad) = (
        s["successful"].as_u64().unwrap(),
        s["failed"].as_u64().unwrap(),
    );
    assert_eq!(sent, 12);
    assert_eq!(good + bad, sent);
    assert!(good >= 1 && bad >= 1, "{s}");
    let by_code = s["failed_by_outcome"].as_object().unwrap();
    assert_eq!(
        by_code.values().map(|v| v.as_u64().unwrap()).sum::<u64>(),
        bad
    );
    // A dead node is UNAVAILABLE to the client (a stream cut mid-way, or no decode node left).
    assert!(by_code.contains_key("unavailable"), "{by_code:?}");
    let rows = r["requests"].as_array().unwrap();
    let failed: Vec<&Value> = rows
        .iter()
        .filter(|q| q["outcome"] == "unavailable")
        .collect();
    assert!(
        failed
            .iter()
            .all(|q| q["error"].is_string() && q["completion_tokens"] == 0)
    );
    drop(router);
    drop(prefill);
}
