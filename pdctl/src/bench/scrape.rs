//! The router's `/metrics`, read over plain HTTP and parsed with `prometheus-parse`: the
//! prefix-cache counters `pd_router_prefix_cache_{hits,queries}_total{cache,role,node,...}`
//! summed per (role, cache), the decode nodes' KV transfers
//! (`pd_router_kv_transfer_bytes_total`, `pd_router_kv_transfer_seconds_{sum,count}`), the
//! cache index's predicted and delivered prefix tokens
//! (`pd_router_prefix_{predicted,delivered}_tokens_total`, summed over nodes, roles and
//! tiers), the router's disaggregation decisions (`pd_router_disagg_decisions_total` by path
//! and reason), and their change over a window.

use std::collections::BTreeMap;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Bytes;

use pd_router::metrics::ids::name;

const HITS: &str = name::PREFIX_CACHE_HITS_TOTAL;
const QUERIES: &str = name::PREFIX_CACHE_QUERIES_TOTAL;
const KV_BYTES: &str = name::KV_TRANSFER_BYTES_TOTAL;
const PREDICTED: &str = name::PREFIX_PREDICTED_TOKENS_TOTAL;
const DELIVERED: &str = name::PREFIX_DELIVERED_TOKENS_TOTAL;
const DECISIONS: &str = name::DISAGG_DECISIONS_TOTAL;
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error(
        "`{0}` is not a metrics address (HOST:PORT or http[s]://HOST:PORT/metrics; https \
         needs --ca)"
    )]
    BadAddress(String),
    #[error("reading {url}: {reason}")]
    Http { url: String, reason: String },
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("{url} is not Prometheus text: {reason}")]
    Parse { url: String, reason: String },
    #[error("{url} has no {HITS} / {QUERIES} series (is it the router's metrics port?)")]
    NoCacheSeries { url: String },
}

/// Which prefix cache a counter is about (the `cache` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheTier {
    Local,
    External,
}

impl CacheTier {
    fn from_label(s: &str) -> Option<Self> {
        match s {
            "local" => Some(Self::Local),
            "external" => Some(Self::External),
            _ => None,
        }
    }
}

/// Prefix-cache hits and queries (tokens), one pair per (node role, cache), and the KV the
/// decode nodes pulled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheCounters {
    pub by_role: BTreeMap<(String, CacheTier), HitsQueries>,
    pub kv: KvTransfers,
    pub prediction: Prediction,
    /// Requests by (path, reason) of the router's disaggregation decision.
    pub decisions: BTreeMap<(String, String), f64>,
}

/// Prompt tokens the router's cache index predicted the chosen nodes would reuse, and what
/// those nodes' usage says they reused, for the same requests (docs/routing.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Prediction {
    pub predicted: f64,
    pub delivered: f64,
}

impl Prediction {
    /// predicted / delivered; None when nothing was delivered.
    pub fn ratio(&self) -> Option<f64> {
        (self.delivered > 0.0).then(|| self.predicted / self.delivered)
    }
}

/// KV pulled by the decode nodes (the receiving side: prefill nodes report the same bytes as
/// served, which are not added again).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct KvTransfers {
    pub bytes: f64,
    pub transfers: f64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct HitsQueries {
    pub hits: f64,
    pub queries: f64,
}

impl HitsQueries {
    /// hits / queries; None when nothing was queried.
    pub fn rate(&self) -> Option<f64> {
        (self.queries > 0.0).then(|| self.hits / self.queries)
    }
}

impl CacheCounters {
    /// Summed over roles: the cluster's counters of one cache.
    pub fn total(&self, cache: CacheTier) -> HitsQueries {
        self.by_role.iter().filter(|((_, c), _)| *c == cache).fold(
            HitsQueries::default(),
            |acc, (_, v)| HitsQueries {
                hits: acc.hits + v.hits,
                queries: acc.queries + v.queries,
            },
        )
    }

    pub fn get(&self, role: &str, cache: CacheTier) -> HitsQueries {
        self.by_role
            .get(&(role.to_string(), cache))
            .copied()
            .unwrap_or_default()
    }

