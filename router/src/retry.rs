//! When a request that failed on a node is tried again on another: at most `--max-retries`
//! times per step (prefill, decode), after an exponential backoff with full jitter, and only
//! while the cluster-wide retry budget allows.
//!
//! **Backoff**: before retry number `n` (0 for the first), the router waits a random time in
//! `[0, min(--retry-backoff-max, --retry-backoff × 2^n))` ("full jitter"), so that requests
//! that failed together do not all land on the next node at the same instant.
//!
//! **Budget** (as Finagle's and Envoy's retry budgets): over the last [`BUDGET_WINDOW`],
//! retries may be at most `--retry-budget` × the client requests that arrived, or
//! `--retry-budget-min` per second, whichever is more. When a node fails most requests, the
//! retries it causes stay a bounded fraction of the traffic instead of doubling it (a retry
//! storm); a quiet cluster still retries its occasional failure.
//!
//! What is retried at all (a node's failure, never the request's own error or an engine
//! panic) is [`crate::error::NodeError::is_retryable`]'s call. Time and randomness are passed
//! in, so that both are tested without sleeping.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The span the retry budget looks back over.
pub const BUDGET_WINDOW: Duration = Duration::from_secs(10);

/// The budget counts in slots of this length (the window slides by one slot at a time).
const SLOT: Duration = Duration::from_secs(1);

/// `--max-retries`, `--retry-backoff`, `--retry-backoff-max`, `--retry-budget`,
/// `--retry-budget-min`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Retries of one request per step (prefill, decode) after a node's failure.
    pub max_retries: u32,
    /// The backoff's base: the first retry waits up to this long.
    pub backoff: Duration,
    /// The backoff's cap.
    pub backoff_max: Duration,
    /// Retries allowed as a fraction of the client requests in the budget window.
    pub budget_ratio: f64,
    /// Retries per second allowed whatever the traffic.
    pub budget_min_per_sec: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 1,
            backoff: Duration::from_millis(25),
            backoff_max: Duration::from_secs(1),
            budget_ratio: 0.2,
            budget_min_per_sec: 10.0,
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `attempt` (0 for the first), for a uniform random
    /// `jitter` in `[0, 1)`.
    pub fn backoff(&self, attempt: u32, jitter: f64) -> Duration {
        let ceiling = self
            .backoff
            .saturating_mul(2u32.saturating_pow(attempt.min(31)))
            .min(self.backoff_max);
        ceiling.mul_f64(jitter.clamp(0.0, 1.0))
    }
}

/// Why a failed request is not retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// It was retried `--max-retries` times already.
    MaxRetries,
    /// The retry budget is spent.
    Budget,
}

/// Client requests and retries per slot, over the budget window.
#[derive(Debug)]
struct Window {
    /// (slot number since `origin`, requests, retries), oldest first.
    slots: VecDeque<(u64, u64, u64)>,
    origin: Instant,
}

impl Window {
    fn slot_of(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.origin).as_nanos() / SLOT.as_nanos()) as u64
    }

    /// Drops slots older than the window; returns the current slot's entry.
    fn current(&mut self, now: Instant) -> &mut (u64, u64, u64) {
        let slot = self.slot_of(now);
        let slots_per_window = (BUDGET_WINDOW.as_nanos() / SLOT.as_nanos()) as u64;
        while self
            .slots
            .front()
            .is_some_and(|(s, _, _)| s + slots_per_window <= slot)
        {
            self.slots.pop_front();
        }
        if self.slots.back().is_none_or(|(s, _, _)| *s != slot) {
            self.slots.push_back((slot, 0, 0));
        }
        self.slots.back_mut().expect("just pushed")
    }

    fn totals(&self) -> (u64, u64) {
        self.slots
            .iter()
            .fold((0, 0), |(q, r), (_, sq, sr)| (q + sq, r + sr))
    }
}

/// The router's retry policy and budget (one per router, shared by every request).
#[derive(Debug)]
pub struct Retries {
    policy: RetryPolicy,
    window: Mutex<Window>,
}

impl Retries {
    pub fn new(policy: RetryPolicy, now: Instant) -> Self {
        Self {
            policy,
            window: Mutex::new(Window {
                slots: VecDeque::new(),
                origin: now,
            }),
        }
    }

    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        // Counts only: a panic elsewhere cannot leave them torn.
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A client request arrived: it adds to what the budget allows.
    pub fn request(&self, now: Instant) {
        self.window().current(now).1 += 1;
    }

