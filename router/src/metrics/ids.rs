//! Every name, help text, label name and bucket layout of the router's `/metrics`, once.
//!
//! Call sites use these typed ids ([`Family`], [`Cache`], [`Outcome`]); no metric name or
//! label name is written anywhere else. The names are `pd_router_*` and promtool-clean
//! (docs/metrics.md lists them); the router never re-exports a `vllm:*` series, or every
//! dashboard summing over the cluster would count each token twice.

use tonic::Code;

/// Label names (the label *values* come from typed sources: node addresses, roles, enums).
pub mod label {
    pub const CACHE: &str = "cache";
    pub const TIER: &str = "tier";
    pub const ROLE: &str = "role";
    pub const NODE: &str = "node";
    pub const MODEL_NAME: &str = "model_name";
    pub const OUTCOME: &str = "outcome";
    pub const REASON: &str = "reason";
    pub const TENANT: &str = "tenant";
    pub const SOURCE: &str = "source";
    pub const STATE: &str = "state";
    pub const FILE: &str = "file";
    pub const RESULT: &str = "result";
    pub const PATH: &str = "path";
}

/// The exposed family names, for readers of the router's `/metrics` (`pdctl`) to match
/// on; a counter's carries its `_total` suffix.
pub mod name {
    pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "pd_router_prefix_cache_queries_total";
    pub const PREFIX_CACHE_HITS_TOTAL: &str = "pd_router_prefix_cache_hits_total";
    pub const PREFIX_CACHE_HITS_BY_TIER_TOTAL: &str = "pd_router_prefix_cache_hits_by_tier_total";
    pub const PROMPT_TOKENS_TOTAL: &str = "pd_router_prompt_tokens_total";
    pub const GENERATION_TOKENS_TOTAL: &str = "pd_router_generation_tokens_total";
    pub const NODE_PREEMPTIONS_TOTAL: &str = "pd_router_node_preemptions_total";
    pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "pd_router_time_to_first_token_seconds";
    pub const INTER_TOKEN_LATENCY_SECONDS: &str = "pd_router_inter_token_latency_seconds";
    pub const REQUEST_DURATION_SECONDS: &str = "pd_router_request_duration_seconds";
    pub const REQUESTS_TOTAL: &str = "pd_router_requests_total";
    pub const REQUESTS_IN_FLIGHT: &str = "pd_router_requests_in_flight";
    pub const NODE_UP: &str = "pd_router_node_up";
    pub const NODE_REQUESTS_RUNNING: &str = "pd_router_node_requests_running";
    pub const NODE_REQUESTS_WAITING: &str = "pd_router_node_requests_waiting";
    pub const NODE_KV_CACHE_USAGE_RATIO: &str = "pd_router_node_kv_cache_usage_ratio";
    pub const KV_TRANSFER_BYTES_TOTAL: &str = "pd_router_kv_transfer_bytes_total";
    pub const KV_TRANSFER_FAILURES_TOTAL: &str = "pd_router_kv_transfer_failures_total";
    pub const KV_TRANSFER_SECONDS: &str = "pd_router_kv_transfer_seconds";
    pub const KV_LEASES_EXPIRED_TOTAL: &str = "pd_router_kv_leases_expired_total";
    pub const NODE_RESTARTS_TOTAL: &str = "pd_router_node_restarts_total";
    pub const TENANT_PROMPT_TOKENS_TOTAL: &str = "pd_router_tenant_prompt_tokens_total";
    pub const TENANT_GENERATION_TOKENS_TOTAL: &str = "pd_router_tenant_generation_tokens_total";
    pub const TENANT_REQUESTS_TOTAL: &str = "pd_router_tenant_requests_total";
    pub const REQUESTS_REJECTED_TOTAL: &str = "pd_router_requests_rejected_total";
    pub const REQUESTS_QUEUED: &str = "pd_router_requests_queued";
    pub const RETRIES_TOTAL: &str = "pd_router_retries_total";
    pub const RETRIES_DENIED_TOTAL: &str = "pd_router_retries_denied_total";
    pub const NODE_CIRCUIT_STATE: &str = "pd_router_node_circuit_state";
    pub const NODE_CIRCUIT_TRANSITIONS_TOTAL: &str = "pd_router_node_circuit_transitions_total";
    pub const MIGRATIONS_TOTAL: &str = "pd_router_migrations_total";
    pub const TENANT_REQUESTS_REJECTED_TOTAL: &str = "pd_router_tenant_requests_rejected_total";
    pub const FILE_RELOADS_TOTAL: &str = "pd_router_file_reloads_total";
    pub const PREFIX_PREDICTED_TOKENS_TOTAL: &str = "pd_router_prefix_predicted_tokens_total";
    pub const CACHE_EVENTS_LOST_TOTAL: &str = "pd_router_cache_events_lost_total";
    pub const PREFIX_DELIVERED_TOKENS_TOTAL: &str = "pd_router_prefix_delivered_tokens_total";
    pub const DISAGG_DECISIONS_TOTAL: &str = "pd_router_disagg_decisions_total";
}

