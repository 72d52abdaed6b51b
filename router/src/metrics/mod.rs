//! The router's metrics: what it exports on `/metrics` (`--metrics-port`) and where each
//! number comes from.
//!
//! - **Node counters** (prefix-cache queries and hits split local / external, prompt and
//!   generated tokens, preemptions, KV transfer bytes / time / failures, expired leases, node
//!   restarts): the nodes' cumulative `CounterReport`s, pulled with every `Info` health poll
//!   and carried by every `PrefillResponse` and last `DecodeResponse`, converted into
//!   increments exactly once by [`aggregate`] (the invariant is documented there).
//! - **Node gauges** (up, running, waiting, KV usage): the registry's view at scrape time
//!   (the last `Info` of each node).
//! - **Client-perceived request metrics** (time to first token, inter-token latency, request
//!   duration, requests by outcome, in flight): measured in the router where chunks leave
//!   for the client (`requests`).
//! - **Per-tenant usage** (prompt tokens by source, generated tokens, requests by outcome,
//!   labelled `tenant`): the `usage` each request's client got, summed (`tenants`).
//! - **Tenant limits** (requests each tenant's limits refused, by bucket) and **file reloads**
//!   (reads of a changed `--api-keys` / `--tenant-limits` file, loaded or refused): counted
//!   where they happen (`crate::limits`, `crate::watched`).
//! - **Failure handling** (retries, retries denied, each node's circuit breaker state and
//!   transitions): counted where requests are retried, breakers read at scrape time
//!   (`resilience`).
//! - **Prefix predictions** (what the cache index predicted the chosen node would reuse, by
//!   tier, next to what the node's usage says it reused, for the same requests): counted
//!   where the request's node answers (`prediction`).
//!
//! Names and labels are typed ids in [`ids`]; the series live in the router's own
//! `metrics-exporter-prometheus` recorder (`exporter`: one per router, not the process-global
//! one); `http` serves the text exposition (0.0.4); [`faults`] is a test-only hook that drops,
//! repeats and reorders reports.

pub mod aggregate;
mod exporter;
pub mod faults;
mod http;
pub mod ids;
mod prediction;
mod requests;
mod resilience;
mod tenants;

use std::collections::BTreeMap;
use std::sync::Mutex;

use std::fmt::Write as _;
use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram};
use pd_proto::pb::CounterReport;

pub use self::aggregate::{Aggregator, Increments, NodeKey};
pub use self::faults::{FaultSpec, FaultSpecError, ReportFaults};
pub use self::http::serve as serve_http;
pub use self::ids::{
    Cache, Family, HitTier, LimitKind, LostReason, Outcome, PromptSource, RejectReason,
    ReloadResult, WatchedFileKind,
};
pub use self::prediction::Predicted;
pub(crate) use self::requests::{MeteredGeneration, PromptCountedElsewhere};

use self::exporter::{CounterVec, Exporter, GaugeVec, Kind};
use self::ids::label;
use crate::disagg::{DisaggMode, Path, Reason};
use crate::registry::{Node, Registry};

