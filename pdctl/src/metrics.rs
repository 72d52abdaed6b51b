//! `pdctl metrics`: a live terminal summary of a cluster from its router's `/metrics`.
//!
//! Every `--interval` seconds it scrapes the router (`pd_router_*`, parsed with
//! `prometheus-parse`) and prints: requests per second by outcome and in flight; prompt and
//! generated tokens per second; time to first token and inter-token latency p50 / p99,
//! estimated from the histograms as Prometheus's `histogram_quantile` does (linear inside a
//! bucket); and per role and node: health, running / waiting, KV usage, and the local and
//! external prefix-cache hit rates over the last interval and over the router's lifetime.
//! `--once` prints one summary (lifetime figures) and exits; `--json` prints each summary as
//! one JSON object instead of a table.

use std::collections::BTreeMap;
use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use pd_router::metrics::ids::name;
use prometheus_parse::{Scrape, Value};
use serde::Serialize;

use crate::bench::scrape::MetricsEndpoint;

#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// The router's metrics address: HOST:PORT (`router_metrics` in `pdctl up`'s ready line)
    /// or http://HOST:PORT/metrics.
    #[arg(long, env = "PD_ROUTER_METRICS", value_name = "ADDR")]
    router_metrics: String,
    /// Accepted so that one `PD_API_KEY` serves every pdctl command; the metrics port needs
    /// no key (it is monitoring's, not clients').
    #[arg(long, env = "PD_API_KEY", hide_env_values = true)]
    #[allow(dead_code)]
    api_key: Option<String>,
    /// Seconds between two refreshes.
    #[arg(long, default_value_t = 2.0, value_parser = parse_interval)]
    interval: f64,
    /// Print one summary (lifetime figures) and exit.
    #[arg(long)]
    once: bool,
    /// Print each summary as one JSON object (one line) instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ca: crate::tls::CaArgs,
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.1 => Ok(v),
        _ => Err(format!("`{s}` is not a number of seconds ≥ 0.1")),
    }
}

pub fn run(args: MetricsArgs) -> anyhow::Result<()> {
    let url = MetricsEndpoint::parse(&args.router_metrics)?
        .with_tls(args.ca.client(pd_tls::Alpn::Http1)?);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let mut previous: Option<(Instant, Snapshot)> = None;
        loop {
            let text = url.fetch().await?;
            let now = Instant::now();
            let snapshot = Snapshot::parse(&text)
                .with_context(|| format!("{} is not the router's /metrics", url.url()))?;
            let window = previous
                .as_ref()
                .map(|(at, before)| (now.duration_since(*at).as_secs_f64(), before));
            let summary = Summary::new(url.url(), &snapshot, window);
            let mut out = std::io::stdout().lock();
            if args.json {
                writeln!(out, "{}", serde_json::to_string(&summary)?)?;
            } else {
                if !args.once && out.is_terminal() {
                    // Clear the screen and go home: a live view, not a scrolling log.
                    write!(out, "\x1b[2J\x1b[H")?;
                }
                writeln!(out, "{}", summary.table())?;
            }
            out.flush()?;
            drop(out);
            if args.once {
                return Ok(());
            }
            previous = Some((now, snapshot));
            tokio::time::sleep(Duration::from_secs_f64(args.interval)).await;
        }
    })
}

/// Tokens looked up and found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
struct HitsQueries {
    hits: f64,
    queries: f64,
}

impl HitsQueries {
    fn rate(self) -> Option<f64> {
        (self.queries > 0.0).then(|| self.hits / self.queries)
    }

    fn since(self, before: HitsQueries) -> HitsQueries {
        HitsQueries {
            hits: increase(self.hits, before.hits),
            queries: increase(self.queries, before.queries),
        }
    }
}

/// A counter's increase; a counter that went down was reset (a restarted router).
fn increase(now: f64, before: f64) -> f64 {
    if now >= before { now - before } else { now }
}

/// One node as the router sees it.
#[derive(Debug, Clone, Default)]
struct NodeStats {
    up: Option<bool>,
    running: f64,
    waiting: f64,
    kv_usage: f64,
    local: HitsQueries,
    external: HitsQueries,
    prompt_tokens: f64,
    generation_tokens: f64,
}

/// One scrape of the router.
#[derive(Debug, Clone, Default)]
struct Snapshot {
    /// By (role, node address).
    nodes: BTreeMap<(String, String), NodeStats>,
    outcomes: BTreeMap<String, f64>,
    in_flight: f64,
    /// Cumulative bucket counts by upper bound, summed over models.
    ttft: Vec<(f64, f64)>,
    itl: Vec<(f64, f64)>,
}