/// One metric family of the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    PrefixCacheQueries,
    PrefixCacheHits,
    PrefixCacheHitsByTier,
    PromptTokens,
    GenerationTokens,
    NodePreemptions,
    TimeToFirstToken,
    InterTokenLatency,
    RequestDuration,
    Requests,
    RequestsInFlight,
    NodeUp,
    NodeRequestsRunning,
    NodeRequestsWaiting,
    NodeKvCacheUsage,
    KvTransferBytes,
    KvTransferFailures,
    KvTransferSeconds,
    KvLeasesExpired,
    NodeRestarts,
    TenantPromptTokens,
    TenantGenerationTokens,
    TenantRequests,
    RequestsRejected,
    RequestsQueued,
    Retries,
    RetriesDenied,
    NodeCircuitState,
    NodeCircuitTransitions,
    Migrations,
    TenantRequestsRejected,
    FileReloads,
    PrefixPredictedTokens,
    PrefixDeliveredTokens,
    CacheEventsLost,
    DisaggDecisions,
}

impl Family {
    pub const ALL: [Family; 36] = [
        Family::PrefixCacheQueries,
        Family::PrefixCacheHits,
        Family::PrefixCacheHitsByTier,
        Family::PromptTokens,
        Family::GenerationTokens,
        Family::NodePreemptions,
        Family::TimeToFirstToken,
        Family::InterTokenLatency,
        Family::RequestDuration,
        Family::Requests,
        Family::RequestsInFlight,
        Family::NodeUp,
        Family::NodeRequestsRunning,
        Family::NodeRequestsWaiting,
        Family::NodeKvCacheUsage,
        Family::KvTransferBytes,
        Family::KvTransferFailures,
        Family::KvTransferSeconds,
        Family::KvLeasesExpired,
        Family::NodeRestarts,
        Family::TenantPromptTokens,
        Family::TenantGenerationTokens,
        Family::TenantRequests,
        Family::RequestsRejected,
        Family::RequestsQueued,
        Family::Retries,
        Family::RetriesDenied,
        Family::NodeCircuitState,
        Family::NodeCircuitTransitions,
        Family::Migrations,
        Family::TenantRequestsRejected,
        Family::FileReloads,
        Family::PrefixPredictedTokens,
        Family::PrefixDeliveredTokens,
        Family::CacheEventsLost,
        Family::DisaggDecisions,
    ];