    /// Whether a request that failed after `attempt` retries (0: none yet) may be retried
    /// now; if so the retry is counted against the budget and the wait before it returned
    /// (`jitter`: uniform in `[0, 1)`).
    pub fn admit(&self, attempt: u32, now: Instant, jitter: f64) -> Result<Duration, Denied> {
        if attempt >= self.policy.max_retries {
            return Err(Denied::MaxRetries);
        }
        let mut window = self.window();
        window.current(now);
        let (requests, retries) = window.totals();
        let floor = self.policy.budget_min_per_sec * BUDGET_WINDOW.as_secs_f64();
        let allowed = floor.max(self.policy.budget_ratio * requests as f64);
        if retries as f64 + 1.0 > allowed {
            return Err(Denied::Budget);
        }
        window.current(now).2 += 1;
        Ok(self.policy.backoff(attempt, jitter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(ratio: f64, min_per_sec: f64, max_retries: u32) -> RetryPolicy {
        RetryPolicy {
            max_retries,
            backoff: Duration::from_millis(100),
            backoff_max: Duration::from_millis(1000),
            budget_ratio: ratio,
            budget_min_per_sec: min_per_sec,
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_jitter_scales_it() {
        let p = policy(0.2, 0.0, 5);
        let top = |attempt| p.backoff(attempt, 0.999_999);
        assert!(top(0) <= Duration::from_millis(100) && top(0) > Duration::from_millis(99));
        assert!(top(1) > Duration::from_millis(199) && top(1) <= Duration::from_millis(200));
        assert!(top(2) > Duration::from_millis(399) && top(2) <= Duration::from_millis(400));
        assert_eq!(p.backoff(10, 1.0), Duration::from_millis(1000));
        assert_eq!(p.backoff(u32::MAX, 1.0), Duration::from_millis(1000));
        assert_eq!(p.backoff(3, 0.0), Duration::ZERO);
        assert_eq!(p.backoff(1, 0.5), Duration::from_millis(100));
    }

    #[test]
    fn the_budget_allows_a_fraction_of_recent_requests() {
        let t0 = Instant::now();
        let retries = Retries::new(policy(0.2, 0.0, 1), t0);
        for _ in 0..10 {
            retries.request(t0);
        }
        // 20 % of 10 requests: two retries, then none.
        assert!(retries.admit(0, t0, 0.5).is_ok());
        assert!(retries.admit(0, t0, 0.5).is_ok());
        assert_eq!(retries.admit(0, t0, 0.5), Err(Denied::Budget));
        // More traffic, more budget.
        for _ in 0..5 {
            retries.request(t0 + SLOT);
        }
        assert!(retries.admit(0, t0 + SLOT, 0.5).is_ok());
        assert_eq!(retries.admit(0, t0 + SLOT, 0.5), Err(Denied::Budget));
    }

    #[test]
    fn the_window_forgets_old_requests_and_retries() {
        let t0 = Instant::now();
        let retries = Retries::new(policy(0.5, 0.0, 1), t0);
        for _ in 0..4 {
            retries.request(t0);
        }
        assert!(retries.admit(0, t0, 0.0).is_ok());
        assert!(retries.admit(0, t0, 0.0).is_ok());
        assert_eq!(retries.admit(0, t0, 0.0), Err(Denied::Budget));
        // A window later, both the requests and the retries have aged out: nothing allowed
        // without new requests...
        let later = t0 + BUDGET_WINDOW;
        assert_eq!(retries.admit(0, later, 0.0), Err(Denied::Budget));
        // ...and new requests bring budget back.
        retries.request(later);
        retries.request(later);
        assert!(retries.admit(0, later, 0.0).is_ok());
    }

    #[test]
    fn the_floor_allows_retries_on_a_quiet_cluster() {
        let t0 = Instant::now();
        // 0.2 retries per second over 10 s: two retries with no traffic at all.
        let retries = Retries::new(policy(0.2, 0.2, 1), t0);
        assert!(retries.admit(0, t0, 0.0).is_ok());
        assert!(retries.admit(0, t0, 0.0).is_ok());
        assert_eq!(retries.admit(0, t0, 0.0), Err(Denied::Budget));
    }

    #[test]
    fn max_retries_per_request_comes_first() {
        let t0 = Instant::now();
        let retries = Retries::new(policy(1.0, 100.0, 2), t0);
        assert!(retries.admit(0, t0, 0.0).is_ok());
        assert!(retries.admit(1, t0, 0.0).is_ok());
        assert_eq!(retries.admit(2, t0, 0.0), Err(Denied::MaxRetries));
        let none = Retries::new(policy(1.0, 100.0, 0), t0);
        assert_eq!(none.admit(0, t0, 0.0), Err(Denied::MaxRetries));
    }
}
