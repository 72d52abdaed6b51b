//! Every metric family a node exposes, its label names and label values, defined once.
//!
//! The `vllm:*` families copy vLLM's exposition (v1 engine, `vllm/v1/metrics/loggers.py`):
//! names, types, help texts, histogram buckets, the label names `model_name` and `engine` in
//! that order, then the family's own label (`finished_reason`, `source`), so that vLLM's
//! dashboards work unchanged against a node. Our nodes add `role` right after `engine`.
//! Counters are named with their `_total` suffix, as Python's `prometheus_client` writes
//! them in the text format. The `pd_node_*` families are this project's own.

use pd_engine::sampling::FinishReason;
use pd_engine::serve::TierKind;

/// A family's Prometheus type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

impl MetricType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

/// Label names.
pub mod label {
    pub const MODEL_NAME: &str = "model_name";
    pub const ENGINE: &str = "engine";
    pub const ROLE: &str = "role";
    pub const FINISHED_REASON: &str = "finished_reason";
    pub const SOURCE: &str = "source";
    pub const REASON: &str = "reason";
    pub const LANDING: &str = "landing";
    pub const LAYOUT: &str = "layout";
    /// `vllm:cache_config_info`'s labels (vLLM's `CacheConfig` field names).
    pub const BLOCK_SIZE: &str = "block_size";
    pub const CACHE_DTYPE: &str = "cache_dtype";
    pub const ENABLE_PREFIX_CACHING: &str = "enable_prefix_caching";
    pub const NUM_GPU_BLOCKS: &str = "num_gpu_blocks";
    pub const NUM_CPU_BLOCKS: &str = "num_cpu_blocks";
    /// The histogram bucket bound.
    pub const LE: &str = "le";
}

/// The `engine` label value: one engine per node (vLLM numbers its data-parallel engines
/// from 0).
pub const ENGINE_INDEX: &str = "0";

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const INTER_TOKEN_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's request latency buckets (end-to-end, queue, prefill, decode).
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's `vllm:iteration_tokens_total` buckets.
pub const ITERATION_TOKENS_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// vLLM's buckets for token counts per request: 1, 2, 5, 10, 20, 50, ... up to `max` (the
/// model's context length).
pub fn one_two_five_buckets(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1usize;
    loop {
        for m in [1usize, 2, 5] {
            match m.checked_mul(scale) {
                Some(v) if v <= max => out.push(v as f64),
                _ => return out,
            }
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => return out,
        };
    }
}

/// Every metric family of a node, in exposition order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    NumRequestsRunning,
    NumRequestsWaiting,
    KvCacheUsagePerc,
    CacheConfigInfo,
    PrefixCacheQueries,
    PrefixCacheHits,
    ExternalPrefixCacheQueries,
    ExternalPrefixCacheHits,
    NumPreemptions,
    PromptTokens,
    PromptTokensBySource,
    GenerationTokens,
    RequestSuccess,
    RequestPromptTokens,
    RequestGenerationTokens,
    IterationTokens,
    RequestParamsMaxTokens,
    TimeToFirstToken,
    InterTokenLatency,
    E2eRequestLatency,
    RequestQueueTime,
    RequestInferenceTime,
    RequestPrefillTime,
    RequestDecodeTime,
    KvTransferBytes,
    KvTransferSeconds,
    KvTransferFailures,
    KvTransferFailovers,
    KvRdmaOffers,
    KvImports,
    KvLeasesExpired,
    Epoch,
}

impl Family {
    pub const ALL: [Family; 32] = [
        Self::NumRequestsRunning,
        Self::NumRequestsWaiting,
        Self::KvCacheUsagePerc,
        Self::CacheConfigInfo,
        Self::PrefixCacheQueries,
        Self::PrefixCacheHits,
        Self::ExternalPrefixCacheQueries,
        Self::ExternalPrefixCacheHits,
        Self::NumPreemptions,
        Self::PromptTokens,
        Self::PromptTokensBySource,
        Self::GenerationTokens,
        Self::RequestSuccess,
        Self::RequestPromptTokens,
        Self::RequestGenerationTokens,
        Self::IterationTokens,
        Self::RequestParamsMaxTokens,
        Self::TimeToFirstToken,
        Self::InterTokenLatency,
        Self::E2eRequestLatency,
        Self::RequestQueueTime,
        Self::RequestInferenceTime,
        Self::RequestPrefillTime,
        Self::RequestDecodeTime,
        Self::KvTransferBytes,
        Self::KvTransferSeconds,
        Self::KvTransferFailures,
        Self::KvTransferFailovers,
        Self::KvRdmaOffers,
        Self::KvImports,
        Self::KvLeasesExpired,
        Self::Epoch,
    ];