    /// The exposed name (counters carry their `_total` suffix here).
    pub fn name(self) -> &'static str {
        match self {
            Family::PrefixCacheQueries => name::PREFIX_CACHE_QUERIES_TOTAL,
            Family::PrefixCacheHits => name::PREFIX_CACHE_HITS_TOTAL,
            Family::PrefixCacheHitsByTier => name::PREFIX_CACHE_HITS_BY_TIER_TOTAL,
            Family::PromptTokens => name::PROMPT_TOKENS_TOTAL,
            Family::GenerationTokens => name::GENERATION_TOKENS_TOTAL,
            Family::NodePreemptions => name::NODE_PREEMPTIONS_TOTAL,
            Family::TimeToFirstToken => name::TIME_TO_FIRST_TOKEN_SECONDS,
            Family::InterTokenLatency => name::INTER_TOKEN_LATENCY_SECONDS,
            Family::RequestDuration => name::REQUEST_DURATION_SECONDS,
            Family::Requests => name::REQUESTS_TOTAL,
            Family::RequestsInFlight => name::REQUESTS_IN_FLIGHT,
            Family::NodeUp => name::NODE_UP,
            Family::NodeRequestsRunning => name::NODE_REQUESTS_RUNNING,
            Family::NodeRequestsWaiting => name::NODE_REQUESTS_WAITING,
            Family::NodeKvCacheUsage => name::NODE_KV_CACHE_USAGE_RATIO,
            Family::KvTransferBytes => name::KV_TRANSFER_BYTES_TOTAL,
            Family::KvTransferFailures => name::KV_TRANSFER_FAILURES_TOTAL,
            Family::KvTransferSeconds => name::KV_TRANSFER_SECONDS,
            Family::KvLeasesExpired => name::KV_LEASES_EXPIRED_TOTAL,
            Family::NodeRestarts => name::NODE_RESTARTS_TOTAL,
            Family::TenantPromptTokens => name::TENANT_PROMPT_TOKENS_TOTAL,
            Family::TenantGenerationTokens => name::TENANT_GENERATION_TOKENS_TOTAL,
            Family::TenantRequests => name::TENANT_REQUESTS_TOTAL,
            Family::RequestsRejected => name::REQUESTS_REJECTED_TOTAL,
            Family::RequestsQueued => name::REQUESTS_QUEUED,
            Family::Retries => name::RETRIES_TOTAL,
            Family::RetriesDenied => name::RETRIES_DENIED_TOTAL,
            Family::NodeCircuitState => name::NODE_CIRCUIT_STATE,
            Family::NodeCircuitTransitions => name::NODE_CIRCUIT_TRANSITIONS_TOTAL,
            Family::Migrations => name::MIGRATIONS_TOTAL,
            Family::TenantRequestsRejected => name::TENANT_REQUESTS_REJECTED_TOTAL,
            Family::FileReloads => name::FILE_RELOADS_TOTAL,
            Family::PrefixPredictedTokens => name::PREFIX_PREDICTED_TOKENS_TOTAL,
            Family::PrefixDeliveredTokens => name::PREFIX_DELIVERED_TOKENS_TOTAL,
            Family::CacheEventsLost => name::CACHE_EVENTS_LOST_TOTAL,
            Family::DisaggDecisions => name::DISAGG_DECISIONS_TOTAL,
        }
    }

    pub fn help(self) -> &'static str {
        match self {
            Family::PrefixCacheQueries => {
                "Prompt tokens looked up in a node's prefix cache (cache=local: its device \
                 tier; cache=external: what the local lookup left), from the nodes' counters."
            }
            Family::PrefixCacheHits => {
                "Prompt tokens found by those lookups (cache=local: device tier; \
                 cache=external: restored from the host tier or received from a prefill node)."
            }
            Family::PrefixCacheHitsByTier => {
                "The same hits by the tier they came from (tier=device: cache=local; \
                 tier=host: restored from the node's host-memory tier; tier=peer: received \
                 from another node), from the nodes' counters; host + peer = cache=external."
            }
            Family::PromptTokens => "Prompt tokens a node processed, from its counters.",
            Family::GenerationTokens => "Tokens a node generated, from its counters.",
            Family::NodePreemptions => "Requests a node preempted, from its counters.",
            Family::TimeToFirstToken => {
                "Time from a request's arrival at the router to its first token leaving the \
                 router, in seconds."
            }
            Family::InterTokenLatency => {
                "Time between two tokens leaving the router for a client, in seconds (a \
                 message of n tokens counts n times its gap / n)."
            }
            Family::RequestDuration => {
                "Time from a request's arrival at the router to its end (any outcome), in \
                 seconds."
            }
            Family::Requests => {
                "Generation requests by how they ended: finish reason (stop, length, abort) or \
                 gRPC code (invalid_argument, unavailable, cancelled, ...)."
            }
            Family::RequestsInFlight => "Generation requests the router is serving now.",
            Family::NodeUp => "1 if the node's last health check succeeded, else 0.",
            Family::NodeRequestsRunning => "Requests running on the node (its last Info).",
            Family::NodeRequestsWaiting => "Requests waiting on the node (its last Info).",
            Family::NodeKvCacheUsage => {
                "Fraction of the node's KV blocks in use, 0 to 1 (its last Info)."
            }
            Family::KvTransferBytes => {
                "KV bytes a node moved (decode: received; prefill: served), from its counters."
            }
            Family::KvTransferFailures => {
                "Failed KV transfers by reason, from the nodes' counters."
            }
            Family::KvTransferSeconds => {
                "Completed KV transfers and their summed duration in seconds, from the nodes' \
                 counters (a summary without quantiles)."
            }
            Family::KvLeasesExpired => {
                "Prefill KV leases that expired before anyone released them, from the nodes' \
                 counters."
            }
            Family::NodeRestarts => {
                "Node restarts the router noticed: counter epochs seen beyond the first."
            }
            Family::TenantPromptTokens => {
                "Prompt tokens of a tenant's finished requests by source (computed, \
                 local_hit, external_hit), as their usage told the client: computed = \
                 prompt_tokens - cached_tokens."
            }
            Family::TenantGenerationTokens => {
                "Generated tokens of a tenant's finished requests, as their usage told the \
                 client (completion_tokens)."
            }
            Family::TenantRequests => {
                "A tenant's generation requests by how they ended (the outcome label of \
                 pd_router_requests_total)."
            }
            Family::RequestsRejected => {
                "Client requests the router refused at admission by reason (queue_full: no \
                 slot and no room to wait; queue_timeout: no slot freed in time); each is \
                 also a resource_exhausted outcome of pd_router_requests_total."
            }
            Family::RequestsQueued => {
                "Client requests waiting for an admission slot (--max-inflight) now."
            }
            Family::Retries => {
                "Requests sent to another node of the role after a node failed them."
            }
            Family::RetriesDenied => {
                "Node failures not retried: reason=budget (the retry budget was spent) or \
                 max_retries (the request had used its --max-retries)."
            }
            Family::NodeCircuitState => {
                "The node's circuit breaker: 0 closed, 1 open (no requests until its \
                 cool-down ends), 2 half-open (one probe request may go)."
            }
            Family::NodeCircuitTransitions => {
                "Moves of the node's circuit breaker into each state (closed, open, half_open)."
            }
            Family::Migrations => {
                "Streams resumed on another decode node after their decode node failed with \
                 tokens already sent (the prompt and those tokens prefilled again)."
            }
            Family::TenantRequestsRejected => {
                "Client requests refused because their tenant (or API key) was over a limit of \
                 the --tenant-limits file, by the limit's bucket (reason=requests, \
                 generation_tokens, prompt_tokens); each is also a resource_exhausted outcome \
                 of pd_router_requests_total."
            }
            Family::FileReloads => {
                "Reads of a changed configuration file (file=api_keys, tenant_limits) by \
                 result: loaded, or refused (the file is not valid; what was in use stays)."
            }
            Family::PrefixPredictedTokens => {
                "Prompt tokens the cache index predicted the chosen node would reuse, by tier \
                 (device, host), for requests routed while the node's cache events were in \
                 sync: whole blocks, short of the last prompt token."
            }
            Family::PrefixDeliveredTokens => {
                "Prompt tokens the chosen node reported reused in its usage, by tier (device: \
                 local_cached_tokens; host and peer: external_host_cached_tokens, \
                 external_peer_cached_tokens), for the same requests as \
                 pd_router_prefix_predicted_tokens_total."
            }
            Family::CacheEventsLost => {
                "Times a node's cache events, once in sync, stopped being followed, by reason \
                 (broken, malformed, gap, epoch, over_capacity): the router routes to the node \
                 on its own guess until it resubscribes and applies a new snapshot."
            }
            Family::DisaggDecisions => {
                "Where requests' prompts were computed (path=remote: on a prefill node, the KV \
                 then moved; path=local: on the decode node), by reason (setting: --disagg \
                 always or never; estimated_cost: auto's cheaper estimate; no_prefill_node; \
                 no_decode_node; unmeasured: auto before any prefill was measured)."
            }
        }
    }
}

