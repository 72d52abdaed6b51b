//! [`NodeMetrics`]: everything a node's `/metrics` shows and its `CounterReport` carries,
//! read from where it is counted: the engine's published counters and gauges, the
//! transport's [`TransferStats`], and the request histograms fed by the engine thread; and
//! the KV cache's configuration, fixed at start (`vllm:cache_config_info`).

use std::sync::Arc;

use pd_engine::serve::{EngineCounters, EngineHandle, Role};
use pd_proto::pb;
use pd_transport::{TRANSFER_SECONDS_BUCKETS, TransferCounts, TransferStats};

use super::encode::{Labels, TextEncoder};
use super::histogram::{HistogramSnapshot, RequestHistograms};
use super::names::{ENGINE_INDEX, FINISH_REASONS, Family, PromptSource, finished_reason, label};
use super::report::{Epoch, counter_report, requests_finished};
use crate::model::ModelFacts;

/// A node's metrics: cheap to read (each scrape or report takes fresh snapshots).
#[derive(Debug)]
pub struct NodeMetrics {
    role: Role,
    model_name: String,
    /// `vllm:cache_config_info`'s own labels, as vLLM writes them.
    cache_config: Vec<(&'static str, String)>,
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
    /// ([`RequestHistograms::observers`]). A new random epoch is drawn here.
    pub fn new(
        role: Role,
        facts: &ModelFacts,
        engine: EngineHandle,
        transfers: Arc<TransferStats>,
        requests: Arc<RequestHistograms>,
    ) -> Self {
        Self {
            role,
            model_name: facts.served_name.clone(),
            cache_config: cache_config(facts),
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
        let role = self.role.as_str();
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
            if family == Family::CacheConfigInfo {
                let mut labels = base.to_vec();
                labels.extend(self.cache_config.iter().map(|(k, v)| (*k, v.as_str())));
                e.sample(family.name(), &labels, 1.0);
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
            Family::RequestInferenceTime => r.inference_time.snapshot(),
            Family::RequestPromptTokens => r.prompt_tokens.snapshot(),
            Family::RequestGenerationTokens => r.generation_tokens.snapshot(),
            Family::RequestParamsMaxTokens => r.max_tokens.snapshot(),
            Family::IterationTokens => r.iteration_tokens.snapshot(),
            Family::RequestPrefillTime => r.prefill_time.snapshot(),
            Family::RequestDecodeTime => r.decode_time.snapshot(),
            Family::KvTransferSeconds => HistogramSnapshot {
                bounds: TRANSFER_SECONDS_BUCKETS.into(),
                counts: snap.transfers.bucket_counts.clone(),
                sum: snap.transfers.seconds_sum,
            },
            _ => return None,
        })
    }
}

/// `vllm:cache_config_info`'s labels: the block size, the KV cache's stored type (resolved,
/// as torch names it: `float32`, `float16`, `bfloat16`), whether prefix caching is on
/// (Python's `True` / `False`, as vLLM writes it), the KV blocks and the host tier's blocks.
fn cache_config(facts: &ModelFacts) -> Vec<(&'static str, String)> {
    let python_bool = |b: bool| if b { "True" } else { "False" };
    vec![
        (label::BLOCK_SIZE, facts.block_size().to_string()),
        (
            label::CACHE_DTYPE,
            facts.kv_dtype().torch_name().to_string(),
        ),
        (
            label::ENABLE_PREFIX_CACHING,
            python_bool(facts.prefix_caching).to_string(),
        ),
        (label::NUM_GPU_BLOCKS, facts.num_blocks.to_string()),
        (label::NUM_CPU_BLOCKS, facts.host_cache_blocks.to_string()),
    ]
}

/// The samples of a counter or gauge family: its own labels (after the base ones) and value.
/// None for a histogram (see [`NodeMetrics::histogram`]) or the configuration's info gauge
/// (see [`NodeMetrics::render`]).
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
                    PromptSource::External(source) => c.prompt_tokens_from(source),
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
                vec![(label::LANDING, "device_copy")],
                c.kv_imports_device_copy as f64,
            ),
            (
                vec![(label::LANDING, "host_copy")],
                c.kv_imports_host_copy as f64,
            ),
            (
                vec![(label::LANDING, "buffers")],
                c.kv_imports_buffered as f64,
            ),
        ],
        Family::KvLeasesExpired => one(c.kv_leases_expired),
        Family::Epoch => one(epoch.get()),
        Family::CacheConfigInfo
        | Family::TimeToFirstToken
        | Family::InterTokenLatency
        | Family::E2eRequestLatency
        | Family::RequestQueueTime
        | Family::RequestInferenceTime
        | Family::RequestPrefillTime
        | Family::RequestDecodeTime
        | Family::RequestPromptTokens
        | Family::RequestGenerationTokens
        | Family::RequestParamsMaxTokens
        | Family::IterationTokens
        | Family::KvTransferSeconds => vec![],
    }
}
