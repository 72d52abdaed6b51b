//! The benchmark's report: built from the run's records and the router's counters, written as
//! versioned JSON (`schema` + `schema_version`; a change that breaks readers bumps the
//! version) and printed as a table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::args::Slo;
use super::client::RequestRecord;
use super::driver::{CounterSample, RunOutput};
use super::scrape::{CacheCounters, CacheTier, HitsQueries, KvTransfers, Prediction};
use super::stats::Distribution;

pub const SCHEMA: &str = "pdctl-bench";
pub const SCHEMA_VERSION: u32 = 1;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn grpc() -> String {
    "grpc".into()
}

/// What was run (echoed so a report explains itself).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunConfig {
    pub router: String,
    /// The API the requests went through: `grpc` or `openai` (reports from before it say
    /// nothing: gRPC).
    #[serde(default = "grpc")]
    pub backend: String,
    pub model: String,
    pub workload: String,
    pub dataset: Option<String>,
    pub seed: u64,
    /// The workload's shape in words (lengths, prefixes).
    pub shape: String,
    pub request_rate: String,
    pub max_concurrency: Option<u64>,
    pub num_prompts: Option<u64>,
    pub duration_s: Option<f64>,
    pub warmup: u64,
    /// `--up`: the cluster that was started (`1P+1D prefix-aware`), otherwise None.
    pub cluster: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Goodput {
    pub objectives: Vec<Slo>,
    pub good_requests: usize,
    /// Good requests per second of the window.
    pub request_goodput: f64,
}

/// Cached tokens as the clients saw them in usage (the prefill computation saved).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsageCache {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub local_cached_tokens: u64,
    pub external_cached_tokens: u64,
    pub cached_ratio: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub requests_sent: usize,
    pub successful: usize,
    pub failed: usize,
    /// Failed requests by outcome: a gRPC code in snake case, `abort` or `incomplete`.
    pub failed_by_outcome: BTreeMap<String, usize>,
    /// Successful requests by finish reason.
    pub finish_reasons: BTreeMap<String, usize>,
    pub warmup_failures: usize,
    pub duration_s: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub request_throughput: f64,
    pub input_token_throughput: f64,
    pub output_token_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2el_ms: Distribution,
    pub goodput: Option<Goodput>,
    pub usage_cache: UsageCache,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheWindow {
    pub hits: f64,
    pub queries: f64,
    pub hit_rate: Option<f64>,
}

impl From<HitsQueries> for CacheWindow {
    fn from(v: HitsQueries) -> Self {
        Self {
            hits: v.hits,
            queries: v.queries,
            hit_rate: v.rate(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoleCache {
    pub role: String,
    pub cache: String,
    #[serde(flatten)]
    pub window: CacheWindow,
}

/// The router's prefix-cache counters over exactly the benchmark's window (their change, not
/// their lifetime totals).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouterCache {
    pub metrics_url: String,
    /// All roles together, per cache (`cache="local"` / `cache="external"`).
    pub local: CacheWindow,
    pub external: CacheWindow,
    pub by_role: Vec<RoleCache>,
    /// Cross-check: the prefill role's hits (local + external) against the cached tokens the
    /// clients saw in usage; equal when every request of the window succeeded.
    pub prefill_hits: f64,
    pub usage_cached_tokens: u64,
}

/// The KV the decode nodes pulled over the benchmark's window (from the router's
/// `pd_router_kv_transfer_*{role="decode"}`): what disaggregation moved between nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KvTransferWindow {
    pub bytes: f64,
    pub transfers: f64,
    /// Summed duration of the transfers.
    pub seconds: f64,
    pub mean_bytes_per_transfer: Option<f64>,
    pub mean_transfer_ms: Option<f64>,
    /// bytes / seconds: the transfers' own rate, not the window's.
    pub gb_per_s: Option<f64>,
}

impl From<KvTransfers> for KvTransferWindow {
    fn from(k: KvTransfers) -> Self {
        let per = |x: f64| (k.transfers > 0.0).then(|| x / k.transfers);
        Self {
            bytes: k.bytes,
            transfers: k.transfers,
            seconds: k.seconds,
            mean_bytes_per_transfer: per(k.bytes),
            mean_transfer_ms: per(k.seconds * 1e3),
            gb_per_s: (k.seconds > 0.0).then(|| k.bytes / k.seconds / 1e9),
        }
    }
}

/// How well the router's cache index predicted the nodes' prefix hits over the benchmark's
/// window (`pd_router_prefix_{predicted,delivered}_tokens_total`, all nodes and roles, the
/// tiers the index predicts: device and host; a peer's KV is a transfer, not a prediction).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PredictionWindow {
    pub predicted_tokens: f64,
    pub delivered_tokens: f64,
    /// predicted / delivered (1: the router routed on what the caches held); None when no
    /// request of the window had a prediction.
    pub ratio: Option<f64>,
}

impl From<Prediction> for PredictionWindow {
    fn from(p: Prediction) -> Self {
        Self {
            predicted_tokens: p.predicted,
            delivered_tokens: p.delivered,
            ratio: p.ratio(),
        }
    }
}

/// Where the router computed the window's prompts (`pd_router_disagg_decisions_total`):
/// requests by path (remote: a prefill node, the KV then moved; local: the decode node) and
/// by `path/reason`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DisaggWindow {
    pub remote: f64,
    pub local: f64,
    pub by_reason: BTreeMap<String, f64>,
}