    /// The change from `before` to `self` (counters only grow; a series that shrank, e.g.
    /// a restarted router, counts from zero).
    pub fn since(&self, before: &CacheCounters) -> CacheCounters {
        let d = |n: f64, t: f64| if n >= t { n - t } else { n };
        let by_role = self
            .by_role
            .iter()
            .map(|(k, now)| {
                let then = before.by_role.get(k).copied().unwrap_or_default();
                (
                    k.clone(),
                    HitsQueries {
                        hits: d(now.hits, then.hits),
                        queries: d(now.queries, then.queries),
                    },
                )
            })
            .collect();
        let (now, then) = (self.kv, before.kv);
        let kv = KvTransfers {
            bytes: d(now.bytes, then.bytes),
            transfers: d(now.transfers, then.transfers),
            seconds: d(now.seconds, then.seconds),
        };
        let (now, then) = (self.prediction, before.prediction);
        let prediction = Prediction {
            predicted: d(now.predicted, then.predicted),
            delivered: d(now.delivered, then.delivered),
        };
        let decisions = self
            .decisions
            .iter()
            .map(|(k, now)| {
                let then = before.decisions.get(k).copied().unwrap_or_default();
                (k.clone(), d(*now, then))
            })
            .collect();
        CacheCounters {
            by_role,
            kv,
            prediction,
            decisions,
        }
    }
}

/// Where the router's metrics are.
#[derive(Debug, Clone)]
pub struct MetricsEndpoint {
    url: String,
    authority: String,
    path: String,
    /// HTTPS (`--ca`).
    tls: Option<pd_tls::ClientTls>,
}

impl MetricsEndpoint {
    /// `HOST:PORT`, `http://HOST:PORT` or `http://HOST:PORT/PATH` (default path `/metrics`).
    pub fn parse(s: &str) -> Result<Self, ScrapeError> {
        let bad = || ScrapeError::BadAddress(s.to_string());
        let with_scheme = if s.contains("://") {
            s.to_string()
        } else {
            format!("http://{s}")
        };
        let uri: hyper::Uri = with_scheme.parse().map_err(|_| bad())?;
        // `https://` works with --ca (see `with_tls`), which decides TLS.
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(bad());
        }
        let https = uri.scheme_str() == Some("https");
        let authority = uri.authority().ok_or_else(bad)?;
        if authority.port_u16().is_none() {
            return Err(bad());
        }
        let path = match uri.path() {
            "" | "/" => "/metrics".to_string(),
            p => p.to_string(),
        };
        Ok(Self {
            url: format!("http{}://{authority}{path}", if https { "s" } else { "" }),
            authority: authority.to_string(),
            path,
            tls: None,
        })
    }

    /// This endpoint over HTTPS, verified with `tls`, when given (`--ca`).
    pub fn with_tls(mut self, tls: Option<pd_tls::ClientTls>) -> Self {
        if tls.is_some() {
            self.url = format!("https://{}{}", self.authority, self.path);
        }
        self.tls = tls;
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// GET the exposition text.
    pub async fn fetch(&self) -> Result<String, ScrapeError> {
        let http = |reason: String| ScrapeError::Http {
            url: self.url.clone(),
            reason,
        };
        if self.url.starts_with("https://") && self.tls.is_none() {
            return Err(http(
                "https needs --ca FILE (the CA of the router's certificate)".into(),
            ));
        }
        let get = async {
            let (host, port) = self
                .authority
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h, p.parse().ok()?)))
                .ok_or_else(|| http("not HOST:PORT".into()))?;
            let stream = pd_tls::dial(self.tls.as_ref(), host, port)
                .await
                .map_err(|e| http(e.to_string()))?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| http(e.to_string()))?;
            tokio::spawn(conn);
            let request = hyper::Request::get(self.path.as_str())
                .header(hyper::header::HOST, self.authority.as_str())
                .body(http_body_util::Empty::<Bytes>::new())
                .map_err(|e| http(e.to_string()))?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| http(e.to_string()))?;
            if !response.status().is_success() {
                return Err(ScrapeError::Status {
                    url: self.url.clone(),
                    status: response.status().as_u16(),
                });
            }
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| http(e.to_string()))?
                .to_bytes();
            String::from_utf8(body.to_vec()).map_err(|e| http(e.to_string()))
        };
        tokio::time::timeout(SCRAPE_TIMEOUT, get)
            .await
            .map_err(|_| http(format!("no answer within {SCRAPE_TIMEOUT:?}")))?
    }

    /// Fetch and read the prefix-cache counters.
    pub async fn cache_counters(&self) -> Result<CacheCounters, ScrapeError> {
        let text = self.fetch().await?;
        parse_cache_counters(&text).map_err(|e| match e {
            ParseFailure::Text(reason) => ScrapeError::Parse {
                url: self.url.clone(),
                reason,
            },
            ParseFailure::NoSeries => ScrapeError::NoCacheSeries {
                url: self.url.clone(),
            },
        })
    }
}