impl Snapshot {
    fn parse(text: &str) -> anyhow::Result<Self> {
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .context("not Prometheus text")?;
        let mut s = Snapshot::default();
        let mut seen = false;
        for sample in &scrape.samples {
            let label = |name: &str| sample.labels.get(name).unwrap_or("").to_string();
            let value = match &sample.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
                Value::Histogram(buckets) => {
                    let target = match sample.metric.as_str() {
                        name::TIME_TO_FIRST_TOKEN_SECONDS => &mut s.ttft,
                        name::INTER_TOKEN_LATENCY_SECONDS => &mut s.itl,
                        _ => continue,
                    };
                    add_buckets(target, buckets);
                    continue;
                }
                Value::Summary(_) => continue,
            };
            let node = || (label("role"), label("node"));
            let cache = label("cache");
            match sample.metric.as_str() {
                name::PREFIX_CACHE_QUERIES_TOTAL | name::PREFIX_CACHE_HITS_TOTAL => {
                    seen = true;
                    let stats = s.nodes.entry(node()).or_default();
                    let pair = if cache == "external" {
                        &mut stats.external
                    } else {
                        &mut stats.local
                    };
                    if sample.metric == name::PREFIX_CACHE_HITS_TOTAL {
                        pair.hits += value;
                    } else {
                        pair.queries += value;
                    }
                }
                name::PROMPT_TOKENS_TOTAL => {
                    s.nodes.entry(node()).or_default().prompt_tokens += value
                }
                name::GENERATION_TOKENS_TOTAL => {
                    s.nodes.entry(node()).or_default().generation_tokens += value
                }
                name::NODE_UP => s.nodes.entry(node()).or_default().up = Some(value > 0.0),
                name::NODE_REQUESTS_RUNNING => s.nodes.entry(node()).or_default().running = value,
                name::NODE_REQUESTS_WAITING => s.nodes.entry(node()).or_default().waiting = value,
                name::NODE_KV_CACHE_USAGE_RATIO => {
                    s.nodes.entry(node()).or_default().kv_usage = value
                }
                name::REQUESTS_TOTAL => *s.outcomes.entry(label("outcome")).or_default() += value,
                name::REQUESTS_IN_FLIGHT => s.in_flight += value,
                _ => {}
            }
        }
        if !seen {
            bail!("it has no pd_router_prefix_cache_* series");
        }
        Ok(s)
    }
}

fn add_buckets(target: &mut Vec<(f64, f64)>, buckets: &[prometheus_parse::HistogramCount]) {
    for b in buckets {
        match target.iter_mut().find(|(le, _)| *le == b.less_than) {
            Some((_, count)) => *count += b.count,
            None => target.push((b.less_than, b.count)),
        }
    }
    target.sort_by(|a, b| a.0.total_cmp(&b.0));
}

/// The q-quantile of cumulative buckets, as Prometheus's `histogram_quantile` estimates it:
/// linear inside the bucket that holds it; the highest finite bound if it falls in +Inf.
fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let inside = count - lower.1;
            let fraction = if inside > 0.0 {
                (rank - lower.1) / inside
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * fraction);
        }
        lower = (le, count);
    }
    Some(lower.0)
}

fn bucket_increase(now: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    now.iter()
        .map(|&(le, n)| {
            let b = before
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |(_, c)| *c);
            (le, increase(n, b))
        })
        .collect()
}

/// p50 / p99 in seconds, over the last interval and over the router's lifetime.
#[derive(Debug, Default, Serialize)]
struct Latency {
    p50: Option<f64>,
    p99: Option<f64>,
    lifetime_p50: Option<f64>,
    lifetime_p99: Option<f64>,
}

impl Latency {
    fn new(now: &[(f64, f64)], before: Option<&[(f64, f64)]>) -> Self {
        let window = before.map(|b| bucket_increase(now, b));
        Self {
            p50: window.as_deref().and_then(|w| quantile(0.5, w)),
            p99: window.as_deref().and_then(|w| quantile(0.99, w)),
            lifetime_p50: quantile(0.5, now),
            lifetime_p99: quantile(0.99, now),
        }
    }
}