/// Building the recorder failed (a bug: names and buckets are fixed).
#[derive(Debug, thiserror::Error)]
#[error("metrics: {0}")]
pub struct MetricsError(#[from] metrics_exporter_prometheus::BuildError);

/// Everything the router exports, and the aggregation state behind the node counters.
#[derive(Debug)]
pub struct RouterMetrics {
    model_name: String,
    exporter: Arc<Exporter>,
    queries: CounterVec,
    hits: CounterVec,
    hits_by_tier: CounterVec,
    prompt_tokens: CounterVec,
    generation_tokens: CounterVec,
    preemptions: CounterVec,
    pub(crate) requests: CounterVec,
    /// Time to first token, inter-token latency, request duration and requests in flight of
    /// this router's one model, looked up once: a label lookup hashes the label values under
    /// a lock, and these are touched on every request and chunk.
    pub(crate) model: ModelSeries,
    node_up: GaugeVec,
    node_running: GaugeVec,
    node_waiting: GaugeVec,
    node_kv_usage: GaugeVec,
    kv_bytes: CounterVec,
    kv_failures: CounterVec,
    kv_leases_expired: CounterVec,
    restarts: CounterVec,
    /// `pd_router_cache_events_lost_total{node,role,reason}`.
    cache_events_lost: CounterVec,
    /// `pd_router_file_reloads_total{file,result}`.
    file_reloads: CounterVec,
    /// `pd_router_disagg_decisions_total{path,reason}`.
    disagg: CounterVec,
    /// `pd_router_kv_transfer_seconds` per node: (sum of seconds, count).
    kv_seconds: Mutex<BTreeMap<NodeKey, (f64, u64)>>,
    counting: Mutex<Counting>,
    faults: Option<ReportFaults>,
    /// Per-tenant usage.
    pub(crate) tenants: tenants::TenantSeries,
    /// Retries and circuit breakers.
    pub(crate) resilience: resilience::ResilienceSeries,
    /// Predicted and delivered prefix-cache tokens.
    pub(crate) prediction: prediction::PredictionSeries,
}

/// The aggregator and the series it raises, under one lock.
#[derive(Debug, Default)]
struct Counting {
    aggregator: Aggregator,
    series: BTreeMap<NodeKey, NodeCounters>,
}

/// One node's counter series, looked up once per node: a label lookup hashes every label
/// value under a lock, and a node's report moves several series on every request.
#[derive(Debug)]
struct NodeCounters {
    /// By [`Cache::ALL`]'s order: local, external.
    queries: [Counter; 2],
    hits: [Counter; 2],
    /// By [`HitTier::ALL`]'s order: device, host, peer.
    hits_by_tier: [Counter; 3],
    prompt_tokens: Counter,
    generation_tokens: Counter,
    preemptions: Counter,
    kv_bytes: Counter,
    kv_leases_expired: Counter,
    restarts: Counter,
}

/// The per-request series of the served model (see [`RouterMetrics::model`]).
#[derive(Debug)]
pub(crate) struct ModelSeries {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub duration: Histogram,
    pub in_flight: Gauge,
    /// Client requests waiting for an admission slot.
    pub queued: Gauge,
    /// `pd_router_requests_rejected_total` by [`RejectReason::ALL`]'s order.
    rejected: [Counter; 2],
    /// `pd_router_requests_total` of each of [`Outcome::INITIAL`] (how nearly every request
    /// ends), in that order; see [`ModelSeries::ended`].
    ended: [Counter; 3],
}

impl ModelSeries {
    /// The request counter of `outcome` if it is one of [`Outcome::INITIAL`] (held, no label
    /// lookup); errors are counted by label.
    pub fn ended(&self, outcome: Outcome) -> Option<&Counter> {
        let i = Outcome::INITIAL.iter().position(|o| *o == outcome)?;
        Some(&self.ended[i])
    }
}

const NODE_LABELS: [&str; 2] = [label::NODE, label::ROLE];
const NODE_COUNT_LABELS: [&str; 3] = [label::ROLE, label::NODE, label::MODEL_NAME];
const CACHE_LABELS: [&str; 4] = [label::CACHE, label::ROLE, label::NODE, label::MODEL_NAME];
const TIER_LABELS: [&str; 4] = [label::TIER, label::ROLE, label::NODE, label::MODEL_NAME];

impl RouterMetrics {
    /// The router's metrics for `model_name`, with the report fault hook when `faults` is
    /// given (tests only, see [`faults`]).
    pub fn new(model_name: &str, faults: Option<FaultSpec>) -> Result<Self, MetricsError> {
        let exporter = Exporter::new(&[
            (Family::TimeToFirstToken, &ids::TTFT_BUCKETS[..]),
            (Family::InterTokenLatency, &ids::ITL_BUCKETS[..]),
            (Family::RequestDuration, &ids::DURATION_BUCKETS[..]),
        ])?;
        let counter = |family: Family, labels: &'static [&'static str]| {
            CounterVec::new(&exporter, family, labels)
        };
        let gauge = |family: Family, labels: &'static [&'static str]| {
            GaugeVec::new(&exporter, family, labels)
        };
        let hist = |family: Family| -> Histogram {
            exporter.describe(family, Kind::Histogram);
            exporter.histogram(family, &[label::MODEL_NAME], &[model_name])
        };
        let node_kv_usage = gauge(Family::NodeKvCacheUsage, &NODE_LABELS);
        let in_flight = gauge(Family::RequestsInFlight, &[label::MODEL_NAME]);
        // Request series exist from the start, so rates are defined before any request.
        let requests = counter(Family::Requests, &[label::MODEL_NAME, label::OUTCOME]);
        let rejected = counter(
            Family::RequestsRejected,
            &[label::MODEL_NAME, label::REASON],
        );
        let queued = gauge(Family::RequestsQueued, &[label::MODEL_NAME]);
        let model = ModelSeries {
            ttft: hist(Family::TimeToFirstToken),
            itl: hist(Family::InterTokenLatency),
            duration: hist(Family::RequestDuration),
            in_flight: in_flight.with_label_values(&[model_name]),
            queued: queued.with_label_values(&[model_name]),
            rejected: RejectReason::ALL
                .map(|r| rejected.with_label_values(&[model_name, r.as_str()])),
            ended: Outcome::INITIAL.map(|o| requests.with_label_values(&[model_name, o.as_str()])),
        };
        let metrics = Self {
            model_name: model_name.to_string(),
            queries: counter(Family::PrefixCacheQueries, &CACHE_LABELS),
            hits: counter(Family::PrefixCacheHits, &CACHE_LABELS),
            hits_by_tier: counter(Family::PrefixCacheHitsByTier, &TIER_LABELS),
            prompt_tokens: counter(Family::PromptTokens, &NODE_COUNT_LABELS),
            generation_tokens: counter(Family::GenerationTokens, &NODE_COUNT_LABELS),
            preemptions: counter(Family::NodePreemptions, &NODE_COUNT_LABELS),
            requests,
            model,
            node_up: gauge(Family::NodeUp, &NODE_LABELS),
            node_running: gauge(Family::NodeRequestsRunning, &NODE_LABELS),
            node_waiting: gauge(Family::NodeRequestsWaiting, &NODE_LABELS),
            node_kv_usage,
            kv_bytes: counter(Family::KvTransferBytes, &NODE_LABELS),
            kv_failures: counter(
                Family::KvTransferFailures,
                &[label::NODE, label::ROLE, label::REASON],
            ),
            kv_leases_expired: counter(Family::KvLeasesExpired, &NODE_LABELS),
            restarts: counter(Family::NodeRestarts, &NODE_LABELS),
            cache_events_lost: counter(
                Family::CacheEventsLost,
                &[label::NODE, label::ROLE, label::REASON],
            ),
            file_reloads: counter(Family::FileReloads, &[label::FILE, label::RESULT]),
            disagg: counter(Family::DisaggDecisions, &[label::PATH, label::REASON]),
            kv_seconds: Mutex::new(BTreeMap::new()),
            counting: Mutex::new(Counting::default()),
            faults: faults.map(ReportFaults::new),
            tenants: tenants::TenantSeries::new(&exporter),
            resilience: resilience::ResilienceSeries::new(&exporter),
            prediction: prediction::PredictionSeries::new(&exporter),
            exporter,
        };
        Ok(metrics)
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// Makes the per-tenant series of `tenants` exist (at 0), so rates are defined before
    /// their first request.
    pub fn add_tenants<'a>(&self, tenants: impl IntoIterator<Item = &'a crate::tenant::Tenant>) {
        for tenant in tenants {
            self.tenants.add(tenant);
        }
    }

    /// Admission refused a request of `tenant`: counted by reason, and as a request that
    /// ended `resource_exhausted` (for the router and the tenant), without a duration.
    pub fn rejected(&self, tenant: &crate::tenant::Tenant, reason: RejectReason) {
        let i = RejectReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or_default();
        self.model.rejected[i].increment(1);
        let outcome = Outcome::Error(tonic::Code::ResourceExhausted);
        (self.requests)
            .with_label_values(&[self.model_name.as_str(), outcome.as_str()])
            .increment(1);
        self.tenants.ended(tenant, outcome);
    }

    /// A request of `tenant` was refused by its limits (`--tenant-limits`), by the `kind`
    /// bucket: counted by tenant and reason, and as a request that ended `resource_exhausted`
    /// (for the router and the tenant), without a duration.
    pub fn tenant_limited(&self, tenant: &crate::tenant::Tenant, kind: LimitKind) {
        self.tenants.limited(tenant, kind);
        let outcome = Outcome::Error(tonic::Code::ResourceExhausted);
        (self.requests)
            .with_label_values(&[self.model_name.as_str(), outcome.as_str()])
            .increment(1);
        self.tenants.ended(tenant, outcome);
    }

    /// Makes the reload series of `file` exist (at 0): the router watches it.
    pub fn add_watched_file(&self, file: WatchedFileKind) {
        for result in ReloadResult::ALL {
            (self.file_reloads).create(&[file.as_str(), result.as_str()]);
        }
    }

    /// A changed `file` was read: `result`.
    pub fn file_reloaded(&self, file: WatchedFileKind, result: ReloadResult) {
        (self.file_reloads)
            .with_label_values(&[file.as_str(), result.as_str()])
            .increment(1);
    }

    /// Makes the decision series `mode` can raise exist (at 0), so rates are defined from the
    /// start.
    pub fn add_disagg_mode(&self, mode: DisaggMode) {
        let series: &[(Path, Reason)] = match mode {
            DisaggMode::Always => &[(Path::Remote, Reason::Setting)],
            DisaggMode::Never => &[(Path::Local, Reason::Setting)],
            DisaggMode::Auto => &[
                (Path::Remote, Reason::EstimatedCost),
                (Path::Local, Reason::EstimatedCost),
                (Path::Local, Reason::NoPrefillNode),
                (Path::Remote, Reason::NoDecodeNode),
                (Path::Remote, Reason::Unmeasured),
            ],
        };
        for (path, reason) in series {
            self.disagg.create(&[path.as_str(), reason.as_str()]);
        }
    }

    /// One request's prompt goes `path` for `reason`.
    pub fn disagg_decided(&self, path: Path, reason: Reason) {
        self.disagg
            .with_label_values(&[path.as_str(), reason.as_str()])
            .increment(1);
    }

    /// The router stopped following `node`'s cache events, which were in sync.
    pub fn cache_events_lost(&self, node: &Node, reason: LostReason) {
        self.cache_events_lost
            .with_label_values(&[node.addr.as_str(), node.role.as_str(), reason.as_str()])
            .increment(1);
    }

    /// One counter report of `node` (an `Info` answer, a `PrefillResponse`, the last
    /// `DecodeResponse`); `None` (a node that sends none) is ignored.
    pub fn observe_report(&self, node: &Node, report: Option<&CounterReport>) {
        let Some(report) = report else { return };
        let key = NodeKey {
            role: node.role,
            addr: node.addr.clone(),
        };
        match &self.faults {
            None => self.apply(&key, report),
            Some(faults) => {
                for r in faults.deliver(&key, report) {
                    self.apply(&key, &r);
                }
            }
        }
    }

    /// Converts a report into increments ([`aggregate`]) and adds them to the counters.
    fn apply(&self, node: &NodeKey, report: &CounterReport) {
        // Counters are raised under the aggregator's lock, so a scrape never sees a hit
        // applied before its query from another report of the same node.
        let mut counting = self.counting.lock().unwrap_or_else(|e| e.into_inner());
        let counting = &mut *counting;
        let inc = counting.aggregator.apply(node, report);
        if inc.is_empty() {
            return;
        }
        let series = self.node_counters(&mut counting.series, node);
        let add = |counter: &Counter, n: u64| {
            if n > 0 {
                counter.increment(n);
            }
        };
        add(&series.queries[0], inc.prefix_cache_queries);
        add(&series.hits[0], inc.prefix_cache_hits);
        add(&series.queries[1], inc.external_prefix_cache_queries);
        add(&series.hits[1], inc.external_prefix_cache_hits);
        for (tier, counter) in HitTier::ALL.into_iter().zip(&series.hits_by_tier) {
            let n = match tier {
                HitTier::Device => inc.prefix_cache_hits,
                HitTier::Host => inc.external_prefix_cache_hits_host,
                HitTier::Peer => inc.external_prefix_cache_hits_peer,
            };
            add(counter, n);
        }
        add(&series.prompt_tokens, inc.prompt_tokens);
        add(&series.generation_tokens, inc.generation_tokens);
        add(&series.preemptions, inc.preemptions);
        add(&series.kv_bytes, inc.kv_transfer_bytes);
        add(&series.kv_leases_expired, inc.kv_leases_expired);
        add(&series.restarts, u64::from(inc.restarted));
        let (role, addr) = (node.role.as_str(), node.addr.as_str());
        for (reason, n) in &inc.kv_transfer_failures {
            self.kv_failures
                .with_label_values(&[addr, role, reason])
                .increment(*n);
        }
        if inc.kv_transfers > 0 || inc.kv_transfer_seconds > 0.0 {
            let mut seconds = self.kv_seconds.lock().unwrap_or_else(|e| e.into_inner());
            let entry = seconds.entry(node.clone()).or_default();
            entry.0 += inc.kv_transfer_seconds;
            entry.1 += inc.kv_transfers;
        }
    }

    /// `node`'s counter series from `series`, looked up (and so created, at 0) the first time.
    fn node_counters<'a>(
        &self,
        series: &'a mut BTreeMap<NodeKey, NodeCounters>,
        node: &NodeKey,
    ) -> &'a NodeCounters {
        if !series.contains_key(node) {
            series.insert(node.clone(), self.look_up_node_counters(node));
        }
        &series[node]
    }

    fn look_up_node_counters(&self, node: &NodeKey) -> NodeCounters {
        let (role, addr, model) = (node.role.as_str(), node.addr.as_str(), &*self.model_name);
        let count = [role, addr, model];
        let kv = [addr, role];
        let cache = |vec: &CounterVec, cache: Cache| {
            vec.with_label_values(&[cache.as_str(), role, addr, model])
        };
        NodeCounters {
            queries: Cache::ALL.map(|c| cache(&self.queries, c)),
            hits: Cache::ALL.map(|c| cache(&self.hits, c)),
            hits_by_tier: HitTier::ALL
                .map(|t| (self.hits_by_tier).with_label_values(&[t.as_str(), role, addr, model])),
            prompt_tokens: self.prompt_tokens.with_label_values(&count),
            generation_tokens: self.generation_tokens.with_label_values(&count),
            preemptions: self.preemptions.with_label_values(&count),
            kv_bytes: self.kv_bytes.with_label_values(&kv),
            kv_leases_expired: self.kv_leases_expired.with_label_values(&kv),
            restarts: self.restarts.with_label_values(&kv),
        }
    }

    /// Sets the node gauges from the registry and makes every node's counter series exist
    /// (at 0 until its first count), so dashboards and rates see every node.
    fn refresh_nodes(&self, registry: &Registry) {
        // The same lock order as `apply`: the counters, then the transfer seconds.
        let mut counting = self.counting.lock().unwrap_or_else(|e| e.into_inner());
        let mut seconds = self.kv_seconds.lock().unwrap_or_else(|e| e.into_inner());
        for node in registry.nodes() {
            let (role, addr) = (node.role.as_str(), node.addr.as_str());
            let labels = [addr, role];
            self.node_up
                .with_label_values(&labels)
                .set(f64::from(u8::from(node.is_up())));
            let info = node.info().unwrap_or_default();
            self.node_running
                .with_label_values(&labels)
                .set(f64::from(info.num_running));
            self.node_waiting
                .with_label_values(&labels)
                .set(f64::from(info.num_waiting));
            let usage = if info.num_blocks > 0 {
                1.0 - (info.free_blocks.min(info.num_blocks) as f64 / info.num_blocks as f64)
            } else {
                0.0
            };
            self.node_kv_usage.with_label_values(&labels).set(usage);
            let key = NodeKey {
                role: node.role,
                addr: node.addr.clone(),
            };
            self.node_counters(&mut counting.series, &key);
            seconds.entry(key).or_default();
        }
    }

    /// The text exposition (format 0.0.4) of everything, node gauges as of now.
    pub fn render(&self, registry: &Registry) -> Result<String, MetricsError> {
        self.refresh_nodes(registry);
        self.resilience.refresh(registry);
        self.prediction.refresh(registry);
        let seconds = self.kv_seconds_family();
        Ok(self.exporter.render(seconds.as_slice()))
    }

    /// `pd_router_kv_transfer_seconds{node,role}` as a summary without quantiles: the nodes
    /// report a sum and a count, which is all the router can re-export exactly. The exporter
    /// has no such type (its summaries carry quantiles), so the family is written here; none
    /// before the router knows a node.
    fn kv_seconds_family(&self) -> Option<String> {
        let seconds = self.kv_seconds.lock().unwrap_or_else(|e| e.into_inner());
        if seconds.is_empty() {
            return None;
        }
        let family = Family::KvTransferSeconds;
        let name = family.name();
        let mut out = format!(
            "# HELP {name} {}\n# TYPE {name} summary\n",
            exporter::escape_help(family.help())
        );
        for (node, &(sum, count)) in seconds.iter() {
            let labels = format!(
                "{{{}=\"{}\",{}=\"{}\"}}",
                label::NODE,
                exporter::escape_label_value(&node.addr),
                label::ROLE,
                node.role.as_str(),
            );
            let _ = writeln!(out, "{name}_sum{labels} {sum}");
            let _ = writeln!(out, "{name}_count{labels} {count}");
        }
        Some(out)
    }
}
