//! The histograms of a node's requests and steps, fed on the engine thread: latencies and
//! token counts from every request's end (`Finished`), aborted requests and requests whose
//! client went away included, and the tokens of every engine step.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pd_engine::serve::{Finished, FinishedObserver, StepObserver, StepStats};

use super::names::{
    INTER_TOKEN_BUCKETS, ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS,
    one_two_five_buckets,
};

/// A histogram of durations or of counts: lock-free counts per bucket and the sum in whole
/// units (nanoseconds for durations, so exact; seconds only at exposition).
#[derive(Debug)]
pub struct Histogram {
    bounds: Arc<[f64]>,
    /// Per bucket, not cumulative; the last one is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_units: AtomicU64,
    /// What one unit of the sum is worth at exposition (1e-9 for nanoseconds).
    unit: f64,
}

/// A histogram's state for exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Upper bounds (seconds, or a count), without `+Inf`.
    pub bounds: Arc<[f64]>,
    /// Per bucket, not cumulative, `bounds.len() + 1` of them (the last is `+Inf`).
    pub counts: Vec<u64>,
    /// Sum of the observations (seconds, or a count).
    pub sum: f64,
}

impl HistogramSnapshot {
    /// Observations (the `+Inf` bucket and `_count`).
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

impl Histogram {
    /// A histogram of durations, bounds in seconds.
    pub fn seconds(bounds: &[f64]) -> Self {
        Self::new(bounds, 1e-9)
    }

    /// A histogram of counts (tokens).
    pub fn counts(bounds: &[f64]) -> Self {
        Self::new(bounds, 1.0)
    }

    fn new(bounds: &[f64], unit: f64) -> Self {
        Self {
            bounds: bounds.into(),
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_units: AtomicU64::new(0),
            unit,
        }
    }

    /// One duration (a histogram made by [`Histogram::seconds`]).
    pub fn observe(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.record(d.as_secs_f64(), nanos);
    }

    /// One count (a histogram made by [`Histogram::counts`]).
    pub fn observe_count(&self, n: u64) {
        self.record(n as f64, n);
    }

    fn record(&self, value: f64, units: u64) {
        // `le` is inclusive: a value equal to a bound belongs to that bucket.
        let i = self.bounds.partition_point(|&le| le < value);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_units.fetch_add(units, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            bounds: Arc::clone(&self.bounds),
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            sum: self.sum_units.load(Ordering::Relaxed) as f64 * self.unit,
        }
    }
}

/// The per-request and per-step histograms of vLLM's families.
#[derive(Debug)]
pub struct RequestHistograms {
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub queue_time: Histogram,
    pub inference_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub prompt_tokens: Histogram,
    pub generation_tokens: Histogram,
    pub max_tokens: Histogram,
    pub iteration_tokens: Histogram,
}

impl RequestHistograms {
    /// The histograms of a node whose context is `max_model_len` tokens (the token counts'
    /// buckets go 1, 2, 5, 10, ... up to it, as vLLM's).
    pub fn new(max_model_len: usize) -> Self {
        let tokens = one_two_five_buckets(max_model_len);
        Self {
            time_to_first_token: Histogram::seconds(TTFT_BUCKETS),
            inter_token_latency: Histogram::seconds(INTER_TOKEN_BUCKETS),
            e2e_request_latency: Histogram::seconds(REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::seconds(REQUEST_LATENCY_BUCKETS),
            inference_time: Histogram::seconds(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::seconds(REQUEST_LATENCY_BUCKETS),
            decode_time: Histogram::seconds(REQUEST_LATENCY_BUCKETS),
            prompt_tokens: Histogram::counts(&tokens),
            generation_tokens: Histogram::counts(&tokens),
            max_tokens: Histogram::counts(&tokens),
            iteration_tokens: Histogram::counts(ITERATION_TOKENS_BUCKETS),
        }
    }

    /// Record one request's end. As in vLLM, the time to first token only when a token was
    /// produced, and one inter-token observation per gap between generated tokens; the
    /// RUNNING phase is prefill and decode together.
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
        self.inference_time.observe(t.prefill + t.decode);
        self.prefill_time.observe(t.prefill);
        self.decode_time.observe(t.decode);
        let u = &finished.usage;
        self.prompt_tokens.observe_count(u.prompt_tokens as u64);
        // Tokens sampled here, as `vllm:generation_tokens_total` counts them.
        self.generation_tokens
            .observe_count(finished.sampled_tokens as u64);
        self.max_tokens
            .observe_count(u64::from(finished.max_tokens));
    }

    /// Record one engine step: the tokens it computed (prompt chunks and decode tokens).
    pub fn observe_step(&self, step: &StepStats) {
        self.iteration_tokens.observe_count(step.tokens as u64);
    }

    /// The engine-thread hooks that feed `self`: every request's end and every step.
    pub fn observers(self: &Arc<Self>) -> (FinishedObserver, StepObserver) {
        let finished = Arc::clone(self);
        let step = Arc::clone(self);
        (
            Box::new(move |f| finished.observe(f)),
            Box::new(move |s| step.observe_step(s)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_the_rest_is_inf() {
        let h = Histogram::seconds(&[0.5, 1.0]);
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_millis(1000));
        h.observe(Duration::from_millis(1001));
        h.observe(Duration::ZERO);
        let s = h.snapshot();
        assert_eq!(s.counts, vec![2, 1, 1]);
        assert_eq!(s.count(), 4);
        assert!((s.sum - 2.501).abs() < 1e-12);
    }

    #[test]
    fn counts_sum_exactly_and_fall_in_inclusive_buckets() {
        let h = Histogram::counts(&[1.0, 2.0, 5.0]);
        for n in [0, 1, 2, 3, 5, 6, 1_000_000] {
            h.observe_count(n);
        }
        let s = h.snapshot();
        assert_eq!(s.counts, vec![2, 1, 2, 2]);
        assert_eq!(s.sum, 1_000_017.0);
    }
}