    /// The family's name as exposed (counters with `_total`; histogram samples add
    /// `_bucket`, `_sum`, `_count`).
    pub fn name(self) -> &'static str {
        match self {
            Self::NumRequestsRunning => "vllm:num_requests_running",
            Self::NumRequestsWaiting => "vllm:num_requests_waiting",
            Self::KvCacheUsagePerc => "vllm:kv_cache_usage_perc",
            Self::CacheConfigInfo => "vllm:cache_config_info",
            Self::PrefixCacheQueries => "vllm:prefix_cache_queries_total",
            Self::PrefixCacheHits => "vllm:prefix_cache_hits_total",
            Self::ExternalPrefixCacheQueries => "vllm:external_prefix_cache_queries_total",
            Self::ExternalPrefixCacheHits => "vllm:external_prefix_cache_hits_total",
            Self::NumPreemptions => "vllm:num_preemptions_total",
            Self::PromptTokens => "vllm:prompt_tokens_total",
            Self::PromptTokensBySource => "vllm:prompt_tokens_by_source_total",
            Self::GenerationTokens => "vllm:generation_tokens_total",
            Self::RequestSuccess => "vllm:request_success_total",
            Self::RequestPromptTokens => "vllm:request_prompt_tokens",
            Self::RequestGenerationTokens => "vllm:request_generation_tokens",
            Self::IterationTokens => "vllm:iteration_tokens_total",
            Self::RequestParamsMaxTokens => "vllm:request_params_max_tokens",
            Self::TimeToFirstToken => "vllm:time_to_first_token_seconds",
            Self::InterTokenLatency => "vllm:inter_token_latency_seconds",
            Self::E2eRequestLatency => "vllm:e2e_request_latency_seconds",
            Self::RequestQueueTime => "vllm:request_queue_time_seconds",
            Self::RequestInferenceTime => "vllm:request_inference_time_seconds",
            Self::RequestPrefillTime => "vllm:request_prefill_time_seconds",
            Self::RequestDecodeTime => "vllm:request_decode_time_seconds",
            Self::KvTransferBytes => "pd_node_kv_transfer_bytes_total",
            Self::KvTransferSeconds => "pd_node_kv_transfer_seconds",
            Self::KvTransferFailures => "pd_node_kv_transfer_failures_total",
            Self::KvTransferFailovers => "pd_node_kv_transfer_failovers_total",
            Self::KvRdmaOffers => "pd_node_kv_rdma_offers_total",
            Self::KvImports => "pd_node_kv_imports_total",
            Self::KvLeasesExpired => "pd_node_kv_leases_expired_total",
            Self::Epoch => "pd_node_epoch",
        }
    }

    pub fn help(self) -> &'static str {
        match self {
            Self::NumRequestsRunning => "Number of requests in model execution batches.",
            Self::NumRequestsWaiting => "Number of requests waiting to be processed.",
            Self::KvCacheUsagePerc => "KV-cache usage. 1 means 100 percent usage.",
            Self::CacheConfigInfo => "Information of the LLMEngine CacheConfig",
            Self::PrefixCacheQueries => {
                "Prefix cache queries, in terms of number of queried tokens."
            }
            Self::PrefixCacheHits => "Prefix cache hits, in terms of number of cached tokens.",
            Self::ExternalPrefixCacheQueries => {
                "External prefix cache queries from KV connector cross-instance cache sharing, \
                 in terms of number of queried tokens."
            }
            Self::ExternalPrefixCacheHits => {
                "External prefix cache hits from KV connector cross-instance cache sharing, in \
                 terms of number of cached tokens."
            }
            Self::NumPreemptions => "Cumulative number of preemption from the engine.",
            Self::PromptTokens => "Number of prefill tokens processed.",
            Self::PromptTokensBySource => "Number of prompt tokens by source.",
            Self::GenerationTokens => "Number of generation tokens processed.",
            Self::RequestSuccess => "Count of successfully processed requests.",
            Self::RequestPromptTokens => "Number of prefill tokens processed.",
            Self::RequestGenerationTokens => "Number of generation tokens processed.",
            Self::IterationTokens => "Histogram of number of tokens per engine_step.",
            Self::RequestParamsMaxTokens => "Histogram of the max_tokens request parameter.",
            Self::TimeToFirstToken => "Histogram of time to first token in seconds.",
            Self::InterTokenLatency => "Histogram of inter-token latency in seconds.",
            Self::E2eRequestLatency => "Histogram of e2e request latency in seconds.",
            Self::RequestQueueTime => "Histogram of time spent in WAITING phase for request.",
            Self::RequestInferenceTime => "Histogram of time spent in RUNNING phase for request.",
            Self::RequestPrefillTime => "Histogram of time spent in PREFILL phase for request.",
            Self::RequestDecodeTime => "Histogram of time spent in DECODE phase for request.",
            Self::KvTransferBytes => {
                "KV payload bytes of completed transfers: received (decode) or served (prefill)."
            }
            Self::KvTransferSeconds => "Duration of completed KV transfers in seconds.",
            Self::KvTransferFailures => "Failed KV transfers by reason.",
            Self::KvTransferFailovers => {
                "KV transfers whose RDMA read failed and that were retried over TCP."
            }
            Self::KvRdmaOffers => {
                "Leases offered for RDMA reads, by layout: in place in registered KV memory, or \
                 staged in a registered copy."
            }
            Self::KvImports => {
                "Requests admitted with imported KV, by where it landed: in place in reserved \
                 blocks, or in buffers copied in at admission."
            }
            Self::KvLeasesExpired => {
                "Prefill KV leases released by their deadline instead of by the router."
            }
            Self::Epoch => {
                "Random identity of this node process (the epoch of its CounterReport); a new \
                 value means the node restarted and its counters started again from zero."
            }
        }
    }

    pub fn kind(self) -> MetricType {
        match self {
            Self::NumRequestsRunning
            | Self::NumRequestsWaiting
            | Self::KvCacheUsagePerc
            | Self::CacheConfigInfo
            | Self::Epoch => MetricType::Gauge,
            Self::RequestPromptTokens
            | Self::RequestGenerationTokens
            | Self::IterationTokens
            | Self::RequestParamsMaxTokens
            | Self::TimeToFirstToken
            | Self::InterTokenLatency
            | Self::E2eRequestLatency
            | Self::RequestQueueTime
            | Self::RequestInferenceTime
            | Self::RequestPrefillTime
            | Self::RequestDecodeTime
            | Self::KvTransferSeconds => MetricType::Histogram,
            _ => MetricType::Counter,
        }
    }

    /// Whether the family carries vLLM's labels (`model_name`, `engine`) besides `role`.
    pub fn is_vllm(self) -> bool {
        self.name().starts_with("vllm:")
    }
}

