//! The nodes' `/metrics` and `CounterReport`, scraped over real HTTP from a prefill node and a
//! decode node (started in process through their libraries, real gRPC and KV transport on
//! 127.0.0.1, ephemeral ports; the test plays the router). Exact token counts for a cold
//! miss, a local hit on repeat, a prompt-logprobs request (no lookup), KV received by the
//! decode node (external hits), transfer bytes and failures; the exposition read by a strict
//! parser (`Exposition::parse_strict`), vLLM's labels and `le` spelling; the report in
//! `Info` and in the responses equal to what `/metrics` shows; a distinct epoch per node.

use std::time::{Duration, Instant};

use pd_proto::pb;
use tonic::Code;

use pd_test_support::node::{Node, decode_node, prefill_node};
use pd_test_support::{Exposition, metrics, prompt};

const MODEL: &str = "synthetic:tiny";
const BLOCK: usize = 16;

/// A node's `/metrics`, as these tests read it.
trait Scraped {
    async fn metrics(&self) -> Exposition;
    async fn eventually(&self, name: &str, labels: &[(&str, &str)], want: f64);
}

impl Scraped for Node {
    /// Scrape and parse strictly; the content type is checked on every scrape.
    async fn metrics(&self) -> Exposition {
        let scrape = metrics::fetch(&self.ready.metrics_addr.to_string())
            .await
            .expect("/metrics");
        assert_eq!(
            scrape.content_type,
            "text/plain; version=0.0.4; charset=utf-8"
        );
        // A Content-Length, not a chunked body, and all of it arrived.
        assert_eq!(scrape.content_length, Some(scrape.body.len()));
        Exposition::parse_strict(&scrape.body).unwrap_or_else(|e| panic!("{e}\n{}", scrape.body))
    }

