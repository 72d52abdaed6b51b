//! The metrics, end to end through real processes (`pdctl up`) and real scrapes: the
//! prefix-cache counting matrix with exact token numbers at every node's `/metrics` and at
//! the router's, the usage check (the cached tokens each client sees are the per-request
//! increments of the prefill node's counters), request outcomes, and the exposition's
//! validity (Python's `prometheus_client` parser, `promtool check metrics`, `pdctl metrics`).

use std::time::Duration;

use pd_proto::pb;
use pd_tests::{
    Cluster, Counts, Exposition, TierHits, client, collect, collect_as, exposition, greedy, pdctl,
    with_key,
};

const BLOCK: f64 = 16.0;

/// The router's counters keep up with a node's within this long (an Info poll at most).
const SETTLE: Duration = Duration::from_secs(20);

/// A prompt of `len` token ids, distinct for each `seed`.
fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|t| (t * 7919 + seed * 104_729 + 11) % 150_000)
        .collect()
}

/// The counters of the cluster's one prefill and one decode node once the router's view of
/// both equals the nodes' own `/metrics` (it follows them through responses and Info polls).
#[derive(Debug, Clone)]
struct View {
    prefill: Counts,
    decode: Counts,
    /// Hits by tier of the prefill and the decode node (the router's equal the nodes').
    tiers: [TierHits; 2],
    router: Exposition,
}

