//! How well the cache index predicts what a node reuses, per node, role and tier:
//!
//! - `pd_router_prefix_predicted_tokens_total{node,role,tier}` (tier device, host): for a
//!   request routed to a node whose cache events were in sync, the prompt tokens the index
//!   said the node holds, counted the way the engine counts hits (whole blocks, never the last
//!   prompt token: [`TierMatch::tokens`]).
//! - `pd_router_prefix_delivered_tokens_total{node,role,tier}` (tier device, host, peer): for
//!   the same requests, what the node's usage says it reused: `local_cached_tokens` (device),
//!   `external_host_cached_tokens` (host), `external_peer_cached_tokens` (peer).
//!
//! Both are raised together, once per request and node step that had a prediction (the
//! prefill node's answer; the decode node's last message), so over any window
//! `predicted / delivered` compares the same requests. Requests routed on the policy's own
//! guess (no stream in sync) count in neither. Series exist for every registered node from the
//! first scrape (at 0). Not here: the nodes' own cumulative hit counters ([`super::aggregate`]).
//!
//! [`TierMatch::tokens`]: crate::cache_index::TierMatch::tokens

use std::sync::Arc;

use pd_proto::pb;

use super::exporter::{CounterVec, Exporter};
use super::ids::{Family, HitTier, label};
use crate::registry::{Node, Registry};

/// What the index predicted a node would reuse of one request's prompt, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Predicted {
    pub device: u64,
    pub host: u64,
}

/// The predicted and delivered families.
#[derive(Debug)]
pub(crate) struct PredictionSeries {
    predicted: CounterVec,
    delivered: CounterVec,
}

const LABELS: [&str; 3] = [label::NODE, label::ROLE, label::TIER];

impl PredictionSeries {
    pub fn new(exporter: &Arc<Exporter>) -> Self {
        Self {
            predicted: CounterVec::new(exporter, Family::PrefixPredictedTokens, &LABELS),
            delivered: CounterVec::new(exporter, Family::PrefixDeliveredTokens, &LABELS),
        }
    }

    /// One request's prediction on `node` and the `usage` that node answered with.
    pub fn observe(&self, node: &Node, predicted: Predicted, usage: &pb::Usage) {
        let (addr, role) = (node.addr.as_str(), node.role.as_str());
        let add = |vec: &CounterVec, tier: HitTier, n: u64| {
            let counter = vec.with_label_values(&[addr, role, tier.as_str()]);
            if n > 0 {
                counter.increment(n);
            }
        };
        add(&self.predicted, HitTier::Device, predicted.device);
        add(&self.predicted, HitTier::Host, predicted.host);
        add(
            &self.delivered,
            HitTier::Device,
            u64::from(usage.local_cached_tokens),
        );
        add(
            &self.delivered,
            HitTier::Host,
            u64::from(usage.external_host_cached_tokens),
        );
        add(
            &self.delivered,
            HitTier::Peer,
            u64::from(usage.external_peer_cached_tokens),
        );
    }

    /// Makes every registered node's series exist (at 0), so ratios are defined from the start.
    pub fn refresh(&self, registry: &Registry) {
        for node in registry.nodes() {
            let (addr, role) = (node.addr.as_str(), node.role.as_str());
            for tier in HitTier::PREDICTED {
                self.predicted.create(&[addr, role, tier.as_str()]);
            }
            for tier in HitTier::ALL {
                self.delivered.create(&[addr, role, tier.as_str()]);
            }
        }
    }
}