    /// Wait for a sample to reach `want`: the exporter counts a transfer once its last byte
    /// is written, which may trail the importer's view by a moment.
    async fn eventually(&self, name: &str, labels: &[(&str, &str)], want: f64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = self.metrics().await.value(name, labels);
            if got == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name} {labels:?}: {got}, want {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn sampling(prompt_logprobs: Option<u32>) -> Option<pb::SamplingParams> {
    Some(pb::SamplingParams {
        temperature: Some(0.0),
        prompt_logprobs,
        ..Default::default()
    })
}

async fn prefill(node: &Node, id: &str, tokens: &[u32], logprobs: bool) -> pb::PrefillResponse {
    node.prefill()
        .await
        .prefill(pb::PrefillRequest {
            sampling: sampling(logprobs.then_some(1)),
            ..pd_test_support::prefill_request(id, tokens.to_vec())
        })
        .await
        .expect("prefill")
        .into_inner()
}

async fn release(node: &Node, r: &pb::PrefillResponse) {
    let kv = r.kv.as_ref().unwrap();
    let lease_id = kv.lease_id;
    let released = node
        .prefill()
        .await
        .release_kv(pb::ReleaseKvRequest {
            lease_id,
            lease_secret: kv.lease_secret.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .released;
    assert!(released, "lease {lease_id} still held");
}

fn decode_request(id: &str, tokens: &[u32], r: &pb::PrefillResponse) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: id.into(),
        prompt_token_ids: tokens.to_vec(),
        first_token: r.first_token.as_ref().unwrap().token_id,
        sampling: sampling(None),
        max_tokens: 4,
        stop_token_ids: vec![],
        ignore_eos: true,
        cache_salt: None,
        kv: r.kv.clone(),
        resumed_tokens: 0,
    }
}

/// Prefill, decode to the end, release the lease: the decode messages.
async fn generate(p: &Node, d: &Node, id: &str, tokens: &[u32]) -> Vec<pb::DecodeResponse> {
    let r = prefill(p, id, tokens, false).await;
    let mut stream = d
        .decode()
        .await
        .decode(decode_request(id, tokens, &r))
        .await
        .expect("decode")
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.expect("decode stream") {
        out.push(m);
    }
    release(p, &r).await;
    out
}

/// The node's prefix-cache counters at /metrics: (queries, hits, external queries,
/// external hits).
fn prefix(m: &Exposition) -> (f64, f64, f64, f64) {
    (
        m.value("vllm:prefix_cache_queries_total", &[]),
        m.value("vllm:prefix_cache_hits_total", &[]),
        m.value("vllm:external_prefix_cache_queries_total", &[]),
        m.value("vllm:external_prefix_cache_hits_total", &[]),
    )
}

/// Prompt tokens by source: (local_compute, local_cache_hit, external_kv_transfer); the
/// host tier's `external_host_cache_hit` is checked to be 0 (decode nodes here run without
/// one), and the sources to sum to `vllm:prompt_tokens_total`.
fn by_source(m: &Exposition) -> (f64, f64, f64) {
    let v = |s| m.value("vllm:prompt_tokens_by_source_total", &[("source", s)]);
    assert_eq!(v("external_host_cache_hit"), 0.0);
    let split = (
        v("local_compute"),
        v("local_cache_hit"),
        v("external_kv_transfer"),
    );
    assert_eq!(
        split.0 + split.1 + split.2,
        m.value("vllm:prompt_tokens_total", &[])
    );
    split
}

fn finished(m: &Exposition) -> f64 {
    ["stop", "length", "abort"]
        .iter()
        .map(|r| m.value("vllm:request_success_total", &[("finished_reason", r)]))
        .sum()
}

/// The report's counters equal what /metrics shows.
fn assert_report_matches(r: &pb::CounterReport, m: &Exposition) {
    let n = |v: u64| v as f64;
    assert_eq!(
        (
            n(r.prefix_cache_queries),
            n(r.prefix_cache_hits),
            n(r.external_prefix_cache_queries),
            n(r.external_prefix_cache_hits)
        ),
        prefix(m)
    );
    assert_eq!(n(r.prompt_tokens), m.value("vllm:prompt_tokens_total", &[]));
    // External hits by source: they sum to the external hits, and each equals the prompt
    // tokens of its source (both are counted from the same lookup).
    assert_eq!(
        r.external_prefix_cache_hits_host + r.external_prefix_cache_hits_peer,
        r.external_prefix_cache_hits
    );
    let source = |s| m.value("vllm:prompt_tokens_by_source_total", &[("source", s)]);
    assert_eq!(
        (
            n(r.external_prefix_cache_hits_host),
            n(r.external_prefix_cache_hits_peer)
        ),
        (
            source("external_host_cache_hit"),
            source("external_kv_transfer")
        )
    );
    assert_eq!(
        n(r.generation_tokens),
        m.value("vllm:generation_tokens_total", &[])
    );
    assert_eq!(n(r.preemptions), m.value("vllm:num_preemptions_total", &[]));
    for reason in ["stop", "length", "abort"] {
        let at = m.value("vllm:request_success_total", &[("finished_reason", reason)]);
        assert_eq!(n(r.requests_finished[reason]), at, "{reason}");
    }
    assert_eq!(
        n(r.kv_transfer_bytes),
        m.value("pd_node_kv_transfer_bytes_total", &[])
    );
    assert_eq!(
        n(r.kv_transfers),
        m.value("pd_node_kv_transfer_seconds_count", &[])
    );
    for (reason, count) in &r.kv_transfer_failures {
        let at = m.value("pd_node_kv_transfer_failures_total", &[("reason", reason)]);
        assert_eq!(n(*count), at, "{reason}");
    }
    assert_eq!(
        n(r.kv_leases_expired),
        m.value("pd_node_kv_leases_expired_total", &[])
    );
    assert_eq!(n(r.epoch), m.value("pd_node_epoch", &[]));
}

/// Every sample carries vLLM's labels first, in vLLM's order, then `role`; our own families
/// carry `model_name` and `role`.
fn assert_labels(m: &Exposition, role: &str) {
    for s in &m.samples {
        let names: Vec<&str> = s.labels.iter().map(|(k, _)| k.as_str()).collect();
        if s.name.starts_with("vllm:") {
            assert_eq!(names[..3], ["model_name", "engine", "role"], "{s:?}");
            assert_eq!(s.label("engine"), Some("0"));
        } else {
            assert!(s.name.starts_with("pd_node_"), "{s:?}");
            assert_eq!(names[..2], ["model_name", "role"], "{s:?}");
        }
        assert_eq!(s.label("model_name"), Some(MODEL));
        assert_eq!(s.label("role"), Some(role));
        let extra = &names[if s.name.starts_with("vllm:") { 3 } else { 2 }..];
        if s.name == "vllm:cache_config_info" {
            // vLLM's CacheConfig fields, one label each.
            assert_eq!(
                extra,
                [
                    "block_size",
                    "cache_dtype",
                    "enable_prefix_caching",
                    "num_gpu_blocks",
                    "num_cpu_blocks"
                ],
                "{s:?}"
            );
            continue;
        }
        assert!(
            extra.len() <= 1
                && extra.iter().all(|l| [
                    "finished_reason",
                    "source",
                    "reason",
                    "landing",
                    "layout",
                    "le"
                ]
                .contains(l)),
            "{s:?}"
        );
    }
}

const VLLM_FAMILIES: [(&str, &str); 24] = [
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:cache_config_info", "gauge"),
    ("vllm:prefix_cache_queries_total", "counter"),
    ("vllm:prefix_cache_hits_total", "counter"),
    ("vllm:external_prefix_cache_queries_total", "counter"),
    ("vllm:external_prefix_cache_hits_total", "counter"),
    ("vllm:num_preemptions_total", "counter"),
    ("vllm:prompt_tokens_total", "counter"),
    ("vllm:prompt_tokens_by_source_total", "counter"),
    ("vllm:generation_tokens_total", "counter"),
    ("vllm:request_success_total", "counter"),
    ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"),
    ("vllm:iteration_tokens_total", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefill_node_counts_a_miss_a_local_hit_and_no_lookup_exactly() {
    let p = prefill_node(&[]).await;
    let m = p.metrics().await;
    for (name, kind) in VLLM_FAMILIES {
        assert_eq!(m.families[name].kind, kind, "{name}");
    }
    for (name, kind) in [
        ("pd_node_kv_transfer_bytes_total", "counter"),
        ("pd_node_kv_transfer_seconds", "histogram"),
        ("pd_node_kv_transfer_failures_total", "counter"),
        ("pd_node_kv_leases_expired_total", "counter"),
        ("pd_node_kv_imports_total", "counter"),
        ("pd_node_kv_rdma_offers_total", "counter"),
        ("pd_node_epoch", "gauge"),
    ] {
        assert_eq!(m.families[name].kind, kind, "{name}");
    }
    // Nothing else under vLLM's prefix (dashboards key on it); our own under pd_node_.
    for name in m.families.keys() {
        assert!(
            VLLM_FAMILIES.iter().any(|(n, _)| n == name) || name.starts_with("pd_node_"),
            "{name}"
        );
    }
    assert_labels(&m, "prefill");
    // The KV cache's configuration, as vLLM exposes it: f32 (`auto` on the CPU), prefix
    // caching on, no host tier.
    let info = [
        ("cache_dtype", "float32"),
        ("enable_prefix_caching", "True"),
        ("num_cpu_blocks", "0"),
    ];
    assert_eq!(m.value("vllm:cache_config_info", &info), 1.0);
    assert_eq!(prefix(&m), (0.0, 0.0, 0.0, 0.0));
    // vLLM's buckets, written as vLLM writes them.
    let ttft = [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
        "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0",
        "+Inf",
    ];
    assert_eq!(m.les("vllm:time_to_first_token_seconds"), ttft);
    let latency = [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0",
        "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ];
    assert_eq!(m.les("vllm:e2e_request_latency_seconds"), latency);
    assert_eq!(m.les("vllm:request_decode_time_seconds"), latency);
    let itl = m.les("vllm:inter_token_latency_seconds");
    assert_eq!((itl[0].as_str(), itl[11].as_str()), ("0.01", "1.0"));
    // Token counts in 1-2-5 steps up to the context (synthetic:tiny: 4,096 tokens).
    let tokens = [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
        "+Inf",
    ];
    assert_eq!(m.les("vllm:request_prompt_tokens"), tokens);
    assert_eq!(m.les("vllm:request_params_max_tokens"), tokens);
    let iteration = m.les("vllm:iteration_tokens_total");
    assert_eq!(
        (iteration[1].as_str(), iteration[12].as_str()),
        ("8.0", "16384.0")
    );

    // Cold miss: 40 tokens looked up, none found.
    let a = prompt(40, 1);
    let r = prefill(&p, "a1", &a, false).await;
    release(&p, &r).await;
    let m = p.metrics().await;
    assert_eq!(prefix(&m), (40.0, 0.0, 40.0, 0.0));
    assert_eq!(by_source(&m), (40.0, 0.0, 0.0));
    let report = r
        .counters
        .expect("the prefill response carries the counters");
    assert_eq!(
        (report.prefix_cache_queries, report.prefix_cache_hits),
        (40, 0)
    );
    assert_eq!(finished(&m), 1.0);

    // The same prompt again: two whole blocks (32 tokens) hit locally; the last token is
    // never covered.
    let r = prefill(&p, "a2", &a, false).await;
    release(&p, &r).await;
    assert_eq!(
        r.usage.as_ref().unwrap().local_cached_tokens as usize,
        2 * BLOCK
    );
    let m = p.metrics().await;
    assert_eq!(prefix(&m), (80.0, 32.0, 48.0, 0.0));
    assert_eq!(by_source(&m), (48.0, 32.0, 0.0));
    assert_eq!(r.counters.as_ref().unwrap().prefix_cache_hits, 32);

    // Prompt logprobs need every position computed: no lookup, nothing counted but the
    // prompt.
    let r = prefill(&p, "b1", &prompt(40, 2), true).await;
    release(&p, &r).await;
    let m = p.metrics().await;
    assert_eq!(prefix(&m), (80.0, 32.0, 48.0, 0.0));
    assert_eq!(by_source(&m), (88.0, 32.0, 0.0));
    assert_eq!(m.value("vllm:prompt_tokens_total", &[]), 120.0);
    assert_eq!(finished(&m), 3.0);
    // One first token per request; every end recorded in the histograms.
    assert_eq!(m.value("vllm:generation_tokens_total", &[]), 3.0);
    assert_eq!(m.value("vllm:time_to_first_token_seconds_count", &[]), 3.0);
    assert_eq!(m.value("vllm:e2e_request_latency_seconds_count", &[]), 3.0);
    assert_eq!(m.value("vllm:request_queue_time_seconds_count", &[]), 3.0);
    assert_eq!(
        m.value("vllm:request_inference_time_seconds_count", &[]),
        3.0
    );
    // Per request: 40 prompt tokens, one token sampled, max_tokens 1 (a prefill node's).
    let count_sum = |name: &str| {
        (
            m.value(&format!("{name}_count"), &[]),
            m.value(&format!("{name}_sum"), &[]),
        )
    };
    assert_eq!(count_sum("vllm:request_prompt_tokens"), (3.0, 120.0));
    assert_eq!(
        m.value("vllm:request_prompt_tokens_bucket", &[("le", "50.0")]),
        3.0
    );
    assert_eq!(count_sum("vllm:request_generation_tokens"), (3.0, 3.0));
    assert_eq!(count_sum("vllm:request_params_max_tokens"), (3.0, 3.0));
    // One step per prompt, computing what the cache did not hold: 40 + 8 + 40.
    assert_eq!(count_sum("vllm:iteration_tokens_total"), (3.0, 88.0));

    // Idle: Info's report equals the scrape, its epoch is the gauge's.
    p.assert_all_blocks_free().await;
    let info = p.info().await;
    let m = p.metrics().await;
    let report = info.counters.expect("Info carries the counters");
    assert_ne!(report.epoch, 0);
    assert_report_matches(&report, &m);
    assert_eq!(m.value("vllm:num_requests_running", &[]), 0.0);
    assert_eq!(m.value("vllm:kv_cache_usage_perc", &[]), 0.0);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_node_counts_received_kv_as_external_hits_and_transfers_on_both_nodes() {
    let p = prefill_node(&[]).await;
    let d = decode_node(&[]).await;
    d.set_kv_peers(&[&p]).await;
    assert_labels(&d.metrics().await, "decode");

    // Cold on both nodes: the decode node receives the whole prompt (3 blocks).
    let a = prompt(40, 3);
    let messages = generate(&p, &d, "a1", &a).await;
    let (last, rest) = messages.split_last().unwrap();
    assert!(
        rest.iter().all(|m| m.counters.is_none()),
        "counters only at the end"
    );
    let report = last
        .counters
        .as_ref()
        .expect("the last message carries the counters");
    let m = d.metrics().await;
    assert_eq!(prefix(&m), (40.0, 0.0, 40.0, 40.0));
    assert_eq!(by_source(&m), (0.0, 0.0, 40.0));
    let generated: usize = messages.iter().map(|m| m.tokens.len()).sum();
    assert_eq!(
        generated, 3,
        "max_tokens 4, the first came from the prefill node"
    );
    assert_eq!(
        m.value("vllm:generation_tokens_total", &[]),
        generated as f64
    );
    assert_eq!(report.external_prefix_cache_hits, 40);
    assert_eq!(
        (
            report.external_prefix_cache_hits_host,
            report.external_prefix_cache_hits_peer
        ),
        (0, 40),
        "the prompt's KV came from the prefill node: a peer"
    );
    assert_eq!(report.generation_tokens, 3);
    assert_eq!(m.value("vllm:inter_token_latency_seconds_count", &[]), 2.0);
    // Three steps of one token each; the request's 3 tokens sampled here of its 4 (the
    // first is the prefill node's), max_tokens 4.
    let count_sum = |name: &str| {
        (
            m.value(&format!("{name}_count"), &[]),
            m.value(&format!("{name}_sum"), &[]),
        )
    };
    assert_eq!(count_sum("vllm:iteration_tokens_total"), (3.0, 3.0));
    assert_eq!(count_sum("vllm:request_generation_tokens"), (1.0, 3.0));
    assert_eq!(count_sum("vllm:request_params_max_tokens"), (1.0, 4.0));
    assert_eq!(count_sum("vllm:request_prompt_tokens"), (1.0, 40.0));

    let block_bytes = |r: &pb::CounterReport, blocks: u64| {
        assert_eq!(r.kv_transfer_bytes % blocks, 0);
        r.kv_transfer_bytes / blocks
    };
    let per_block = block_bytes(report, 3);
    assert!(per_block > 0);
    assert_eq!(
        m.value("pd_node_kv_transfer_bytes_total", &[]),
        (3 * per_block) as f64
    );
    assert_eq!(m.value("pd_node_kv_transfer_seconds_count", &[]), 1.0);
    // The prefill node served the same bytes.
    p.eventually(
        "pd_node_kv_transfer_bytes_total",
        &[],
        (3 * per_block) as f64,
    )
    .await;

    // The same prompt again: the decode node has two blocks itself (local hits) and pulls
    // only the last one (external).
    generate(&p, &d, "a2", &a).await;
    let m = d.metrics().await;
    assert_eq!(prefix(&m), (80.0, 32.0, 48.0, 48.0));
    assert_eq!(by_source(&m), (0.0, 32.0, 48.0));
    assert_eq!(
        m.value("pd_node_kv_transfer_bytes_total", &[]),
        (4 * per_block) as f64
    );
    // Host-memory KV: both imports landed in place in reserved blocks.
    assert_eq!(
        m.value("pd_node_kv_imports_total", &[("landing", "in_place")]),
        2.0
    );
    assert_eq!(
        m.value("pd_node_kv_imports_total", &[("landing", "buffers")]),
        0.0
    );

    // A lease released before the decode node pulls: a failure on both nodes, by reason.
    let b = prompt(40, 4);
    let r = prefill(&p, "b1", &b, false).await;
    release(&p, &r).await;
    let err = d
        .decode()
        .await
        .decode(decode_request("b1", &b, &r))
        .await
        .expect_err("the lease is gone");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    let gone = [("reason", "lease_gone")];
    let m = d.metrics().await;
    assert_eq!(m.value("pd_node_kv_transfer_failures_total", &gone), 1.0);
    assert_eq!(
        m.value(
            "pd_node_kv_transfer_failures_total",
            &[("reason", "timeout")]
        ),
        0.0
    );
    p.eventually("pd_node_kv_transfer_failures_total", &gone, 1.0)
        .await;
    p.eventually(
        "pd_node_kv_transfer_bytes_total",
        &[],
        (4 * per_block) as f64,
    )
    .await;

    // A client that goes away mid-stream: the request ends as an abort on the decode node,
    // and its end still reaches the latency histograms.
    let before = d.metrics().await;
    let abort = [("finished_reason", "abort")];
    let e2e = "vllm:e2e_request_latency_seconds_count";
    let c = prompt(40, 5);
    let r = prefill(&p, "c1", &c, false).await;
    let mut req = decode_request("c1", &c, &r);
    req.max_tokens = 3000;
    let mut stream = d.decode().await.decode(req).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some(), "a first message");
    drop(stream);
    release(&p, &r).await;
    d.assert_all_blocks_free().await;
    let m = d.metrics().await;
    assert_eq!(
        m.value("vllm:request_success_total", &abort),
        before.value("vllm:request_success_total", &abort) + 1.0
    );
    assert_eq!(m.value(e2e, &[]), before.value(e2e, &[]) + 1.0);
    assert_eq!(prefix(&m).0, 120.0, "its lookup counted once");

    // Reports equal the scrapes; each node has its own epoch.
    d.assert_all_blocks_free().await;
    p.assert_all_blocks_free().await;
    let (di, pi) = (d.info().await, p.info().await);
    assert_report_matches(di.counters.as_ref().unwrap(), &d.metrics().await);
    assert_report_matches(pi.counters.as_ref().unwrap(), &p.metrics().await);
    assert_eq!(di.counters.as_ref().unwrap().epoch, report.epoch);
    assert_ne!(di.counters.unwrap().epoch, pi.counters.unwrap().epoch);
    d.stop().await;
    p.stop().await;
}