async fn settled(cluster: &Cluster) -> View {
    let deadline = tokio::time::Instant::now() + SETTLE;
    let router_addr = cluster.router_metrics();
    loop {
        let router = cluster
            .exposition(&router_addr)
            .await
            .expect("router /metrics");
        let mut nodes = Vec::new();
        let mut tiers = Vec::new();
        let mut agree = true;
        for role in ["prefill", "decode"] {
            let addr = &cluster.nodes(role)[0];
            let node = cluster
                .exposition(&cluster.node_metrics(role)[0])
                .await
                .expect("node /metrics");
            let own = (Counts::of_node(&node), TierHits::of_node(&node));
            let seen = (
                Counts::of_router(&router, role, addr),
                TierHits::of_router(&router, role, addr),
            );
            agree &= own == seen;
            if tokio::time::Instant::now() > deadline {
                panic!("the router's counters of {role} {addr} are {seen:?}, the node's {own:?}");
            }
            // The node's own books: device = local hits, host + peer = external hits.
            assert_eq!(own.1.device, own.0.hits, "{role}: {own:?}");
            assert_eq!(
                own.1.host + own.1.peer,
                own.0.external_hits,
                "{role}: {own:?}"
            );
            nodes.push(own.0);
            tiers.push(own.1);
        }
        if agree {
            return View {
                prefill: nodes[0],
                decode: nodes[1],
                tiers: [tiers[0], tiers[1]],
                router,
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

type Client = pb::generation_client::GenerationClient<tonic::transport::Channel>;

/// Runs `req` to its end and returns its usage and the counters it added on each node.
async fn run(
    cluster: &Cluster,
    c: &mut Client,
    req: pb::GenerateRequest,
) -> (pb::Usage, Counts, Counts) {
    let (usage, prefill, decode, _) = run_by_tier(cluster, c, req).await;
    (usage, prefill, decode)
}

/// [`run`], with the hits by tier the request added on the prefill and the decode node.
async fn run_by_tier(
    cluster: &Cluster,
    c: &mut Client,
    req: pb::GenerateRequest,
) -> (pb::Usage, Counts, Counts, [TierHits; 2]) {
    let before = settled(cluster).await;
    let (_, last) = collect_as(c, req, cluster.api_key())
        .await
        .expect("the request completes");
    let after = settled(cluster).await;
    let usage = last.usage.expect("usage on the last chunk");
    let prefill = after.prefill.minus(&before.prefill);
    // The usage check: what the client is told its prefix cache saved is exactly what the
    // prefill node counted for this request.
    assert_eq!(
        f64::from(usage.local_cached_tokens),
        prefill.hits,
        "{usage:?}"
    );
    assert_eq!(
        f64::from(usage.external_cached_tokens),
        prefill.external_hits,
        "{usage:?}"
    );
    assert_eq!(
        usage.cached_tokens,
        usage.local_cached_tokens + usage.external_cached_tokens
    );
    // The split by source: what the prefill node counted for this request, per tier, and
    // summing to the external hits; with the computed tokens, to the prompt.
    let tiers = [
        after.tiers[0].minus(&before.tiers[0]),
        after.tiers[1].minus(&before.tiers[1]),
    ];
    let (host, peer) = (
        usage.external_host_cached_tokens,
        usage.external_peer_cached_tokens,
    );
    assert_eq!(
        (f64::from(host), f64::from(peer)),
        (tiers[0].host, tiers[0].peer),
        "{usage:?}"
    );
    assert_eq!(host + peer, usage.external_cached_tokens, "{usage:?}");
    assert!(usage.local_cached_tokens + host + peer <= usage.prompt_tokens);
    assert_eq!(f64::from(usage.prompt_tokens), prefill.prompt_tokens);
    let decode = after.decode.minus(&before.decode);
    (usage, prefill, decode, tiers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counting_matrix_is_exact_at_the_nodes_and_the_router() {
    counting_matrix(&[]).await;
}

/// The matrix on a `pdctl up --secure` cluster: TLS on every port, mTLS between the parts, the
/// API key on every request, the same exact counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counting_matrix_is_exact_on_a_secure_cluster() {
    counting_matrix(&["--secure"]).await;
}

async fn counting_matrix(up_flags: &[&str]) {
    let cache = tempfile::tempdir().unwrap();
    // A small device cache (48 blocks) spilling to a host tier, and chunked prefill (steps
    // that produce no token).
    let mut args = up_flags.to_vec();
    args.extend([
        "--",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "48",
        "--host-cache-blocks",
        "64",
        "--max-num-batched-tokens",
        "32",
    ]);
    let cluster = Cluster::up(cache.path(), &args).unwrap();
    let mut c = cluster.client().await;
    let key = cluster.api_key();
    let start = settled(&cluster).await;
    assert_eq!(start.prefill, Counts::default());
    let p1 = prompt(1, 40); // 2 full blocks + 8 tokens

    // Prompt logprobs: the prefill node computes every position, no lookup, nothing counted.
    // The decode node still looks up its own cache and receives the rest.
    let mut req = greedy(prompt(0, 40), 4);
    req.sampling.as_mut().unwrap().prompt_logprobs = Some(1);
    let (_, pre, dec) = run(&cluster, &mut c, req).await;
    assert_eq!(
        pre.prefix(),
        (0.0, 0.0, 0.0, 0.0),
        "no lookup for prompt logprobs"
    );
    assert_eq!(pre.prompt_tokens, 40.0);
    assert_eq!(dec.prefix(), (40.0, 0.0, 40.0, 40.0));

    // Cold miss: queries count, hits 0; the decode node receives the whole prompt.
    let (usage, pre, dec) = run(&cluster, &mut c, greedy(p1.clone(), 4)).await;
    assert_eq!(pre.prefix(), (40.0, 0.0, 40.0, 0.0), "cold miss");
    assert_eq!(dec.prefix(), (40.0, 0.0, 40.0, 40.0), "all received");
    assert_eq!(usage.cached_tokens, 0);

    // Repeat: whole blocks hit locally (never the last token) on both nodes; the decode node
    // receives only the last, partial block.
    let (usage, pre, dec) = run(&cluster, &mut c, greedy(p1.clone(), 4)).await;
    assert_eq!(pre.prefix(), (40.0, 2.0 * BLOCK, 8.0, 0.0), "local hit");
    assert_eq!(
        dec.prefix(),
        (40.0, 2.0 * BLOCK, 8.0, 8.0),
        "decode local + received"
    );
    assert_eq!(usage.local_cached_tokens, 32);

    // A different cache salt never hits.
    let mut salted = greedy(p1.clone(), 4);
    salted.cache_salt = Some("tenant-b".into());
    let (usage, pre, dec) = run(&cluster, &mut c, salted).await;
    assert_eq!(pre.prefix(), (40.0, 0.0, 40.0, 0.0), "salted: miss");
    assert_eq!(dec.prefix(), (40.0, 0.0, 40.0, 40.0));
    assert_eq!(usage.cached_tokens, 0);

    // Evict p1 from both device caches (6 × 13 blocks through 48): the prefill node spills
    // its blocks to the host tier and restores them (external hits on the prefill node).
    for seed in 10..16 {
        run(&cluster, &mut c, greedy(prompt(seed, 200), 4)).await;
    }
    let (usage, pre, dec, tiers) = run_by_tier(&cluster, &mut c, greedy(p1.clone(), 4)).await;
    assert_eq!(
        pre.prefix(),
        (40.0, 0.0, 40.0, 2.0 * BLOCK),
        "restored from host"
    );
    assert_eq!(dec.prefix(), (40.0, 0.0, 40.0, 40.0));
    assert_eq!(
        (usage.local_cached_tokens, usage.external_cached_tokens),
        (0, 32)
    );
    // By tier: the prefill node's external hits are its host tier's; the decode node's are
    // the KV it received from the prefill node (a peer).
    assert_eq!(
        (
            usage.external_host_cached_tokens,
            usage.external_peer_cached_tokens
        ),
        (32, 0)
    );
    assert_eq!(
        tiers,
        [
            TierHits {
                device: 0.0,
                host: 2.0 * BLOCK,
                peer: 0.0
            },
            TierHits {
                device: 0.0,
                host: 0.0,
                peer: 40.0
            }
        ]
    );

    // Aborted right after its lookup, before any token (a 600-token prompt prefilled 32
    // tokens per step): its lookup is counted exactly once, at the node and the router.
    let before = settled(&cluster).await;
    let mut req = greedy(prompt(99, 600), 100);
    req.request_id = Some("abort-after-lookup".into());
    let mut stream = c.generate(with_key(req, key)).await.unwrap().into_inner();
    let prefill_metrics = cluster.node_metrics("prefill")[0].clone();
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let now = Counts::of_node(&cluster.exposition(&prefill_metrics).await.unwrap());
        if now.queries > before.prefill.queries {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never looked up");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let abort = pb::AbortRequest {
        request_id: "abort-after-lookup".into(),
    };
    let aborted = c.abort(with_key(abort, key)).await.unwrap().into_inner();
    assert!(aborted.aborted);
    let mut reason = None;
    while let Ok(Some(chunk)) = stream.message().await {
        if chunk.finish_reason != 0 {
            reason = Some(chunk.finish_reason());
        }
    }
    assert_eq!(reason, Some(pb::FinishReason::Abort));
    let after = settled(&cluster).await;
    let pre = after.prefill.minus(&before.prefill);
    assert_eq!(
        pre.prefix(),
        (600.0, 0.0, 600.0, 0.0),
        "the aborted lookup, once"
    );

    // Outcomes and client-perceived histograms: 11 requests ran to their length, 1 aborted;
    // every request but the aborted one had a first token, and 3 more after it.
    let r = &after.router;
    let outcome = |o: &str| r.sum("pd_router_requests_total", &[("outcome", o)]);
    assert_eq!(outcome("length"), 11.0);
    assert_eq!(outcome("abort"), 1.0);
    assert_eq!(r.sum("pd_router_requests_in_flight", &[]), 0.0);
    let ttft = r.sum("pd_router_time_to_first_token_seconds_count", &[]);
    assert!(ttft == 11.0 || ttft == 12.0, "first tokens: {ttft}");
    assert!(r.sum("pd_router_inter_token_latency_seconds_count", &[]) >= 33.0);
    assert_eq!(r.sum("pd_router_request_duration_seconds_count", &[]), 12.0);
    for role in ["prefill", "decode"] {
        assert_eq!(
            r.sum("pd_router_node_up", &[("role", role)]),
            1.0,
            "{role} up"
        );
        assert_eq!(
            r.sum("pd_router_node_restarts_total", &[("role", role)]),
            0.0
        );
    }
    // KV moved from the prefill node to the decode node, and both sides say so.
    assert!(r.sum("pd_router_kv_transfer_bytes_total", &[("role", "decode")]) > 0.0);
    assert!(r.sum("pd_router_kv_transfer_seconds_count", &[("role", "decode")]) > 0.0);
    // Host-memory KV: every import landed in place in blocks the decode engine reserved:
    // the 11 requests that ran to their length, and the aborted one if its prefill ended
    // before the abort arrived (a race this test does not control).
    let decode = cluster
        .exposition(&cluster.node_metrics("decode")[0])
        .await
        .unwrap();
    let landed = |l: &str| decode.sum("pd_node_kv_imports_total", &[("landing", l)]);
    assert_eq!(landed("buffers"), 0.0);
    let in_place = landed("in_place");
    assert!(in_place == 11.0 || in_place == 12.0, "{in_place}");
    // No RDMA device here: the prefill node offered no lease for RDMA reads, and says so
    // under both layouts (the series exist before any offer, for dashboards and alerts).
    let prefill = cluster
        .exposition(&cluster.node_metrics("prefill")[0])
        .await
        .unwrap();
    assert_eq!(
        prefill.label_values("pd_node_kv_rdma_offers_total", "layout"),
        ["in_place", "staged"]
    );
    for layout in ["in_place", "staged"] {
        let offers = prefill.sum("pd_node_kv_rdma_offers_total", &[("layout", layout)]);
        assert_eq!(offers, 0.0, "{layout}");
    }
    // Hit rates of every node and pair lie in [0, 1].
    for cache in ["local", "external"] {
        for role in ["prefill", "decode"] {
            let l = [("cache", cache), ("role", role)];
            let q = r.sum("pd_router_prefix_cache_queries_total", &l);
            let h = r.sum("pd_router_prefix_cache_hits_total", &l);
            assert!(q > 0.0 && (0.0..=q).contains(&h), "{cache} {role}: {h}/{q}");
        }
    }
}

/// `program` with `args`, `text` on its stdin: what it answered.
fn fed(program: &str, args: &[&str], text: &str) -> std::process::Output {
    use std::io::Write as _;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// Parses `text` with Python's `prometheus_client` (the reference parser).
fn python_parses(text: &str) {
    let script = "import sys\nfrom prometheus_client.parser import text_string_to_metric_families as f\n\
                  print(sum(1 for _ in f(sys.stdin.read())))";
    let out = fed("python3", &["-c", script], text);
    assert!(
        out.status.success(),
        "prometheus_client cannot parse it: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `promtool check metrics` on `text`: clean (no lint). Needs promtool on PATH
/// (scripts/prometheus-check.sh installs it).
fn promtool_clean(text: &str) {
    let out = fed("promtool", &["check", "metrics"], text);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}"
    );
}

/// The router's exposition after a request of each outcome (finished, refused) passes
/// `promtool check metrics` without a lint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs promtool: scripts/prometheus-check.sh installs it and runs this"]
async fn the_router_exposition_is_promtool_clean() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &["--prefill", "1", "--decode", "1"]).unwrap();
    let mut c = client(&cluster.router()).await;
    collect(&mut c, greedy(prompt(3, 40), 3)).await.unwrap();
    let mut bad = greedy(vec![1, 2, 3], 3);
    bad.max_tokens = Some(0);
    collect(&mut c, bad).await.expect_err("max_tokens 0");
    let router = exposition(&cluster.router_metrics()).await.unwrap();
    promtool_clean(&router.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_disabled_counts_nothing_and_the_exposition_is_valid() {
    let cache = tempfile::tempdir().unwrap();
    // A free port for the router's /metrics (`pdctl up --metrics-port`).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
        .to_string();
    let cluster = Cluster::up(
        cache.path(),
        &[
            "--prefill",
            "1",
            "--decode",
            "1",
            "--metrics-port",
            &port,
            "--",
            "--no-enable-prefix-caching",
        ],
    )
    .unwrap();
    // The ready line: URLs to scrape for the router and each node, HOST:PORT targets for
    // Prometheus beside them.
    let url = cluster.router_metrics();
    assert_eq!(url, format!("http://127.0.0.1:{port}/metrics"));
    for role in ["prefill", "decode"] {
        let entry = &cluster.ready[role][0]["metrics"];
        let target = &cluster.node_metrics(role)[0];
        assert_eq!(
            entry.as_str(),
            Some(format!("http://{target}/metrics").as_str())
        );
    }
    let mut c = client(&cluster.router()).await;
    let p = prompt(3, 40);
    for _ in 0..2 {
        let (usage, pre, dec) = run(&cluster, &mut c, greedy(p.clone(), 3)).await;
        assert_eq!(pre.prefix(), (0.0, 0.0, 0.0, 0.0), "prefill: no lookup");
        assert_eq!(dec.prefix(), (0.0, 0.0, 0.0, 0.0), "decode: no lookup");
        assert_eq!(pre.prompt_tokens, 40.0);
        assert_eq!(usage.cached_tokens, 0);
    }
    // Bad input is counted by its gRPC code.
    let mut bad = greedy(vec![1, 2, 3], 3);
    bad.max_tokens = Some(0);
    let err = collect(&mut c, bad).await.expect_err("max_tokens 0");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let router = exposition(&cluster.router_metrics()).await.unwrap();
    assert_eq!(
        router.sum(
            "pd_router_requests_total",
            &[("outcome", "invalid_argument")]
        ),
        1.0
    );
    assert_eq!(
        router.sum("pd_router_requests_total", &[("outcome", "length")]),
        2.0
    );
    // The router never re-exports a node's vLLM series.
    assert!(
        !router.text.contains("vllm:"),
        "the router re-exports vllm:*"
    );
    assert_eq!(
        router.label_values("pd_router_node_up", "role"),
        vec!["decode", "prefill"]
    );
    python_parses(&router.text);
    for role in ["prefill", "decode"] {
        let node = exposition(&cluster.node_metrics(role)[0]).await.unwrap();
        assert!(node.has("vllm:prefix_cache_queries_total"), "{role}");
        python_parses(&node.text);
    }

    // `pdctl metrics --once --json` reads the same numbers.
    let out = pdctl(
        cache.path(),
        &[
            "metrics",
            "--router-metrics",
            &cluster.router_metrics(),
            "--once",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["requests"], 3.0);
    assert_eq!(summary["outcomes"]["length"], 2.0);
    let nodes = summary["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    assert!(nodes.iter().all(|n| n["up"] == true), "{nodes:?}");
    // No lookups: no hit rate at all rather than a made-up 0 %.
    assert!(nodes.iter().all(|n| n["local_hit_rate"].is_null()));
    // The table form prints every node.
    let out = pdctl(
        cache.path(),
        &[
            "metrics",
            "--router-metrics",
            &cluster.router_metrics(),
            "--once",
        ],
    );
    let table = String::from_utf8_lossy(&out.stdout);
    for addr in cluster
        .nodes("prefill")
        .iter()
        .chain(&cluster.nodes("decode"))
    {
        assert!(table.contains(addr.as_str()), "{table}");
    }
    // A wrong address is a clear error, not a summary of zeros.
    let out = pdctl(
        cache.path(),
        &[
            "metrics",
            "--router-metrics",
            &cluster.node_metrics("prefill")[0],
            "--once",
        ],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("router"));
}
