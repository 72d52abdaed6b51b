//! pd-router: the client-facing gRPC service of the PD cluster.
//!
//! A client's `pd.v1.Generation` request is validated into a typed request
//! ([`validation`]), tokenized (chat template for chat input), routed to a prefill node and a
//! decode node by a [`policy`] (by what the nodes' caches hold, as their cache events tell the
//! [`cache_index`], and by load), among the nodes the [`registry`] knows to be up and
//! KV-compatible; the router then streams the decode node's tokens back as text
//! (`flow`: incremental detokenization, stop strings, usage, cancellation and retries).
//! A request a node failed is retried elsewhere within limits ([`retry`]: backoff, budget),
//! never after an engine panic; nodes that keep failing are skipped for a while (their
//! circuit breakers, [`registry::Breaker`]).
//!
//! Tenants can be held to token-bucket limits that price cached prompt tokens below computed
//! ones ([`limits`]).
//!
//! Every node's counters, client-perceived latencies and node health are exported under
//! `pd_router_*` on `/metrics` ([`metrics`]).
//!
//! The same requests are served over HTTP in OpenAI's shape ([`openai`]: completions and
//! chat completions, streamed as server-sent events), through the same service.
//! Chat answers are read for reasoning and tool calls by one parser on both APIs ([`parse`]).
//!
//! The library is what the `router` binary runs, and what tests embed:
//! [`serve`]`(config, listener, shutdown)`.
//!
//! Depends on `pd-engine` only for shared types (tokenizer, text stream, block hashes,
//! sampling parameters), never on pd-kernels or pd-transport.

pub mod admission;
mod answer;
pub mod auth;
pub mod cache_index;
mod choices;
pub mod config;
pub mod disagg;
pub mod discovery;
pub mod error;
mod flow;
pub mod limits;
pub mod metrics;
pub mod openai;
pub mod parse;
pub mod policy;
pub mod registry;
pub mod retry;
mod server;
mod service;
pub mod tenant;
pub mod validation;
mod watched;

pub use config::{CacheEventsMode, PolicyKind, RouterArgs, RouterConfig};
pub use error::{NodeError, RouterError};
pub use metrics::RouterMetrics;
pub use server::{Router, serve};
pub use service::{GenerationService, grpc_timeout};
