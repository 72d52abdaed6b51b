//! [`NodeMetrics`]: everything a node's `/metrics` shows and its `CounterReport` carries,
//! read from where it is counted: the engine's published counters and gauges, the
//! transport's [`TransferStats`], and the request histograms fed by the engine thread.

use std::sync::Arc;

use pd_engine::serve::{EngineCounters, EngineHandle, Role};
use pd_proto::pb;
use pd_transport::{TRANSFER_SECONDS_BUCKETS, TransferCounts, TransferStats};

use super::encode::{Labels, TextEncoder};
use super::histogram::{HistogramSnapshot, RequestHistograms};
use super::names::{
    self, ENGINE_INDEX, FINISH_REASONS, Family, PromptSource, finished_reason, label,
};
use super::report::{Epoch, counter_report, requests_finished};

/// A node's metrics: cheap to read (each scrape or report takes fresh snapshots).
#[derive(Debug)]
pub struct NodeMetrics {
    role: Role,
    model_name: String,
    epoch: Epoch,
    engine: EngineHandle,
    transfers: Arc<TransferStats>,
    requests: Arc<RequestHistograms>,
}

/// What one exposition is rendered from, read once so that the families agree.
struct Snapshot {
    engine: EngineCounters,
    transfers: TransferCounts,
}

impl NodeMetrics {
    /// `transfers`: the puller's counters on a decode node, the export server's on a prefill
    /// node. `requests`: the histograms the engine thread feeds
    /// ([`RequestHistograms::observer`]). A new random epoch is drawn here.
    pub fn new(
        role: Role,
        model_name: &str,
        engine: EngineHandle,
        transfers: Arc<TransferStats>,
        requests: Arc<RequestHistograms>,
    ) -> Self {
        Self {
            role,
            model_name: model_name.to_string(),
            epoch: Epoch::random(),
            engine,
            transfers,
            requests,
        }
    }

    /// The transfer counters this node exposes (the RDMA exporter counts its offers there).
    pub fn transfers(&self) -> &Arc<TransferStats> {
        &self.transfers
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The node's cumulative counters now (see [`counter_report`]).
    pub fn counter_report(&self) -> pb::CounterReport {
        counter_report(
            self.epoch,
            &self.engine.counters(),
            &self.transfers.snapshot(),
        )
    }

    /// The text exposition of every family.
    pub fn render(&self) -> String {
        let snap = Snapshot {
            engine: self.engine.counters(),
            transfers: self.transfers.snapshot(),
        };
        let role = names::role(self.role);
        let vllm: [(&str, &str); 3] = [
            (label::MODEL_NAME, &self.model_name),
            (label::ENGINE, ENGINE_INDEX),
            (label::ROLE, role),
        ];
        let ours: [(&str, &str); 2] = [(label::MODEL_NAME, &self.model_name), (label::ROLE, role)];
        let mut e = TextEncoder::new();
        for family in Family::ALL {
            let base: &Labels<'_> = if family.is_vllm() { &vllm } else { &ours };
            e.header(family);
            if let Some(h) = self.histogram(family, &snap) {
                e.histogram(family, base, &h);
            }
            for (extra, value) in values(family, &snap, self.epoch) {
                let mut labels = base.to_vec();
                labels.extend(extra);
                e.sample(family.name(), &labels, value);
            }
        }
        e.finish()
    }

    /// The state of a histogram family (`None` for the others).
    fn histogram(&self, family: Family, snap: &Snapshot) -> Option<HistogramSnapshot> {
        let r = &self.requests;
        Some(match family {
            Family::TimeToFirstToken => r.time_to_first_token.snapshot(),
            Family::InterTokenLatency => r.inter_token_latency.snapshot(),
            Family::E2eRequestLatency => r.e2e_request_latency.snapshot(),
            Family::RequestQueueTime => r.queue_time.snapshot(),
            Family::RequestPrefillTime => r.prefill_time.snapshot(),
            Family::RequestDecodeTime => r.decode_time.snapshot(),
            Family::KvTransferSeconds => HistogramSnapshot {
                bounds: &TRANSFER_SECONDS_BUCKETS,
                counts: snap.transfers.bucket_counts.clone(),
                sum: snap.transfers.seconds_sum,
            },
            _ => return None,
        })
    }
}

/// The samples of a counter or gauge family: its own labels (after the base ones) and value.
/// None for a histogram (see [`NodeMetrics::histogram`]).
fn values(
    family: Family,
    snap: &Snapshot,
    epoch: Epoch,
) -> Vec<(Vec<(&'static str, &'static str)>, f64)> {
    let c = &snap.engine;
    let one = |v: u64| vec![(vec![], v as f64)];
    match family {
        Family::NumRequestsRunning => one(c.num_running),
        Family::NumRequestsWaiting => one(c.num_waiting),
        Family::KvCacheUsagePerc => vec![(vec![], c.kv_cache_usage)],
        Family::PrefixCacheQueries => one(c.prefix_cache_queries),
        Family::PrefixCacheHits => one(c.prefix_cache_hits),
        Family::ExternalPrefixCacheQueries => one(c.external_prefix_cache_queries),
        Family::ExternalPrefixCacheHits => one(c.external_prefix_cache_hits),
        Family::NumPreemptions => one(c.preemptions),
        Family::PromptTokens => one(c.prompt_tokens()),
        Family::PromptTokensBySource => PromptSource::ALL
            .iter()
            .map(|&s| {
                let n = match s {
                    PromptSource::LocalCompute => c.prompt_tokens_computed,
                    PromptSource::LocalCacheHit => c.prompt_tokens_local_cache,
                    PromptSource::ExternalKvTransfer => c.prompt_tokens_external,
                };
                (vec![(label::SOURCE, s.as_str())], n as f64)
            })
            .collect(),
        Family::GenerationTokens => one(c.generation_tokens),
        Family::RequestSuccess => FINISH_REASONS
            .iter()
            .map(|&r| {
                let labels = vec![(label::FINISHED_REASON, finished_reason(r))];
                (labels, requests_finished(c, r) as f64)
            })
            .collect(),
        Family::KvTransferBytes => one(snap.transfers.bytes),
        Family::KvTransferFailures => snap
            .transfers
            .failures
            .iter()
            .map(|(reason, n)| (vec![(label::REASON, reason.as_str())], *n as f64))
            .collect(),
        Family::KvTransferFailovers => one(snap.transfers.failovers),
        Family::KvRdmaOffers => snap
            .transfers
            .rdma_offers
            .iter()
            .map(|(mode, n)| (vec![(label::LAYOUT, mode.as_str())], *n as f64))
            .collect(),
        Family::KvImports => vec![
            (
                vec![(label::LANDING, "in_place")],
                c.kv_imports_in_place as f64,
            ),
            (
                vec![(label::LANDING, "buffers")],
                c.kv_imports_buffered as f64,
            ),
        ],
        Family::KvLeasesExpired => one(c.kv_leases_expired),
        Family::Epoch => one(epoch.get()),
        Family::TimeToFirstToken
        | Family::InterTokenLatency
        | Family::E2eRequestLatency
        | Family::RequestQueueTime
        | Family::RequestPrefillTime
        | Family::RequestDecodeTime
        | Family::KvTransferSeconds => vec![],
    }
}