/// The `source` values of `vllm:prompt_tokens_by_source_total`: vLLM's three, with the
/// external part split by where the KV came from. vLLM has no value of its own for a host
/// tier (it counts restores from its CPU offload as `external_kv_transfer`), so host-tier
/// restores get `external_host_cache_hit`; the values still sum to the prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptSource {
    /// Computed on this node.
    LocalCompute,
    /// Found in this node's device cache.
    LocalCacheHit,
    /// Found outside the device cache, by where it came from.
    External(TierKind),
}

impl PromptSource {
    /// Every value, in exposition order (vLLM's three first).
    pub const ALL: [PromptSource; 2 + TierKind::COUNT] = [
        Self::LocalCompute,
        Self::LocalCacheHit,
        Self::External(TierKind::Peer),
        Self::External(TierKind::Host),
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::LocalCompute => "local_compute",
            Self::LocalCacheHit => "local_cache_hit",
            // vLLM's value for KV received through its KV connector.
            Self::External(TierKind::Peer) => "external_kv_transfer",
            Self::External(TierKind::Host) => "external_host_cache_hit",
        }
    }
}

/// The `finished_reason` values of `vllm:request_success_total` (vLLM's spelling).
pub const FINISH_REASONS: [FinishReason; 3] = [
    FinishReason::Stop,
    FinishReason::Length,
    FinishReason::Abort,
];

pub fn finished_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_go_one_two_five_up_to_the_context() {
        assert_eq!(
            one_two_five_buckets(100),
            [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(
            one_two_five_buckets(4096),
            [
                1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0
            ]
        );
        assert_eq!(one_two_five_buckets(0), Vec::<f64>::new());
        // 1, 2, 5 × 10^0..=10^18, then 10^19: no overflow.
        assert_eq!(one_two_five_buckets(usize::MAX).len(), 58);
    }

    #[test]
    fn every_family_is_listed_once_with_a_type_and_help() {
        let names: std::collections::HashSet<_> = Family::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), Family::ALL.len());
        for f in Family::ALL {
            assert!(!f.help().is_empty());
            if f.kind() == MetricType::Counter {
                assert!(f.name().ends_with("_total"), "{}", f.name());
            }
        }
    }

    #[test]
    fn prompt_sources_list_every_external_source_once() {
        let names: std::collections::HashSet<_> =
            PromptSource::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names.len(), PromptSource::ALL.len());
        for source in TierKind::ALL {
            assert!(PromptSource::ALL.contains(&PromptSource::External(source)));
        }
    }
}
