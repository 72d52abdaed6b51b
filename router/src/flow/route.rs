//! Where a request's prompt is computed (`--disagg`, see [`crate::disagg`]): the decision
//! before anything goes to a node, the nodes it settled on (taken first by the prefill and
//! decode steps while they are still candidates), and what each step measures for the next
//! decisions. Not here: the steps themselves (the parent module and [`super::decode`]).

use std::sync::Arc;
use std::time::Duration;

use crate::disagg::{Decision, DisaggMode, LocalOption, Path, Reason, RemoteOption};
use crate::metrics::Predicted;
use crate::registry::Node;

use super::Job;

/// The nodes a decision settled on, taken by the steps that send work to nodes.
#[derive(Debug, Default)]
pub(super) struct Preferred {
    pub prefill: Option<Arc<Node>>,
    pub decode: Option<Arc<Node>>,
}

impl Preferred {
    /// `slot`'s node if it is among `candidates` (it may have gone down meanwhile); the slot
    /// is emptied either way: retries choose afresh.
    pub fn take(slot: &mut Option<Arc<Node>>, candidates: &[Arc<Node>]) -> Option<Arc<Node>> {
        slot.take()
            .filter(|n| candidates.iter().any(|c| c.id == n.id))
    }
}

fn block_size(node: &Node) -> u64 {
    node.block_size() as u64
}

/// The prompt tokens the cache index says `predicted` covers (none without a prediction).
pub(super) fn hit_tokens(predicted: Option<Predicted>) -> u64 {
    predicted.map_or(0, |p| p.device + p.host)
}

impl Job {
    /// What the cache index predicts `node` reuses of the prompt, looked up once per node and
    /// request (the decision and the steps after it ask for the same nodes).
    pub(super) fn predict(&mut self, node: &Node) -> Option<Predicted> {
        if let Some((_, p)) = self.predictions.iter().find(|(id, _)| *id == node.id) {
            return *p;
        }
        let p = self.shared.predict(&self.req, node);
        self.predictions.push((node.id, p));
        p
    }

    /// Decides where the prompt is computed, counts and logs the decision, and leaves the
    /// chosen nodes in `self.preferred`.
    pub(super) fn route(&mut self) -> Path {
        let decision = match self.shared.disagg.mode {
            DisaggMode::Always => Decision::fixed(Path::Remote, Reason::Setting),
            DisaggMode::Never => Decision::fixed(Path::Local, Reason::Setting),
            DisaggMode::Auto => self.auto(),
        };
        (self.shared.metrics).disagg_decided(decision.path, decision.reason);
        tracing::debug!(
            request_id = %self.req.request_id,
            path = decision.path.as_str(),
            reason = decision.reason.as_str(),
            remote_seconds = decision.remote_seconds,
            local_seconds = decision.local_seconds,
            prefill = self.preferred.prefill.as_ref().map(|n| n.addr.as_str()),
            decode = self.preferred.decode.as_ref().map(|n| n.addr.as_str()),
            "disaggregation decided"
        );
        decision.path
    }

    fn auto(&mut self) -> Decision {
        let registry = self.shared.registry.clone();
        let Ok(decodes) = registry.decode_candidates(None, &[]) else {
            return Decision::fixed(Path::Remote, Reason::NoDecodeNode);
        };
        let Ok(prefills) = registry.prefill_candidates(&[]) else {
            self.preferred.decode = Some(self.shared.pick_by_policy(&self.req, &decodes));
            return Decision::fixed(Path::Local, Reason::NoPrefillNode);
        };
        let prefill = self.shared.pick_by_policy(&self.req, &prefills);
        // The decode node a local prefill would run on, as `never` (and aggregated mode)
        // chooses it: the prompt-computing policy, cache affinity balanced by load. The
        // remote path is priced towards the same node, so the two differ only in where the
        // prompt is computed.
        let decode = self.shared.pick_by_policy(&self.req, &decodes);
        let prompt = self.req.prompt.len() as u64;
        let decode_hits = hit_tokens(self.predict(&decode));
        let bs = block_size(&decode);
        let remote = RemoteOption {
            prefill: prefill.id,
            decode: decode.id,
            prefill_hits: hit_tokens(self.predict(&prefill)),
            pulled_blocks: prompt.div_ceil(bs).saturating_sub(decode_hits / bs),
            moves_kv: !self.ends_with_first_token(),
            streams: decode.inflight(),
        };
        let local = LocalOption {
            decode: decode.id,
            hits: decode_hits,
            streams: decode.inflight(),
        };
        let decision = self.shared.disagg.decide(prompt, &remote, &[local]);
        if decision.path == Path::Remote {
            self.preferred.prefill = Some(prefill);
        }
        self.preferred.decode = Some(decode);
        decision
    }

    /// A prefill node answered: `computed` prompt tokens (after `ahead` queued on it) took
    /// `elapsed`; its KV blocks are `block_bytes` each (0: no lease).
    pub(super) fn measured_prefill(
        &self,
        node: &Node,
        computed: u64,
        ahead: u64,
        elapsed: Duration,
        block_bytes: u64,
    ) {
        let costs = &self.shared.disagg.costs;
        costs.prefilled(node.id, computed + ahead, elapsed.as_secs_f64());
        if block_bytes > 0 {
            costs.saw_block_bytes(node.id, block_bytes);
        }
    }

    /// A decode node's first message came `elapsed` after `Decode`: with a handle, it pulled
    /// the blocks it lacked of `kv` from `from`; without, it computed the prompt tokens its
    /// cache lacked (after `ahead` queued on it).
    pub(super) fn measured_first_message(
        &self,
        node: &Node,
        kv: Option<(&crate::registry::Node, &pd_proto::pb::KvHandle)>,
        predicted: Option<Predicted>,
        ahead: u64,
        elapsed: Duration,
    ) {
        let costs = &self.shared.disagg.costs;
        let hits = hit_tokens(predicted);
        match kv {
            Some((from, kv)) => {
                let held = hits / block_size(node);
                let pulled = u64::from(kv.num_blocks).saturating_sub(held);
                let bytes = pulled * kv.block_bytes;
                costs.transferred(from.id, node.id, bytes, elapsed.as_secs_f64());
            }
            None => {
                let computed = (self.req.prompt.len() as u64).saturating_sub(hits);
                costs.computed_locally(node.id, computed + ahead, elapsed.as_secs_f64());
            }
        }
    }
}
