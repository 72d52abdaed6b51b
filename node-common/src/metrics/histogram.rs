//! Latency histograms of a node's requests, fed from every request's end on the engine thread
//! (`Finished.timings`), aborted requests and requests whose client went away included.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pd_engine::serve::{Finished, FinishedObserver};

use super::names::{INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS};

/// A histogram of durations: lock-free counts per bucket and the sum in nanoseconds (exact
/// for durations; seconds only at exposition).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, not cumulative; the last one is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
}

/// A histogram's state for exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Upper bounds in seconds, without `+Inf`.
    pub bounds: &'static [f64],
    /// Per bucket, not cumulative, `bounds.len() + 1` of them (the last is `+Inf`).
    pub counts: Vec<u64>,
    /// Sum of the observations in seconds.
    pub sum: f64,
}

impl HistogramSnapshot {
    /// Observations (the `+Inf` bucket and `_count`).
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        // `le` is inclusive: a value equal to a bound belongs to that bucket.
        let i = self.bounds.partition_point(|&le| le < secs);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            bounds: self.bounds,
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            sum: self.sum_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// The per-request histograms of vLLM's families.
#[derive(Debug)]
pub struct RequestHistograms {
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
}

impl Default for RequestHistograms {
    fn default() -> Self {
        Self {
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(INTER_TOKEN_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
        }
    }
}

impl RequestHistograms {
    /// Record one request's end. As in vLLM, the time to first token only when a token was
    /// produced, and one inter-token observation per gap between generated tokens.
    pub fn observe(&self, finished: &Finished) {
        let t = &finished.timings;
        if let Some(ttft) = t.time_to_first_token {
            self.time_to_first_token.observe(ttft);
        }
        for &gap in &t.inter_token {
            self.inter_token_latency.observe(gap);
        }
        self.e2e_request_latency.observe(t.end_to_end);
        self.queue_time.observe(t.queue);
        self.prefill_time.observe(t.prefill);
        self.decode_time.observe(t.decode);
    }

    /// The engine-thread hook that feeds `self`.
    pub fn observer(self: &std::sync::Arc<Self>) -> FinishedObserver {
        let this = std::sync::Arc::clone(self);
        Box::new(move |finished| this.observe(finished))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_the_rest_is_inf() {
        let h = Histogram::new(&[0.5, 1.0]);
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_millis(1000));
        h.observe(Duration::from_millis(1001));
        h.observe(Duration::ZERO);
        let s = h.snapshot();
        assert_eq!(s.counts, vec![2, 1, 1]);
        assert_eq!(s.count(), 4);
        assert!((s.sum - 2.501).abs() < 1e-12);
    }
}