impl From<&BTreeMap<(String, String), f64>> for DisaggWindow {
    fn from(decisions: &BTreeMap<(String, String), f64>) -> Self {
        let mut w = DisaggWindow::default();
        for ((path, reason), n) in decisions {
            match path.as_str() {
                "local" => w.local += n,
                _ => w.remote += n,
            }
            if *n > 0.0 {
                w.by_reason.insert(format!("{path}/{reason}"), *n);
            }
        }
        w
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// End of the bucket, seconds into the window.
    pub t_s: f64,
    pub completed: usize,
    /// Output tokens that arrived in the bucket, per second.
    pub output_token_throughput: f64,
    /// Usage of the requests that finished in the bucket.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouterPoint {
    pub t_s: f64,
    pub local_hit_rate: Option<f64>,
    pub external_hit_rate: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestRow {
    pub session: usize,
    pub turn: usize,
    pub start_ms: f64,
    pub outcome: String,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: f64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    pub local_cached_tokens: u32,
    pub external_cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub schema_version: u32,
    pub label: Option<String>,
    pub pdctl_version: String,
    pub started_at_unix_s: f64,
    pub config: RunConfig,
    pub summary: Summary,
    pub router_prefix_cache: Option<RouterCache>,
    /// Absent in reports of older pdctl versions, and without `--router-metrics`.
    #[serde(default)]
    pub router_kv_transfer: Option<KvTransferWindow>,
    /// Absent in reports of older pdctl versions, and without `--router-metrics`.
    #[serde(default)]
    pub router_prefix_prediction: Option<PredictionWindow>,
    /// Absent in reports of older pdctl versions, and without `--router-metrics`.
    #[serde(default)]
    pub router_disagg: Option<DisaggWindow>,
    pub timeline: Vec<TimelinePoint>,
    pub router_timeline: Vec<RouterPoint>,
    pub requests: Vec<RequestRow>,
}

fn is_good(r: &RequestRecord, objectives: &[Slo]) -> bool {
    r.outcome.is_success()
        && objectives.iter().all(|slo| match *slo {
            Slo::Ttft(max) => r.ttft.is_some_and(|t| ms(t) <= max),
            // One token has no time per output token: nothing to miss.
            Slo::Tpot(max) => r.tpot().is_none_or(|t| ms(t) <= max),
            Slo::E2el(max) => ms(r.e2e) <= max,
        })
}

fn summary(out: &RunOutput, objectives: &[Slo]) -> Summary {
    let ok: Vec<&RequestRecord> = out
        .records
        .iter()
        .filter(|r| r.outcome.is_success())
        .collect();
    let mut failed_by_outcome = BTreeMap::new();
    let mut finish_reasons = BTreeMap::new();
    for r in &out.records {
        let map = if r.outcome.is_success() {
            &mut finish_reasons
        } else {
            &mut failed_by_outcome
        };
        *map.entry(r.outcome.name()).or_insert(0) += 1;
    }
    let secs = out.duration.as_secs_f64();
    let per_s = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
    let input: u64 = ok.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    let output: u64 = ok.iter().map(|r| u64::from(r.completion_tokens)).sum();
    let sum = |f: fn(&RequestRecord) -> u32| ok.iter().map(|r| u64::from(f(r))).sum::<u64>();
    let cached = sum(|r| r.cached_tokens);
    let goodput = (!objectives.is_empty()).then(|| {
        let good = ok.iter().filter(|r| is_good(r, objectives)).count();
        Goodput {
            objectives: objectives.to_vec(),
            good_requests: good,
            request_goodput: per_s(good as f64),
        }
    });
    Summary {
        requests_sent: out.records.len(),
        successful: ok.len(),
        failed: out.records.len() - ok.len(),
        failed_by_outcome,
        finish_reasons,
        warmup_failures: out.warmup_failures,
        duration_s: secs,
        total_input_tokens: input,
        total_output_tokens: output,
        request_throughput: per_s(ok.len() as f64),
        input_token_throughput: per_s(input as f64),
        output_token_throughput: per_s(output as f64),
        total_token_throughput: per_s((input + output) as f64),
        ttft_ms: Distribution::of(ok.iter().filter_map(|r| r.ttft.map(ms))),
        tpot_ms: Distribution::of(ok.iter().filter_map(|r| r.tpot().map(ms))),
        itl_ms: Distribution::of(ok.iter().flat_map(|r| r.itl.iter().map(|d| ms(*d)))),
        e2el_ms: Distribution::of(ok.iter().map(|r| ms(r.e2e))),
        goodput,
        usage_cache: UsageCache {
            prompt_tokens: input,
            cached_tokens: cached,
            local_cached_tokens: sum(|r| r.local_cached_tokens),
            external_cached_tokens: sum(|r| r.external_cached_tokens),
            cached_ratio: (input > 0).then(|| cached as f64 / input as f64),
        },
    }
}

fn router_cache(url: &str, delta: &CacheCounters, usage_cached: u64) -> RouterCache {
    let tier = |c: CacheTier| match c {
        CacheTier::Local => "local",
        CacheTier::External => "external",
    };
    RouterCache {
        metrics_url: url.to_string(),
        local: delta.total(CacheTier::Local).into(),
        external: delta.total(CacheTier::External).into(),
        by_role: delta
            .by_role
            .iter()
            .map(|((role, cache), v)| RoleCache {
                role: role.clone(),
                cache: tier(*cache).into(),
                window: (*v).into(),
            })
            .collect(),
        prefill_hits: delta.get("prefill", CacheTier::Local).hits
            + delta.get("prefill", CacheTier::External).hits,
        usage_cached_tokens: usage_cached,
    }
}

/// Bucket width for the timelines: about 40 points over the window, at least 100 ms.
fn bucket_width(duration: Duration) -> f64 {
    (duration.as_secs_f64() / 40.0).max(0.1)
}

fn timeline(out: &RunOutput) -> Vec<TimelinePoint> {
    let width = bucket_width(out.duration);
    let n = ((out.duration.as_secs_f64() / width).ceil() as usize).max(1);
    let mut points: Vec<TimelinePoint> = (0..n)
        .map(|i| TimelinePoint {
            t_s: (i + 1) as f64 * width,
            completed: 0,
            output_token_throughput: 0.0,
            prompt_tokens: 0,
            cached_tokens: 0,
        })
        .collect();
    let bucket = |t: f64| ((t / width) as usize).min(n - 1);
    for r in out.records.iter().filter(|r| r.outcome.is_success()) {
        let end = bucket((r.start + r.e2e).as_secs_f64());
        points[end].completed += 1;
        points[end].prompt_tokens += u64::from(r.prompt_tokens);
        points[end].cached_tokens += u64::from(r.cached_tokens);
        // Token arrival times: the first token, then one chunk per gap. Chunks carry the
        // request's tokens evenly when there are fewer chunks than tokens.
        if let Some(ttft) = r.ttft {
            let chunks = r.itl.len() + 1;
            let per_chunk = f64::from(r.completion_tokens) / chunks as f64;
            let mut at = r.start + ttft;
            points[bucket(at.as_secs_f64())].output_token_throughput += per_chunk;
            for gap in &r.itl {
                at += *gap;
                points[bucket(at.as_secs_f64())].output_token_throughput += per_chunk;
            }
        }
    }
    for p in &mut points {
        p.output_token_throughput /= width;
    }
    points
}

fn router_timeline(samples: &[CounterSample]) -> Vec<RouterPoint> {
    samples
        .windows(2)
        .filter(|w| w[1].at > w[0].at)
        .map(|w| {
            let d = w[1].counters.since(&w[0].counters);
            RouterPoint {
                t_s: w[1].at.as_secs_f64(),
                local_hit_rate: d.total(CacheTier::Local).rate(),
                external_hit_rate: d.total(CacheTier::External).rate(),
            }
        })
        .collect()
}

fn row(r: &RequestRecord) -> RequestRow {
    RequestRow {
        session: r.session,
        turn: r.turn,
        start_ms: ms(r.start),
        outcome: r.outcome.name(),
        error: match &r.outcome {
            super::client::Outcome::Failed { message, .. } => Some(message.clone()),
            _ => None,
        },
        ttft_ms: r.ttft.map(ms),
        tpot_ms: r.tpot().map(ms),
        e2el_ms: ms(r.e2e),
        prompt_tokens: r.prompt_tokens,
        completion_tokens: r.completion_tokens,
        cached_tokens: r.cached_tokens,
        local_cached_tokens: r.local_cached_tokens,
        external_cached_tokens: r.external_cached_tokens,
    }
}

pub fn build(
    out: &RunOutput,
    config: RunConfig,
    label: Option<String>,
    objectives: &[Slo],
    metrics_url: Option<&str>,
) -> Report {
    let summary = summary(out, objectives);
    let router_prefix_cache = match (&out.counters, metrics_url) {
        (Some((before, after)), Some(url)) => Some(router_cache(
            url,
            &after.since(before),
            summary.usage_cache.cached_tokens,
        )),
        _ => None,
    };
    let router_kv_transfer = match (&out.counters, metrics_url) {
        (Some((before, after)), Some(_)) => Some(after.since(before).kv.into()),
        _ => None,
    };
    let router_prefix_prediction = match (&out.counters, metrics_url) {
        (Some((before, after)), Some(_)) => Some(after.since(before).prediction.into()),
        _ => None,
    };
    let router_disagg = match (&out.counters, metrics_url) {
        (Some((before, after)), Some(_)) => Some((&after.since(before).decisions).into()),
        _ => None,
    };
    let mut records: Vec<&RequestRecord> = out.records.iter().collect();
    records.sort_by_key(|r| (r.start, r.session, r.turn));
    Report {
        schema: SCHEMA.into(),
        schema_version: SCHEMA_VERSION,
        label,
        pdctl_version: env!("CARGO_PKG_VERSION").into(),
        started_at_unix_s: out
            .started_at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
        config,
        router_prefix_cache,
        router_kv_transfer,
        router_prefix_prediction,
        router_disagg,
        timeline: timeline(out),
        router_timeline: router_timeline(&out.samples),
        requests: records.into_iter().map(row).collect(),
        summary,
    }
}

fn rate(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |r| format!("{:.2} %", r * 100.0))
}

/// The terminal table.
pub fn table(report: &Report) -> String {
    let s = &report.summary;
    let mut t = String::new();
    let mut line = |k: &str, v: String| {
        let _ = if v.is_empty() {
            writeln!(t, "{k}")
        } else {
            writeln!(t, "{k:<44}{v:>16}")
        };
    };
    let title = match &report.label {
        Some(l) => format!(" Serving benchmark: {l} "),
        None => " Serving benchmark ".into(),
    };
    let mut head = format!("{title:=^60}\n");
    let _ = writeln!(
        head,
        "{} on {} via {}  ({}, rate {}, concurrency {})",
        report.config.workload,
        report.config.model,
        report.config.backend,
        report.config.shape,
        report.config.request_rate,
        report
            .config
            .max_concurrency
            .map_or("unlimited".into(), |c| c.to_string())
    );
    line("Successful requests:", s.successful.to_string());
    line("Failed requests:", s.failed.to_string());
    for (outcome, n) in &s.failed_by_outcome {
        line(&format!("  {outcome}:"), n.to_string());
    }
    line("Benchmark duration (s):", format!("{:.2}", s.duration_s));
    line("Total input tokens:", s.total_input_tokens.to_string());
    line("Total generated tokens:", s.total_output_tokens.to_string());
    line(
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    );
    if let Some(g) = &s.goodput {
        line(
            "Request goodput (req/s):",
            format!("{:.2}", g.request_goodput),
        );
    }
    line(
        "Input token throughput (tok/s):",
        format!("{:.2}", s.input_token_throughput),
    );
    line(
        "Output token throughput (tok/s):",
        format!("{:.2}", s.output_token_throughput),
    );
    line(
        "Total token throughput (tok/s):",
        format!("{:.2}", s.total_token_throughput),
    );
    for (name, d) in [
        ("Time to First Token", &s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", &s.tpot_ms),
        ("Inter-token Latency", &s.itl_ms),
        ("End-to-end Latency", &s.e2el_ms),
    ] {
        line(&format!("{:-^60}", name), String::new());
        line("  Mean (ms):", format!("{:.2}", d.mean));
        line("  Median (ms):", format!("{:.2}", d.median));
        line("  P90 (ms):", format!("{:.2}", d.p90));
        line("  P99 (ms):", format!("{:.2}", d.p99));
    }
    line(&format!("{:-^60}", "Prefix cache"), String::new());
    line(
        "Cached tokens in usage:",
        format!(
            "{} ({})",
            s.usage_cache.cached_tokens,
            rate(s.usage_cache.cached_ratio)
        ),
    );
    match &report.router_prefix_cache {
        Some(c) => {
            line("Router local hit rate (window):", rate(c.local.hit_rate));
            line(
                "Router external hit rate (window):",
                rate(c.external.hit_rate),
            );
            for r in &c.by_role {
                line(
                    &format!(
                        "  {} {}: {:.0}/{:.0} tokens",
                        r.role, r.cache, r.window.hits, r.window.queries
                    ),
                    rate(r.window.hit_rate),
                );
            }
        }
        None => line("Router hit rates:", "n/a (no --router-metrics)".into()),
    }
    if let Some(p) = &report.router_prefix_prediction {
        line(
            "Prefix predicted / delivered (window):",
            match p.ratio {
                Some(r) => format!(
                    "{r:.2} ({:.0}/{:.0} tokens)",
                    p.predicted_tokens, p.delivered_tokens
                ),
                None => "n/a (no request routed on cache events)".into(),
            },
        );
    }
    if let Some(d) = &report.router_disagg {
        let reasons: Vec<String> = (d.by_reason.iter())
            .map(|(k, n)| format!("{k} {n:.0}"))
            .collect();
        line(
            "Prompts computed remote / local:",
            format!("{:.0} / {:.0} ({})", d.remote, d.local, reasons.join(", ")),
        );
    }
    if let Some(kv) = &report.router_kv_transfer {
        line(
            &format!("{:-^60}", "KV transfer (decode nodes)"),
            String::new(),
        );
        line(
            "Pulled (MB):",
            format!("{:.1} in {:.0} transfers", kv.bytes / 1e6, kv.transfers),
        );
        let opt = |v: Option<f64>, unit: &str| v.map_or("n/a".into(), |v| format!("{v:.2}{unit}"));
        line(
            "Per transfer (MB):",
            opt(kv.mean_bytes_per_transfer.map(|b| b / 1e6), ""),
        );
        line("Mean transfer time (ms):", opt(kv.mean_transfer_ms, ""));
        line("Transfer rate (GB/s):", opt(kv.gb_per_s, ""));
    }
    head.push_str(&t);
    head.push_str(&"=".repeat(60));
    head.push('\n');
    head
}
