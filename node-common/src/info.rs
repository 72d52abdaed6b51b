//! `Info`: what a node reports about itself.

use std::net::SocketAddr;

use pd_engine::serve::Role;
use pd_proto::pb;

use crate::metrics::NodeMetrics;
use crate::model::ModelFacts;
use crate::requests::Requests;

/// Free KV blocks as of the engine's last published counters (cached blocks nobody uses
/// count as free: they are evictable).
pub fn free_blocks(facts: &ModelFacts, requests: &Requests) -> usize {
    let usage = requests.engine().counters().kv_cache_usage;
    let in_use = (usage * facts.num_blocks as f64).round() as usize;
    facts.num_blocks.saturating_sub(in_use)
}

/// The node's `NodeInfo`, its cumulative counters included.
pub fn node_info(
    facts: &ModelFacts,
    requests: &Requests,
    role: Role,
    kv_addr: Option<SocketAddr>,
    metrics: &NodeMetrics,
) -> pb::NodeInfo {
    let counters = requests.engine().counters();
    let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    pb::NodeInfo {
        model: facts.served_name.clone(),
        role: pd_proto::convert::wire_role(role) as i32,
        layout_fingerprint: facts.fingerprint.to_string(),
        block_size: n(facts.block_size()),
        num_blocks: facts.num_blocks as u64,
        free_blocks: free_blocks(facts, requests) as u64,
        num_running: u32::try_from(counters.num_running).unwrap_or(u32::MAX),
        num_waiting: u32::try_from(counters.num_waiting).unwrap_or(u32::MAX),
        kv_transport_addr: kv_addr.map(|a| a.to_string()).unwrap_or_default(),
        vocab_size: n(facts.vocab_size),
        max_model_len: n(facts.max_model_len),
        healthy: requests.engine().is_healthy() && !requests.is_draining(),
        counters: Some(metrics.counter_report()),
        kv_cache_dtype: facts.kv_dtype().torch_name().into(),
        prefix_caching_hash_algo: facts.hash_algo.as_str().into(),
    }
}
