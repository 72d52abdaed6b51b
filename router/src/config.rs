//! The router's configuration: the command line (clap, every flag also read from a `PD_...`
//! environment variable) and the plain [`RouterConfig`] the library runs with, so tests and
//! `pdctl up` can build one without a command line.

use std::time::Duration;

use clap::{Args, ValueEnum};
pub use pd_engine::kv::prefix::hash::HashAlgo;

mod failure;

pub use self::failure::FailureArgs;
use crate::discovery::DnsTarget;
pub use crate::parse::{ReasoningParser, ToolCallParser};
use crate::registry::Role;

/// Which prefill node a request goes to (decode nodes: see [`crate::policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyKind {
    /// Each request to the next healthy prefill node in turn.
    RoundRobin,
    /// The prefill node with the least load (running + waiting + the router's in-flight).
    LeastLoaded,
    /// The prefill node most likely to hold the prompt's prefix in its cache, balanced by load
    /// (see [`crate::policy::PrefixAware`]).
    PrefixAware,
}

/// Whether the router follows the nodes' cache events (`--cache-events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CacheEventsMode {
    /// Subscribe to every node's `CacheEvents` and route on what the caches hold.
    On,
    /// Subscribe to none: the prefix-aware policy routes on its own guess alone (to compare
    /// the two, or to spare the nodes the streams).
    Off,
}

/// `--request-timeout`'s default: long enough for any generation the router's defaults
/// allow, short enough that a request stuck on a node ends on its own.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Everything [`crate::serve`] needs.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// `--model`: a model directory or `synthetic:<preset>`; only its metadata is loaded.
    pub model: String,
    /// Prefill node gRPC addresses (`host:port`).
    pub prefill: Vec<String>,
    /// Decode node gRPC addresses (`host:port`).
    pub decode: Vec<String>,
    /// Names re-resolved every `dns_interval` for more nodes (headless Services).
    pub prefill_dns: Vec<crate::discovery::DnsTarget>,
    pub decode_dns: Vec<crate::discovery::DnsTarget>,
    pub dns_interval: Duration,
    pub policy: PolicyKind,
    /// Upper bound of `max_tokens`; an unset `max_tokens` is `min(cap, context − prompt)`.
    pub max_tokens_cap: u32,
    /// How often every node's `Info` is polled.
    pub health_interval: Duration,
    /// Deadline of one `Info` poll; a node that misses it is marked down.
    pub health_timeout: Duration,
    /// Largest client message the router decodes.
    pub max_message_bytes: usize,
    /// Upper bound of a whole request (the client's own `grpc-timeout` may be shorter);
    /// `None`: only the client's deadline, if any.
    pub request_timeout: Option<Duration>,
    /// `--max-inflight`, `--max-queue`, `--queue-timeout`.
    pub admission: crate::admission::AdmissionLimits,
    /// `--max-concurrent-streams` and the keepalive and connection age of the gRPC API.
    pub grpc_limits: pd_tls::GrpcLimits,
    /// `--http-header-timeout` and `--http-max-connections` of the HTTP API (the `/metrics`
    /// server has fixed, smaller limits).
    pub http_limits: pd_tls::HttpLimits,
    /// Deadline of a whole `Prefill` call, and the longest a decode stream may stay silent,
    /// when the client's deadline does not end the request first.
    pub node_timeout: Duration,
    /// Retries of requests a node failed: count, backoff, budget.
    pub retry: crate::retry::RetryPolicy,
    /// Every node's circuit breaker.
    pub breaker: crate::registry::BreakerConfig,
    /// `--migration-limit`: moves of one live stream to another decode node.
    pub migration_limit: u32,
    /// Block hashes remembered per node by the prefix-aware policy's own guess (an LRU set),
    /// used for a node whose cache events are not in sync.
    pub prefix_index_blocks: usize,
    /// Block entries the cache index (every node's cache events) holds over all nodes.
    pub cache_index_blocks: usize,
    /// `--cache-events`: whether the cache index is fed at all.
    pub cache_events: CacheEventsMode,
    /// `--disagg`: where prompts are computed.
    pub disagg: crate::disagg::DisaggMode,
    /// TEST-ONLY: drop / repeat / reorder the nodes' counter reports (from
    /// `PD_ROUTER_REPORT_FAULTS`, see [`crate::metrics::faults`]).
    pub report_faults: Option<crate::metrics::FaultSpec>,
    /// The HTTP API's chat answers: reasoning read out as `reasoning_content`.
    pub reasoning_parser: Option<ReasoningParser>,
    /// The HTTP API's chat answers: tool calls read out as `tool_calls` (requests with tools).
    pub tool_call_parser: Option<ToolCallParser>,
    /// `--api-keys`: the `TENANT KEY` file clients authenticate with (None: open, every
    /// request is the `default` tenant's).
    pub api_keys: Option<std::path::PathBuf>,
    /// `--shared-prefix-cache`: tenants share cached KV (their cache salt is not derived).
    pub shared_prefix_cache: bool,
    /// `--tenant-limits`: the per-tenant (and per-key) rate limits file (None: no limits).
    pub tenant_limits: Option<std::path::PathBuf>,
    /// `--cached-token-cost`: what a cached prompt token costs against a prompt token limit,
    /// as a fraction of a computed one.
    pub cached_token_cost: crate::limits::CachedTokenCost,
    /// `--prefix-caching-hash-algo`: the nodes' block hash (nodes that differ are not used).
    pub prefix_caching_hash_algo: HashAlgo,
    /// TLS of the router's listeners and of its channels to the nodes (`--tls-*`; the
    /// default is plaintext). [`RouterArgs::to_config`] leaves it plaintext: the binary
    /// sets it from [`RouterArgs::tls`] (checking it is a separate, typed step).
    pub tls: pd_tls::TlsSettings,
}