/// Which prefix-cache pair a count belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cache {
    /// The node's device tier (`vllm:prefix_cache_*` on the node).
    Local,
    /// Everything else (`vllm:external_prefix_cache_*` on the node).
    External,
}

impl Cache {
    pub const ALL: [Cache; 2] = [Cache::Local, Cache::External];

    pub fn as_str(self) -> &'static str {
        match self {
            Cache::Local => "local",
            Cache::External => "external",
        }
    }
}

/// Which tier of a node a predicted or delivered prefix hit is in (the `tier` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HitTier {
    /// The node's device cache (local hits).
    Device,
    /// Restored from the node's host-memory tier.
    Host,
    /// Received from another node (delivered only: the index predicts no peer hits).
    Peer,
}

impl HitTier {
    pub const ALL: [HitTier; 3] = [HitTier::Device, HitTier::Host, HitTier::Peer];
    /// The tiers the cache index predicts.
    pub const PREDICTED: [HitTier; 2] = [HitTier::Device, HitTier::Host];

    pub fn as_str(self) -> &'static str {
        match self {
            HitTier::Device => "device",
            HitTier::Host => "host",
            HitTier::Peer => "peer",
        }
    }
}

/// Where a tenant's prompt tokens came from, as the `source` label (the split of `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PromptSource {
    /// Computed by the node that ran the prompt: `prompt_tokens - cached_tokens`.
    Computed,
    /// Found in that node's device cache (`local_cached_tokens`).
    LocalHit,
    /// Restored from its host tier or a peer (`external_cached_tokens`).
    ExternalHit,
}

impl PromptSource {
    pub const ALL: [PromptSource; 3] = [
        PromptSource::Computed,
        PromptSource::LocalHit,
        PromptSource::ExternalHit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PromptSource::Computed => "computed",
            PromptSource::LocalHit => "local_hit",
            PromptSource::ExternalHit => "external_hit",
        }
    }
}

