//! Prefix-cache accounting and the engine's cumulative counters.
//!
//! The rules (docs/accounting.md): a request is looked up once,
//! when it is first scheduled; the outcome is an `Option` set right there (`None` when the
//! cache is disabled or the request needs prompt logprobs, so nothing is counted). Units are
//! tokens. Hits are whole blocks and never cover the last prompt token. Local hits come from
//! the device tier; external queries are what the local lookup left, external hits what was
//! restored from another tier, split by tier (host, peer: `super::external::PerTier`) so that
//! per request `computed + local + host + peer == prompt tokens`. A preempted request re-admitted later is not counted again,
//! and an aborted request keeps its counts. Counters only ever grow: whoever reports them
//! across a process boundary converts totals into deltas in one place (the router:
//! `router/src/metrics/aggregate.rs`).

use super::external::PerTier;
use crate::kv::prefix::tier::TierKind;

/// The result of a request's one prefix lookup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixOutcome {
    /// Prompt tokens looked up (the whole prompt).
    pub queries: usize,
    /// Tokens found in the device tier.
    pub local_hits: usize,
    /// Tokens left after the local lookup (`queries - local_hits`).
    pub external_queries: usize,
    /// Tokens restored from another tier: the sum of `external_by_source`.
    pub external_hits: usize,
    /// `external_hits` by where the KV came from.
    pub external_by_source: PerTier<usize>,
}

impl PrefixOutcome {
    /// `external` holds the external hits of each source; their sum is `external_hits`.
    pub fn new(prompt_tokens: usize, local_hits: usize, external: PerTier<usize>) -> Self {
        let external_hits = external.total();
        // Hits never exceed the prompt; a local lookup never covers the last prompt token
        // (the engine caps it), while KV received from a prefill node may cover the whole
        // prompt on a decode node.
        assert!(
            local_hits + external_hits <= prompt_tokens,
            "hits exceed the prompt"
        );
        Self {
            queries: prompt_tokens,
            local_hits,
            external_queries: prompt_tokens - local_hits,
            external_hits,
            external_by_source: external,
        }
    }

    /// Prompt tokens whose KV this node computed: neither local nor external hits.
    pub fn computed(&self) -> usize {
        self.queries - self.local_hits - self.external_hits
    }
}

/// Monotonic totals since the engine started, and the current gauges.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineCounters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub external_prefix_cache_queries: u64,
    pub external_prefix_cache_hits: u64,
    /// `external_prefix_cache_hits` by source; they sum to it.
    pub external_prefix_cache_hits_by_source: PerTier<u64>,
    /// Prompt tokens by source, counted once per request at its first admission.
    pub prompt_tokens_computed: u64,
    pub prompt_tokens_local_cache: u64,
    /// The sum of `prompt_tokens_external_by_source`.
    pub prompt_tokens_external: u64,
    pub prompt_tokens_external_by_source: PerTier<u64>,
    pub generation_tokens: u64,
    pub requests_finished_stop: u64,
    pub requests_finished_length: u64,
    pub requests_finished_abort: u64,
    pub requests_failed: u64,
    pub preemptions: u64,
    /// Prefill leases released by their deadline rather than by a caller.
    pub kv_leases_expired: u64,
    /// Requests admitted with imported KV that landed in place in reserved blocks.
    pub kv_imports_in_place: u64,
    /// Requests admitted with imported KV the puller had copied into reserved device
    /// blocks (off the engine thread).
    pub kv_imports_device_copy: u64,
    /// Requests admitted with imported KV the puller had copied from buffers into host KV
    /// blocks reserved when its pull ended (no room when it began; off the engine thread).
    pub kv_imports_host_copy: u64,
    /// Requests admitted with imported KV in buffers, copied into KV storage at admission.
    pub kv_imports_buffered: u64,
    /// Gauges (current values, not totals).
    pub num_running: u64,
    pub num_waiting: u64,
    /// Fraction of KV blocks in use by requests.
    pub kv_cache_usage: f64,
}

impl EngineCounters {
    /// Count one request's first admission. `outcome` is `None` when no lookup happened.
    pub fn on_admitted(&mut self, prompt_tokens: usize, outcome: Option<&PrefixOutcome>) {
        let (local, external) = match outcome {
            Some(o) => {
                self.prefix_cache_queries += o.queries as u64;
                self.prefix_cache_hits += o.local_hits as u64;
                self.external_prefix_cache_queries += o.external_queries as u64;
                self.external_prefix_cache_hits += o.external_hits as u64;
                (o.local_hits, o.external_by_source)
            }
            None => (0, PerTier::default()),
        };
        for (source, hits) in external.iter() {
            let hits = hits as u64;
            self.external_prefix_cache_hits_by_source[source] += hits;
            self.prompt_tokens_external_by_source[source] += hits;
        }
        self.prompt_tokens_local_cache += local as u64;
        self.prompt_tokens_external += external.total() as u64;
        self.prompt_tokens_computed += (prompt_tokens - local - external.total()) as u64;
    }

    /// Prompt tokens of one external source (see `prompt_tokens_external_by_source`).
    pub fn prompt_tokens_from(&self, source: TierKind) -> u64 {
        self.prompt_tokens_external_by_source[source]
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens_computed + self.prompt_tokens_local_cache + self.prompt_tokens_external
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_lookup_counts_no_queries_but_the_prompt() {
        let mut c = EngineCounters::default();
        c.on_admitted(40, None);
        assert_eq!(c.prefix_cache_queries, 0);
        assert_eq!(c.prompt_tokens_computed, 40);
    }

    #[test]
    fn external_queries_are_what_local_left() {
        let mut c = EngineCounters::default();
        c.on_admitted(
            40,
            Some(&PrefixOutcome::new(
                40,
                16,
                PerTier::only(TierKind::Host, 16),
            )),
        );
        assert_eq!(
            (
                c.prefix_cache_queries,
                c.prefix_cache_hits,
                c.external_prefix_cache_queries,
                c.external_prefix_cache_hits
            ),
            (40, 16, 24, 16)
        );
        assert_eq!(
            (
                c.prompt_tokens_local_cache,
                c.prompt_tokens_external,
                c.prompt_tokens_computed
            ),
            (16, 16, 8)
        );
    }

    #[test]
    fn external_hits_split_by_source_sum_to_the_external_total() {
        let mut c = EngineCounters::default();
        c.on_admitted(
            40,
            Some(&PrefixOutcome::new(
                40,
                16,
                PerTier::only(TierKind::Host, 16),
            )),
        );
        // A decode node's import: 16 local, the rest received from the prefill node.
        let mut peer = PerTier::default();
        peer[TierKind::Peer] = 24;
        let o = PrefixOutcome::new(40, 16, peer);
        assert_eq!(o.computed(), 0);
        c.on_admitted(40, Some(&o));
        let by = c.external_prefix_cache_hits_by_source;
        assert_eq!((by[TierKind::Host], by[TierKind::Peer]), (16, 24));
        assert_eq!(by.total(), c.external_prefix_cache_hits);
        assert_eq!(
            c.prompt_tokens_external_by_source.total(),
            c.prompt_tokens_external
        );
        assert_eq!(c.prompt_tokens_from(TierKind::Peer), 24);
        assert_eq!(
            c.prompt_tokens_computed
                + c.prompt_tokens_local_cache
                + c.prompt_tokens_from(TierKind::Host)
                + c.prompt_tokens_from(TierKind::Peer),
            80
        );
    }
}