impl RouterConfig {
    /// A configuration with the command line's defaults for these nodes.
    pub fn new(model: impl Into<String>, prefill: Vec<String>, decode: Vec<String>) -> Self {
        Self {
            model: model.into(),
            prefill,
            decode,
            prefill_dns: Vec::new(),
            decode_dns: Vec::new(),
            dns_interval: Duration::from_secs(5),
            policy: PolicyKind::PrefixAware,
            max_tokens_cap: 4096,
            health_interval: Duration::from_millis(500),
            health_timeout: Duration::from_millis(1000),
            max_message_bytes: 4 << 20,
            request_timeout: Some(DEFAULT_REQUEST_TIMEOUT),
            admission: crate::admission::AdmissionLimits::default(),
            grpc_limits: pd_tls::GrpcLimits::default(),
            http_limits: pd_tls::HttpLimits::default(),
            node_timeout: Duration::from_secs(120),
            retry: crate::retry::RetryPolicy::default(),
            breaker: crate::registry::BreakerConfig::default(),
            migration_limit: 2,
            prefix_index_blocks: 65_536,
            cache_index_blocks: crate::registry::DEFAULT_CACHE_INDEX_BLOCKS,
            cache_events: CacheEventsMode::On,
            disagg: crate::disagg::DisaggMode::Always,
            report_faults: None,
            reasoning_parser: None,
            tool_call_parser: None,
            api_keys: None,
            shared_prefix_cache: false,
            tenant_limits: None,
            cached_token_cost: crate::limits::CachedTokenCost::DEFAULT,
            prefix_caching_hash_algo: HashAlgo::default(),
            tls: pd_tls::TlsSettings::default(),
        }
    }
}