/// Why admission refused a request, as the `reason` label of
/// `pd_router_requests_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// Every slot taken and the queue full (or `--max-queue 0`): refused at arrival.
    QueueFull,
    /// Waited `--queue-timeout` in the queue without a slot freeing.
    QueueTimeout,
}

impl RejectReason {
    pub const ALL: [RejectReason; 2] = [RejectReason::QueueFull, RejectReason::QueueTimeout];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "queue_full",
            RejectReason::QueueTimeout => "queue_timeout",
        }
    }
}

/// Which bucket of a tenant's (or API key's) limits refused a request, as the `reason` label
/// of `pd_router_tenant_requests_rejected_total`; also the dimension a limit applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LimitKind {
    /// Requests per second.
    Requests,
    /// Generated tokens per second.
    GenerationTokens,
    /// Prompt tokens per second, a cached one costing `--cached-token-cost` of a computed one.
    PromptTokens,
}

impl LimitKind {
    pub const ALL: [LimitKind; 3] = [
        LimitKind::Requests,
        LimitKind::GenerationTokens,
        LimitKind::PromptTokens,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests",
            LimitKind::GenerationTokens => "generation_tokens",
            LimitKind::PromptTokens => "prompt_tokens",
        }
    }

    /// The position of the kind in [`LimitKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A configuration file the router reads again when it changes, as the `file` label of
/// `pd_router_file_reloads_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WatchedFileKind {
    /// `--api-keys`.
    ApiKeys,
    /// `--tenant-limits`.
    TenantLimits,
}

impl WatchedFileKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WatchedFileKind::ApiKeys => "api_keys",
            WatchedFileKind::TenantLimits => "tenant_limits",
        }
    }
}

/// Why the router stopped following a node's cache events, as the `reason` label of
/// `pd_router_cache_events_lost_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LostReason {
    /// The stream failed or the node ended it (a restart, a drain, the network).
    Broken,
    /// A message no node could have sent.
    Malformed,
    /// A change number skipped or repeated out of order.
    Gap,
    /// Changes of another epoch (another process of the node) or before any snapshot.
    Epoch,
    /// More blocks than the node's stated capacity or than `--cache-index-blocks` allows.
    OverCapacity,
}

impl LostReason {
    pub const ALL: [LostReason; 5] = [
        LostReason::Broken,
        LostReason::Malformed,
        LostReason::Gap,
        LostReason::Epoch,
        LostReason::OverCapacity,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LostReason::Broken => "broken",
            LostReason::Malformed => "malformed",
            LostReason::Gap => "gap",
            LostReason::Epoch => "epoch",
            LostReason::OverCapacity => "over_capacity",
        }
    }
}

/// How reading a changed file went, as the `result` label of `pd_router_file_reloads_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReloadResult {
    /// The new version is in use.
    Loaded,
    /// The new version is not valid: the one in use stays.
    Refused,
}

impl ReloadResult {
    pub const ALL: [ReloadResult; 2] = [ReloadResult::Loaded, ReloadResult::Refused];

    pub fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Loaded => "loaded",
            ReloadResult::Refused => "refused",
        }
    }
}

/// How a generation request ended, as the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Stop,
    Length,
    Abort,
    /// Ended with an error status, or (`Cancelled`) the client went away.
    Error(Code),
}

impl Outcome {
    /// The outcomes exported at 0 from the start, so rates exist before the first request.
    pub const INITIAL: [Outcome; 3] = [Outcome::Stop, Outcome::Length, Outcome::Abort];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Abort => "abort",
            Outcome::Error(code) => code_label(code),
        }
    }
}

/// A gRPC code in snake_case, as the `outcome` label writes it.
pub fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// vLLM's `vllm:time_to_first_token_seconds` buckets, so router and node TTFT line up.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's `vllm:e2e_request_latency_seconds` buckets.
pub const DURATION_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_promtool_clean() {
        let mut seen = std::collections::HashSet::new();
        for f in Family::ALL {
            let name = f.name();
            assert!(seen.insert(name), "{name} twice");
            assert!(name.starts_with("pd_router_"), "{name}");
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{name}"
            );
            assert!(!f.help().is_empty());
        }
    }

    #[test]
    fn outcomes_are_snake_case() {
        assert_eq!(
            Outcome::Error(Code::InvalidArgument).as_str(),
            "invalid_argument"
        );
        assert_eq!(
            Outcome::Error(Code::DeadlineExceeded).as_str(),
            "deadline_exceeded"
        );
        assert_eq!(Outcome::Abort.as_str(), "abort");
    }
}