#[derive(Debug, Serialize)]
struct NodeSummary {
    role: String,
    node: String,
    up: Option<bool>,
    running: f64,
    waiting: f64,
    kv_usage: f64,
    local: HitsQueries,
    external: HitsQueries,
    local_hit_rate: Option<f64>,
    external_hit_rate: Option<f64>,
    /// Over the last interval (None for the first summary, or nothing looked up).
    local_hit_rate_interval: Option<f64>,
    external_hit_rate_interval: Option<f64>,
    generation_tokens_per_second: Option<f64>,
}

/// What one refresh prints.
#[derive(Debug, Serialize)]
struct Summary {
    url: String,
    /// Seconds since the previous scrape (None for the first).
    interval_seconds: Option<f64>,
    requests: f64,
    outcomes: BTreeMap<String, f64>,
    requests_per_second: Option<f64>,
    in_flight: f64,
    prompt_tokens_per_second: Option<f64>,
    generation_tokens_per_second: Option<f64>,
    ttft_seconds: Latency,
    itl_seconds: Latency,
    nodes: Vec<NodeSummary>,
}

impl Summary {
    fn new(url: &str, now: &Snapshot, window: Option<(f64, &Snapshot)>) -> Self {
        let per_second = |f: &dyn Fn(&Snapshot) -> f64| {
            window.map(|(dt, before)| increase(f(now), f(before)) / dt.max(1e-9))
        };
        let requests = |s: &Snapshot| s.outcomes.values().sum::<f64>();
        let prompt = |s: &Snapshot| {
            s.nodes
                .iter()
                .filter(|((r, _), _)| r == "prefill")
                .map(|(_, n)| n.prompt_tokens)
                .sum::<f64>()
        };
        // Tokens that reached clients, as the router measured them: each request's first token
        // is one TTFT observation, every later token one inter-token observation.
        let generated =
            |s: &Snapshot| s.ttft.last().map_or(0.0, |b| b.1) + s.itl.last().map_or(0.0, |b| b.1);
        let nodes = now
            .nodes
            .iter()
            .map(|((role, node), n)| {
                let before = window
                    .and_then(|(dt, b)| Some((dt, b.nodes.get(&(role.clone(), node.clone()))?)));
                NodeSummary {
                    role: role.clone(),
                    node: node.clone(),
                    up: n.up,
                    running: n.running,
                    waiting: n.waiting,
                    kv_usage: n.kv_usage,
                    local: n.local,
                    external: n.external,
                    local_hit_rate: n.local.rate(),
                    external_hit_rate: n.external.rate(),
                    local_hit_rate_interval: before
                        .and_then(|(_, b)| n.local.since(b.local).rate()),
                    external_hit_rate_interval: before
                        .and_then(|(_, b)| n.external.since(b.external).rate()),
                    generation_tokens_per_second: before.map(|(dt, b)| {
                        increase(n.generation_tokens, b.generation_tokens) / dt.max(1e-9)
                    }),
                }
            })
            .collect();
        Self {
            url: url.to_string(),
            interval_seconds: window.map(|(dt, _)| dt),
            requests: requests(now),
            outcomes: now.outcomes.clone(),
            requests_per_second: per_second(&requests),
            in_flight: now.in_flight,
            prompt_tokens_per_second: per_second(&prompt),
            generation_tokens_per_second: per_second(&generated),
            ttft_seconds: Latency::new(&now.ttft, window.map(|(_, b)| b.ttft.as_slice())),
            itl_seconds: Latency::new(&now.itl, window.map(|(_, b)| b.itl.as_slice())),
            nodes,
        }
    }