/// The router's command line (see `router --help`).
#[derive(Debug, Clone, Args)]
pub struct RouterArgs {
    /// Model directory (Hugging Face layout) or `synthetic:<preset>`. Only config.json,
    /// generation_config.json and the tokenizer are read, never the weights.
    #[arg(
        long,
        env = "PD_MODEL",
        default_value = "synthetic:tiny",
        help_heading = "Model"
    )]
    pub model: String,

    /// Address to listen on.
    #[arg(
        long,
        env = "PD_HOST",
        default_value = "127.0.0.1",
        help_heading = "Server"
    )]
    pub host: String,

    /// Port to listen on (0: an ephemeral port, printed in the ready line).
    #[arg(long, env = "PD_PORT", default_value_t = 0, help_heading = "Server")]
    pub port: u16,

    /// Port of the Prometheus endpoint `/metrics` (on --host; 0: an ephemeral port, printed
    /// in the ready line as `metrics_addr`).
    #[arg(
        long,
        env = "PD_METRICS_PORT",
        default_value_t = 0,
        help_heading = "Server"
    )]
    pub metrics_port: u16,

    /// Port of the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
    /// `/v1/models`, `/tokenize`, `/detokenize`, `/health`; `/metrics` is on --metrics-port
    /// only), on --host; 0: an ephemeral port, printed in the ready line as `http`.
    #[arg(
        long,
        env = "PD_HTTP_PORT",
        default_value_t = 0,
        help_heading = "Server"
    )]
    pub http_port: u16,

    /// Largest client message accepted, in bytes; a larger one is refused with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "PD_MAX_MESSAGE_BYTES", default_value_t = 4 << 20, help_heading = "Server")]
    pub max_message_bytes: usize,

    /// Threads of the async runtime that carries the gRPC traffic (0: one per four CPU cores,
    /// at least one). Tokenizing text and rendering chat templates run on a separate
    /// blocking pool, so these threads only move messages; handing a request from one thread
    /// to another costs more than a second thread gains until one is busy (docs/cluster.md).
    #[arg(
        long,
        env = "PD_ROUTER_WORKER_THREADS",
        default_value_t = 0,
        help_heading = "Server"
    )]
    pub worker_threads: usize,

    /// Upper bound of a whole request, e.g. `30s`, `500ms`, `5m` (a bare number is seconds;
    /// `0` or `off`: none). The client's own deadline (grpc-timeout) applies when it is
    /// shorter.
    #[arg(long, env = "PD_REQUEST_TIMEOUT", default_value = "30m", value_parser = parse_duration_or_off, help_heading = "Server")]
    pub request_timeout: Duration,

    /// Client requests (gRPC Generate calls and HTTP completions together) served at once;
    /// more wait in the queue (--max-queue). 0: no limit.
    #[arg(
        long,
        env = "PD_MAX_INFLIGHT",
        default_value_t = 256,
        help_heading = "Admission"
    )]
    pub max_inflight: usize,

    /// Requests that may wait for a slot when --max-inflight are in flight; one more is
    /// refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After). 0: no waiting.
    #[arg(
        long,
        env = "PD_MAX_QUEUE",
        default_value_t = 128,
        help_heading = "Admission"
    )]
    pub max_queue: usize,

    /// The longest a request waits in the queue for a slot before it is refused (same syntax
    /// as --request-timeout).
    #[arg(long, env = "PD_QUEUE_TIMEOUT", default_value = "30s", value_parser = parse_duration, help_heading = "Admission")]
    pub queue_timeout: Duration,

    /// Most concurrent gRPC calls (HTTP/2 streams) one client connection may open; the
    /// client waits for more (it is told the limit when it connects).
    #[arg(long, env = "PD_MAX_CONCURRENT_STREAMS", default_value_t = pd_tls::GrpcLimits::DEFAULT_MAX_CONCURRENT_STREAMS,
          value_parser = clap::value_parser!(u32).range(1..), help_heading = "Connections")]
    pub max_concurrent_streams: u32,

    /// How often the gRPC API pings an idle client connection; a connection that does not
    /// answer within --grpc-keepalive-timeout is closed (same syntax as --request-timeout;
    /// `0` or `off`: no pings).
    #[arg(long, env = "PD_GRPC_KEEPALIVE_INTERVAL", default_value = "20s", value_parser = parse_duration_or_off, help_heading = "Connections")]
    pub grpc_keepalive_interval: Duration,

    /// How long a gRPC keepalive ping may go unanswered before the connection is closed.
    #[arg(long, env = "PD_GRPC_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = parse_duration, help_heading = "Connections")]
    pub grpc_keepalive_timeout: Duration,

    /// Age after which a gRPC client connection is asked to reconnect (GOAWAY), so clients
    /// spread over new router replicas; its calls in flight get --request-timeout to finish.
    /// `0` or `off` (the default): connections live as long as their clients keep them.
    #[arg(long, env = "PD_MAX_CONNECTION_AGE", default_value = "off", value_parser = parse_duration_or_off, help_heading = "Connections")]
    pub max_connection_age: Duration,

    /// The longest an HTTP client may take to send a request's headers, counted from when
    /// the connection opens or its previous response ends: a slow client, and a keep-alive
    /// connection left idle, is closed after it (same syntax as --request-timeout).
    #[arg(long, env = "PD_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration, help_heading = "Connections")]
    pub http_header_timeout: Duration,

    /// Most open connections of the HTTP API; further ones wait to be accepted until one
    /// closes.
    #[arg(long, env = "PD_HTTP_MAX_CONNECTIONS", default_value_t = pd_tls::HttpLimits::DEFAULT_MAX_CONNECTIONS,
          value_parser = clap::value_parser!(u32).range(1..), help_heading = "Connections")]
    pub http_max_connections: u32,

    /// A prefill node's gRPC address (`host:port`); repeat for several (the environment
    /// variable takes a comma-separated list). None: aggregated mode, each request goes whole
    /// to one decode node, which computes the prompt too.
    #[arg(
        long = "prefill",
        env = "PD_PREFILL",
        value_delimiter = ',',
        help_heading = "Nodes"
    )]
    pub prefill: Vec<String>,

    /// A decode node's gRPC address (`host:port`); repeat for several.
    #[arg(
        long = "decode",
        env = "PD_DECODE",
        value_delimiter = ',',
        required_unless_present = "decode_dns",
        help_heading = "Nodes"
    )]
    pub decode: Vec<String>,

    /// A DNS name standing for prefill nodes, `NAME:PORT` (a headless Service: one address
    /// per ready pod), re-resolved every --dns-interval: nodes that appear are health-checked
    /// and used, nodes that disappear leave routing. Repeat for several; combines with
    /// --prefill.
    #[arg(long = "prefill-dns", env = "PD_PREFILL_DNS", value_delimiter = ',',
          value_parser = prefill_dns, help_heading = "Nodes")]
    pub prefill_dns: Vec<DnsTarget>,

    /// A DNS name standing for decode nodes, `NAME:PORT` (see --prefill-dns).
    #[arg(long = "decode-dns", env = "PD_DECODE_DNS", value_delimiter = ',',
          value_parser = decode_dns, help_heading = "Nodes")]
    pub decode_dns: Vec<DnsTarget>,

    /// How often --prefill-dns / --decode-dns names are resolved again.
    #[arg(long, env = "PD_DNS_INTERVAL", default_value = "5s", value_parser = parse_duration, help_heading = "Nodes")]
    pub dns_interval: Duration,

    /// How often each node is asked for its Info (health, load, KV layout).
    #[arg(long, env = "PD_HEALTH_INTERVAL_MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Nodes")]
    pub health_interval_ms: u64,

    /// Deadline of one Info call; a node that misses it is marked down until it answers again.
    #[arg(long, env = "PD_HEALTH_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Nodes")]
    pub health_timeout_ms: u64,

    /// Deadline of a Prefill call, and the longest a decode stream may stay silent, when the
    /// request's own deadline is not shorter (same syntax as --request-timeout).
    #[arg(long, env = "PD_NODE_TIMEOUT", default_value = "120s", value_parser = parse_duration, help_heading = "Nodes")]
    pub node_timeout: Duration,

    /// How prefill nodes are chosen.
    #[arg(long, env = "PD_POLICY", value_enum, default_value_t = PolicyKind::PrefixAware, help_heading = "Routing")]
    pub policy: PolicyKind,

    /// Block hashes the prefix-aware policy's own guess remembers per node (least recently
    /// used ones are forgotten first); the guess scores a node whose cache events are not in
    /// sync.
    #[arg(long, env = "PD_PREFIX_INDEX_BLOCKS", default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Routing")]
    pub prefix_index_blocks: u64,

    /// Block entries the cache index (what every node's cache events say it holds) keeps over
    /// all nodes, about 20 bytes each; a node whose snapshot would pass it is routed to on the
    /// policy's guess instead.
    #[arg(long, env = "PD_CACHE_INDEX_BLOCKS", default_value_t = crate::registry::DEFAULT_CACHE_INDEX_BLOCKS as u64, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Routing")]
    pub cache_index_blocks: u64,

    /// Follow every node's cache events (`on`) or none (`off`: the prefix-aware policy routes
    /// on its own guess alone, and no prediction is counted).
    #[arg(long, env = "PD_CACHE_EVENTS", value_enum, default_value_t = CacheEventsMode::On, help_heading = "Routing")]
    pub cache_events: CacheEventsMode,

    /// Where prompts are computed: `always` on a prefill node (the KV then moves to the
    /// decode node), `never` (the decode node computes them itself), or `auto`: per request,
    /// whichever path the router's online measurements (each node's prefill rate, each
    /// pair's transfer rate, what is queued, what each cache holds) say reaches the second
    /// token sooner, counting the delay a local prefill puts on the decode node's streams.
    #[arg(long, env = "PD_DISAGG", value_enum, default_value_t = crate::disagg::DisaggMode::Always, help_heading = "Routing")]
    pub disagg: crate::disagg::DisaggMode,

    /// Largest max_tokens a request may ask for; an unset max_tokens is
    /// min(this, context length − prompt length).
    #[arg(long, env = "PD_MAX_TOKENS_CAP", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Requests")]
    pub max_tokens_cap: u32,

    /// HTTP chat completions: read a `<think>` block at the start of the answer out as
    /// `reasoning_content` (vLLM's `--reasoning-parser qwen3`). Unset: it stays in `content`.
    #[arg(
        long,
        env = "PD_REASONING_PARSER",
        value_enum,
        help_heading = "Requests"
    )]
    pub reasoning_parser: Option<ReasoningParser>,

    /// HTTP chat completions of requests with tools: read `<tool_call>` blocks out as
    /// `tool_calls`, finish reason `tool_calls` (vLLM's `--tool-call-parser hermes`, or
    /// `qwen3_coder` for Qwen3-Coder's `<function=…>` blocks). Unset: they stay in `content`.
    #[arg(
        long,
        env = "PD_TOOL_CALL_PARSER",
        value_enum,
        help_heading = "Requests"
    )]
    pub tool_call_parser: Option<ToolCallParser>,

    /// File of API keys, one `TENANT KEY` pair per line (`#` comments and blank lines
    /// ignored; several keys per tenant allowed). Every client request then needs
    /// `authorization: Bearer KEY` (HTTP header or gRPC metadata) and belongs to that key's
    /// tenant. The file is read again when it changes. Unset: no keys, one tenant `default`.
    #[arg(
        long,
        env = "PD_API_KEYS_FILE",
        value_name = "FILE",
        help_heading = "Clients"
    )]
    pub api_keys: Option<std::path::PathBuf>,

    /// Let tenants share cached KV: without it (and with --api-keys) each request's cache
    /// salt is derived from its tenant, so no tenant reuses, or learns of, another's prompts.
    /// For a deployment with one tenant, or tenants that trust each other.
    #[arg(long, env = "PD_SHARED_PREFIX_CACHE", help_heading = "Clients")]
    pub shared_prefix_cache: bool,

    /// File of per-tenant and per-API-key rate limits, one `SUBJECT key=value ...` line per
    /// tenant (`default`: every tenant without a line; `key:HEX`: the API key whose SHA-256
    /// starts with HEX), keys `requests_per_second`, `generation_tokens_per_second`,
    /// `prompt_tokens_per_second`, each with an optional `_burst` (docs/operations.md). A
    /// request over a limit is refused (gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After).
    /// The file is read again when it changes. Unset: no limits.
    #[arg(
        long,
        env = "PD_TENANT_LIMITS_FILE",
        value_name = "FILE",
        help_heading = "Clients"
    )]
    pub tenant_limits: Option<std::path::PathBuf>,

    /// What a cached prompt token costs against prompt_tokens_per_second limits, as a
    /// fraction of a computed one: from 0 (free) to 1 (the same). A tenant whose prompts
    /// reuse cached prefixes gets more throughput.
    #[arg(long, env = "PD_CACHED_TOKEN_COST", default_value_t = crate::limits::CachedTokenCost::DEFAULT, help_heading = "Clients")]
    pub cached_token_cost: crate::limits::CachedTokenCost,

    /// The block hash of the nodes' prefix caches: xxhash (XXH3-128; also `xxh3`) or sha256
    /// (vLLM's flag). The prefix-aware policy hashes prompts with it, and a node that reports
    /// another algorithm is not routed to (its `Info` says which it uses).
    #[arg(long, env = "PD_PREFIX_CACHING_HASH_ALGO", default_value_t = HashAlgo::Xxhash, help_heading = "Routing")]
    pub prefix_caching_hash_algo: HashAlgo,

    /// `--max-retries`, `--retry-backoff*`, `--retry-budget*`, `--circuit-breaker-*`.
    #[command(flatten)]
    pub failure: FailureArgs,

    /// `--tls-cert`, `--tls-key`, `--tls-client-ca`, `--tls-ca`, `--tls-server-name`,
    /// `--insecure`.
    #[command(flatten)]
    pub tls: pd_tls::TlsArgs,
}