#[derive(Debug)]
pub enum ParseFailure {
    Text(String),
    NoSeries,
}

/// The prefix-cache counters of one exposition, summed over nodes and models per
/// (role, cache). The metric families must be present (a router with no traffic yet still
/// writes them once it knows its nodes); a missing family is an error, so a wrong address is
/// never read as "no hits".
pub fn parse_cache_counters(text: &str) -> Result<CacheCounters, ParseFailure> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .map_err(|e| ParseFailure::Text(e.to_string()))?;
    let mut counters = CacheCounters::default();
    let mut seen = false;
    for sample in &scrape.samples {
        let value = match sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Untyped(v)
            | prometheus_parse::Value::Gauge(v) => v,
            _ => continue,
        };
        if sample.labels.get("role") == Some("decode") {
            // The transfer seconds are a summary: its samples are the family's name with
            // `_sum` and `_count`.
            let summary = (sample.metric.strip_prefix(name::KV_TRANSFER_SECONDS))
                .and_then(|rest| rest.strip_prefix('_'));
            match (sample.metric.as_str(), summary) {
                (KV_BYTES, _) => counters.kv.bytes += value,
                (_, Some("sum")) => counters.kv.seconds += value,
                (_, Some("count")) => counters.kv.transfers += value,
                _ => {}
            }
        }
        match sample.metric.as_str() {
            PREDICTED => counters.prediction.predicted += value,
            // Peer hits are KV another node sent, not a cache the index could predict: the
            // ratio compares the tiers it predicts (device, host).
            DELIVERED if sample.labels.get("tier") != Some("peer") => {
                counters.prediction.delivered += value
            }
            DECISIONS => {
                if let (Some(path), Some(reason)) =
                    (sample.labels.get("path"), sample.labels.get("reason"))
                {
                    *(counters.decisions)
                        .entry((path.to_string(), reason.to_string()))
                        .or_default() += value;
                }
            }
            _ => {}
        }
        let is_hits = sample.metric == HITS;
        if !is_hits && sample.metric != QUERIES {
            continue;
        }
        seen = true;
        let (Some(cache), Some(role)) = (
            sample.labels.get("cache").and_then(CacheTier::from_label),
            sample.labels.get("role"),
        ) else {
            continue;
        };
        let entry = counters
            .by_role
            .entry((role.to_string(), cache))
            .or_default();
        if is_hits {
            entry.hits += value;
        } else {
            entry.queries += value;
        }
    }
    if !seen && !declares_cache_families(text) {
        return Err(ParseFailure::NoSeries);
    }
    Ok(counters)
}