    fn table(&self) -> String {
        let rate = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}/s"));
        let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}%", v * 100.0));
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1} ms", v * 1000.0));
        let mut t = String::new();
        let window = self
            .interval_seconds
            .map_or("lifetime only".to_string(), |s| format!("last {s:.1} s"));
        t += &format!("pd cluster  {}  ({window})\n", self.url);
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .filter(|(_, n)| **n > 0.0)
            .map(|(o, n)| format!("{o} {n}"))
            .collect();
        t += &format!(
            "requests    {}  in flight {}  total {} ({})\n",
            rate(self.requests_per_second),
            self.in_flight,
            self.requests,
            if outcomes.is_empty() {
                "none yet".to_string()
            } else {
                outcomes.join(", ")
            }
        );
        t += &format!(
            "tokens      prompt {}  generated {}\n",
            rate(self.prompt_tokens_per_second),
            rate(self.generation_tokens_per_second)
        );
        for (name, l) in [("TTFT", &self.ttft_seconds), ("ITL", &self.itl_seconds)] {
            t += &format!(
                "{name:<11} p50 {}  p99 {}   lifetime p50 {}  p99 {}\n",
                ms(l.p50),
                ms(l.p99),
                ms(l.lifetime_p50),
                ms(l.lifetime_p99)
            );
        }
        t += &format!(
            "\n{:<8} {:<22} {:>4} {:>4} {:>4} {:>6}  {:>17}  {:>17}\n",
            "role",
            "node",
            "up",
            "run",
            "wait",
            "kv",
            "local hit (now/all)",
            "external hit (now/all)"
        );
        for n in &self.nodes {
            let up = match n.up {
                Some(true) => "yes",
                Some(false) => "DOWN",
                None => "?",
            };
            t += &format!(
                "{:<8} {:<22} {:>4} {:>4} {:>4} {:>6}  {:>9} / {:<7}  {:>9} / {:<7}\n",
                n.role,
                n.node,
                up,
                n.running,
                n.waiting,
                pct(Some(n.kv_usage)),
                pct(n.local_hit_rate_interval),
                pct(n.local_hit_rate),
                pct(n.external_hit_rate_interval),
                pct(n.external_hit_rate),
            );
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE pd_router_prefix_cache_queries_total counter
pd_router_prefix_cache_queries_total{cache=\"local\",model_name=\"m\",node=\"a:1\",role=\"prefill\"} 100
pd_router_prefix_cache_queries_total{cache=\"external\",model_name=\"m\",node=\"a:1\",role=\"prefill\"} 68
# TYPE pd_router_prefix_cache_hits_total counter
pd_router_prefix_cache_hits_total{cache=\"local\",model_name=\"m\",node=\"a:1\",role=\"prefill\"} 32
pd_router_prefix_cache_hits_total{cache=\"external\",model_name=\"m\",node=\"a:1\",role=\"prefill\"} 16
# TYPE pd_router_node_up gauge
pd_router_node_up{node=\"a:1\",role=\"prefill\"} 1
# TYPE pd_router_requests_total counter
pd_router_requests_total{model_name=\"m\",outcome=\"stop\"} 4
# TYPE pd_router_time_to_first_token_seconds histogram
pd_router_time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.1\"} 2
pd_router_time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.2\"} 4
pd_router_time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4
pd_router_time_to_first_token_seconds_sum{model_name=\"m\"} 0.5
pd_router_time_to_first_token_seconds_count{model_name=\"m\"} 4
";

    #[test]
    fn parses_the_router_and_summarises() {
        let s = Snapshot::parse(TEXT).unwrap();
        let n = &s.nodes[&("prefill".to_string(), "a:1".to_string())];
        assert_eq!(
            n.local,
            HitsQueries {
                hits: 32.0,
                queries: 100.0
            }
        );
        assert_eq!(n.external.rate(), Some(16.0 / 68.0));
        assert_eq!(n.up, Some(true));
        assert_eq!(s.outcomes["stop"], 4.0);
        // Half the requests within 0.1 s: the median is the bucket's upper bound.
        assert_eq!(quantile(0.5, &s.ttft), Some(0.1));
        let later =
            Snapshot::parse(&TEXT.replace("} 100", "} 132").replace("} 32", "} 64")).unwrap();
        let summary = Summary::new("u", &later, Some((2.0, &s)));
        assert_eq!(summary.nodes[0].local_hit_rate_interval, Some(1.0));
        assert_eq!(summary.nodes[0].local_hit_rate, Some(64.0 / 132.0));
        assert_eq!(summary.requests_per_second, Some(0.0));
        assert!(summary.table().contains("a:1"));
        assert!(Snapshot::parse("up 1\n").is_err());
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        let b = [(1.0, 0.0), (2.0, 10.0), (f64::INFINITY, 10.0)];
        assert_eq!(quantile(0.5, &b), Some(1.5));
        assert_eq!(quantile(0.5, &[(1.0, 0.0), (f64::INFINITY, 0.0)]), None);
        assert_eq!(
            quantile(0.99, &[(1.0, 0.0), (f64::INFINITY, 5.0)]),
            Some(1.0)
        );
    }

    #[test]
    fn addresses() {
        assert_eq!(
            MetricsEndpoint::parse("127.0.0.1:9").unwrap().url(),
            "http://127.0.0.1:9/metrics"
        );
        assert!(MetricsEndpoint::parse("ftp://h:1").is_err());
        assert!(MetricsEndpoint::parse("h").is_err());
    }
}