impl RouterArgs {
    /// `--worker-threads`, with 0 resolved for this machine (cgroup CPU limits included).
    pub fn runtime_threads(&self) -> usize {
        if self.worker_threads > 0 {
            return self.worker_threads;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / 4).max(1)
    }

    /// The configuration these flags describe. The test-only report fault hook is read from
    /// `PD_ROUTER_REPORT_FAULTS` here (a malformed value is an error, never ignored).
    pub fn to_config(&self) -> Result<RouterConfig, crate::metrics::FaultSpecError> {
        Ok(RouterConfig {
            model: self.model.clone(),
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            prefill_dns: self.prefill_dns.clone(),
            decode_dns: self.decode_dns.clone(),
            dns_interval: self.dns_interval,
            policy: self.policy,
            max_tokens_cap: self.max_tokens_cap,
            health_interval: Duration::from_millis(self.health_interval_ms),
            health_timeout: Duration::from_millis(self.health_timeout_ms),
            max_message_bytes: self.max_message_bytes,
            reasoning_parser: self.reasoning_parser,
            tool_call_parser: self.tool_call_parser,
            request_timeout: (!self.request_timeout.is_zero()).then_some(self.request_timeout),
            admission: crate::admission::AdmissionLimits {
                max_inflight: (self.max_inflight > 0).then_some(self.max_inflight),
                max_queue: self.max_queue,
                queue_timeout: self.queue_timeout,
            },
            grpc_limits: pd_tls::GrpcLimits {
                max_concurrent_streams: self.max_concurrent_streams,
                keepalive_interval: (!self.grpc_keepalive_interval.is_zero())
                    .then_some(self.grpc_keepalive_interval),
                keepalive_timeout: self.grpc_keepalive_timeout,
                max_connection_age: (!self.max_connection_age.is_zero())
                    .then_some(self.max_connection_age),
                // An aged connection's calls get as long as any request may take.
                max_connection_age_grace: (!self.request_timeout.is_zero())
                    .then_some(self.request_timeout),
            },
            http_limits: pd_tls::HttpLimits {
                header_timeout: self.http_header_timeout,
                max_connections: self.http_max_connections as usize,
            },
            node_timeout: self.node_timeout,
            retry: self.failure.retry_policy(),
            breaker: self.failure.breaker(),
            migration_limit: self.failure.migration_limit,
            prefix_index_blocks: usize::try_from(self.prefix_index_blocks).unwrap_or(usize::MAX),
            cache_index_blocks: usize::try_from(self.cache_index_blocks).unwrap_or(usize::MAX),
            cache_events: self.cache_events,
            disagg: self.disagg,
            report_faults: crate::metrics::FaultSpec::from_env()?,
            api_keys: self.api_keys.clone(),
            shared_prefix_cache: self.shared_prefix_cache,
            tenant_limits: self.tenant_limits.clone(),
            cached_token_cost: self.cached_token_cost,
            prefix_caching_hash_algo: self.prefix_caching_hash_algo,
            tls: pd_tls::TlsSettings::default(),
        })
    }
}

fn prefill_dns(text: &str) -> Result<DnsTarget, String> {
    DnsTarget::parse(Role::Prefill, text)
}

fn decode_dns(text: &str) -> Result<DnsTarget, String> {
    DnsTarget::parse(Role::Decode, text)
}

/// `250ms`, `30s`, `5m`, `1h`, or a bare number of seconds (fractions allowed: `0.5`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (examples: 500ms, 30s, 5m, 1h)"))?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}` (use ms, s, m or h)"
            ));
        }
    };
    if !(seconds > 0.0 && seconds.is_finite()) {
        return Err(format!("`{text}` must be a positive duration"));
    }
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("`{text}`: {e}"))
}

/// [`parse_duration`], or `0` / `off` / `none` for no limit (returned as zero).
pub fn parse_duration_or_off(text: &str) -> Result<Duration, String> {
    match text.trim() {
        "0" | "off" | "none" => Ok(Duration::ZERO),
        _ => parse_duration(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0.5s"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
        assert_eq!(parse_duration_or_off("off"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_or_off("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_or_off("2s"), Ok(Duration::from_secs(2)));
        assert!(parse_duration_or_off("-1").is_err());
    }
}
