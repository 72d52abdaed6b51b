//! A node's metrics: the `/metrics` endpoint (vLLM's families plus `pd_node_*` KV-transfer
//! families; docs/metrics.md lists them all) and the `CounterReport` the router aggregates.
//!
//! - [`names`]: every family, label name and label value, defined once.
//! - [`histogram`]: the per-request latency histograms, fed on the engine thread by every
//!   request's end (aborted ones and those whose client went away included).
//! - [`encode`]: the text exposition format, written as vLLM writes it.
//! - [`node`]: [`NodeMetrics`], reading the engine's counters, the transport's counters and
//!   the histograms at each scrape.
//! - [`report`]: the node's epoch and its `CounterReport`.
//! - [`http`]: the HTTP server.

pub mod encode;
pub mod histogram;
pub mod http;
pub mod names;
pub mod node;
pub mod report;

pub use histogram::RequestHistograms;
pub use node::NodeMetrics;
pub use report::{Epoch, counter_report};
