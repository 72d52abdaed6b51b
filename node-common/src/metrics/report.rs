//! The node's `CounterReport`: its cumulative counters under its epoch, for the router's
//! aggregation (which turns totals into deltas per node and epoch; see
//! router/src/metrics/aggregate.rs). Built in one place, [`counter_report`], and sent in
//! `NodeInfo.counters`, `PrefillResponse.counters` and the last `DecodeResponse.counters`.

use pd_engine::sampling::FinishReason;
use pd_engine::serve::{EngineCounters, TierKind};
use pd_proto::pb;
use pd_transport::TransferCounts;

use super::names::{FINISH_REASONS, finished_reason};

/// The `requests_finished` key of requests the engine failed.
pub const FINISHED_ERROR: &str = "error";

/// A node process's identity for its counters: random, nonzero, fixed for the life of the
/// process, so a restarted node is told apart from one whose reports were lost. Below 2^53 so
/// that the `pd_node_epoch` gauge (a float) shows it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Epoch(u64);

impl Epoch {
    /// The largest epoch + 1: floats hold every integer below it exactly.
    const LIMIT: u64 = 1 << 53;

    /// A new random epoch.
    pub fn random() -> Self {
        Self(rand::random_range(1..Self::LIMIT))
    }

    pub fn get(self) -> u64 {
        self.0
    }
}

/// Requests the engine ended with `reason`.
pub fn requests_finished(engine: &EngineCounters, reason: FinishReason) -> u64 {
    match reason {
        FinishReason::Stop => engine.requests_finished_stop,
        FinishReason::Length => engine.requests_finished_length,
        FinishReason::Abort => engine.requests_finished_abort,
    }
}

/// Everything this node has counted, as the router receives it. The engine's counters are
/// published before a request's end is delivered, so a report built when a request ends
/// includes that request's counts.
pub fn counter_report(
    epoch: Epoch,
    engine: &EngineCounters,
    transfers: &TransferCounts,
) -> pb::CounterReport {
    let mut requests_finished: std::collections::HashMap<String, u64> = FINISH_REASONS
        .iter()
        .map(|&r| (finished_reason(r).to_string(), requests_finished(engine, r)))
        .collect();
    requests_finished.insert(FINISHED_ERROR.to_string(), engine.requests_failed);
    pb::CounterReport {
        epoch: epoch.get(),
        prefix_cache_queries: engine.prefix_cache_queries,
        prefix_cache_hits: engine.prefix_cache_hits,
        external_prefix_cache_queries: engine.external_prefix_cache_queries,
        external_prefix_cache_hits: engine.external_prefix_cache_hits,
        external_prefix_cache_hits_host: engine.external_prefix_cache_hits_by_source
            [TierKind::Host],
        external_prefix_cache_hits_peer: engine.external_prefix_cache_hits_by_source
            [TierKind::Peer],
        prompt_tokens: engine.prompt_tokens(),
        generation_tokens: engine.generation_tokens,
        preemptions: engine.preemptions,
        requests_finished,
        kv_transfer_bytes: transfers.bytes,
        kv_transfers: transfers.transfers,
        kv_transfer_seconds_sum: transfers.seconds_sum,
        kv_transfer_failures: transfers
            .failures
            .iter()
            .map(|(reason, n)| (reason.as_str().to_string(), *n))
            .collect(),
        kv_leases_expired: engine.kv_leases_expired,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_engine::serve::PerTier;

    #[test]
    fn epochs_are_nonzero_float_exact_and_differ() {
        let a = Epoch::random();
        let b = Epoch::random();
        assert_ne!(a, b);
        for e in [a, b] {
            assert!(e.get() > 0 && e.get() < Epoch::LIMIT);
            assert_eq!(e.get() as f64 as u64, e.get());
        }
    }

    #[test]
    fn the_report_carries_every_counter() {
        let engine = EngineCounters {
            prefix_cache_queries: 40,
            prefix_cache_hits: 16,
            external_prefix_cache_queries: 24,
            external_prefix_cache_hits: 8,
            external_prefix_cache_hits_by_source: {
                let mut by = PerTier::only(TierKind::Host, 3);
                by[TierKind::Peer] = 5;
                by
            },
            prompt_tokens_computed: 16,
            prompt_tokens_local_cache: 16,
            prompt_tokens_external: 8,
            generation_tokens: 5,
            requests_finished_stop: 1,
            requests_finished_abort: 2,
            requests_failed: 3,
            preemptions: 4,
            kv_leases_expired: 6,
            ..Default::default()
        };
        let stats = pd_transport::TransferStats::default();
        stats.record_ok(4096, std::time::Duration::from_millis(2));
        stats.record_failure(pd_transport::FailureReason::Checksum);
        let r = counter_report(Epoch(7), &engine, &stats.snapshot());
        assert_eq!(r.epoch, 7);
        assert_eq!((r.prefix_cache_queries, r.prefix_cache_hits), (40, 16));
        assert_eq!(
            (
                r.external_prefix_cache_queries,
                r.external_prefix_cache_hits
            ),
            (24, 8)
        );
        assert_eq!(
            (
                r.external_prefix_cache_hits_host,
                r.external_prefix_cache_hits_peer
            ),
            (3, 5)
        );
        assert_eq!(
            (r.prompt_tokens, r.generation_tokens, r.preemptions),
            (40, 5, 4)
        );
        assert_eq!(r.requests_finished["stop"], 1);
        assert_eq!(r.requests_finished["length"], 0);
        assert_eq!(r.requests_finished["abort"], 2);
        assert_eq!(r.requests_finished["error"], 3);
        assert_eq!((r.kv_transfer_bytes, r.kv_transfers), (4096, 1));
        assert!((r.kv_transfer_seconds_sum - 0.002).abs() < 1e-12);
        assert_eq!(r.kv_transfer_failures["checksum"], 1);
        assert_eq!(r.kv_transfer_failures["timeout"], 0);
        assert_eq!(r.kv_leases_expired, 6);
    }
}