/// A router that has served nothing yet may write the families' HELP/TYPE lines without
/// samples; that is "zero", not "wrong address".
fn declares_cache_families(text: &str) -> bool {
    text.lines().any(|l| {
        l.starts_with("# TYPE pd_router_prefix_cache_hits")
            || l.starts_with("# TYPE pd_router_prefix_cache_queries")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# HELP pd_router_prefix_cache_hits_total Prefix-cache hits in tokens.
# TYPE pd_router_prefix_cache_hits_total counter
pd_router_prefix_cache_hits_total{cache=\"local\",role=\"prefill\",node=\"a:1\",model_name=\"m\"} 32
pd_router_prefix_cache_hits_total{cache=\"local\",role=\"prefill\",node=\"b:2\",model_name=\"m\"} 16
pd_router_prefix_cache_hits_total{cache=\"external\",role=\"decode\",node=\"c:3\",model_name=\"m\"} 50
# TYPE pd_router_prefix_cache_queries_total counter
pd_router_prefix_cache_queries_total{cache=\"local\",role=\"prefill\",node=\"a:1\",model_name=\"m\"} 100
pd_router_prefix_cache_queries_total{cache=\"local\",role=\"prefill\",node=\"b:2\",model_name=\"m\"} 60
pd_router_prefix_cache_queries_total{cache=\"external\",role=\"decode\",node=\"c:3\",model_name=\"m\"} 50
pd_router_requests_total{model_name=\"m\",outcome=\"stop\"} 3
# TYPE pd_router_kv_transfer_bytes_total counter
pd_router_kv_transfer_bytes_total{role=\"decode\",node=\"c:3\",model_name=\"m\"} 4096
pd_router_kv_transfer_bytes_total{role=\"prefill\",node=\"a:1\",model_name=\"m\"} 4096
# TYPE pd_router_kv_transfer_seconds histogram
pd_router_kv_transfer_seconds_bucket{role=\"decode\",node=\"c:3\",model_name=\"m\",le=\"+Inf\"} 2
pd_router_kv_transfer_seconds_sum{role=\"decode\",node=\"c:3\",model_name=\"m\"} 0.5
pd_router_kv_transfer_seconds_count{role=\"decode\",node=\"c:3\",model_name=\"m\"} 2
# TYPE pd_router_prefix_predicted_tokens_total counter
pd_router_prefix_predicted_tokens_total{node=\"a:1\",role=\"prefill\",tier=\"device\"} 96
pd_router_prefix_predicted_tokens_total{node=\"a:1\",role=\"prefill\",tier=\"host\"} 32
# TYPE pd_router_prefix_delivered_tokens_total counter
pd_router_prefix_delivered_tokens_total{node=\"a:1\",role=\"prefill\",tier=\"device\"} 64
pd_router_prefix_delivered_tokens_total{node=\"a:1\",role=\"prefill\",tier=\"peer\"} 500
";

    #[test]
    fn kv_transfers_are_the_decode_nodes_and_subtract_over_a_window() {
        let now = parse_cache_counters(TEXT).unwrap();
        let want = KvTransfers {
            bytes: 4096.0,
            transfers: 2.0,
            seconds: 0.5,
        };
        assert_eq!(
            now.kv, want,
            "the prefill side's served bytes are not added"
        );
        let before = parse_cache_counters(&TEXT.replace("} 4096", "} 1024")).unwrap();
        assert_eq!(now.since(&before).kv.bytes, 3072.0);
        assert_eq!(now.since(&now).kv, KvTransfers::default());
    }

    #[test]
    fn sums_per_role_and_cache_and_subtracts_windows() {
        let now = parse_cache_counters(TEXT).unwrap();
        assert_eq!(
            now.get("prefill", CacheTier::Local),
            HitsQueries {
                hits: 48.0,
                queries: 160.0
            }
        );
        assert_eq!(now.total(CacheTier::External).rate(), Some(1.0));
        let before =
            parse_cache_counters(&TEXT.replace("} 32", "} 0").replace("} 100", "} 68")).unwrap();
        let d = now.since(&before);
        assert_eq!(
            d.get("prefill", CacheTier::Local),
            HitsQueries {
                hits: 32.0,
                queries: 32.0
            }
        );
        assert_eq!(d.total(CacheTier::External).queries, 0.0);
        assert_eq!(d.total(CacheTier::External).rate(), None);
    }

    #[test]
    fn predicted_and_delivered_sum_over_the_predicted_tiers_and_subtract_over_a_window() {
        let now = parse_cache_counters(TEXT).unwrap();
        assert_eq!(
            now.prediction,
            Prediction {
                predicted: 128.0,
                // The peer's 500 are a transfer, not a cache the index predicts.
                delivered: 64.0
            }
        );
        assert_eq!(now.prediction.ratio(), Some(2.0));
        let before = parse_cache_counters(&TEXT.replace("} 96", "} 64")).unwrap();
        assert_eq!(now.since(&before).prediction.predicted, 32.0);
        assert_eq!(now.since(&now).prediction.ratio(), None);
    }

    #[test]
    fn a_page_without_the_families_is_refused() {
        assert!(matches!(
            parse_cache_counters("up 1\n"),
            Err(ParseFailure::NoSeries)
        ));
        assert!(parse_cache_counters("# TYPE pd_router_prefix_cache_hits_total counter\n").is_ok());
    }

    #[test]
    fn addresses() {
        assert_eq!(
            MetricsEndpoint::parse("127.0.0.1:9000").unwrap().url(),
            "http://127.0.0.1:9000/metrics"
        );
        assert_eq!(
            MetricsEndpoint::parse("http://h:1/m").unwrap().url(),
            "http://h:1/m"
        );
        assert!(MetricsEndpoint::parse("ftp://h:1").is_err());
        assert!(MetricsEndpoint::parse("nohost").is_err());
        // https is read with --ca only.
        let https = MetricsEndpoint::parse("https://h:1").unwrap();
        assert_eq!(https.url(), "https://h:1/metrics");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let err = rt.block_on(https.fetch()).unwrap_err().to_string();
        assert!(err.contains("--ca"), "{err}");
    }
}
