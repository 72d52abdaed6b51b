//! A node's circuit breaker: after `--circuit-breaker-failures` consecutive failed requests
//! the node gets no requests for `--circuit-breaker-cooldown` (open); then one probe request
//! is let through (half-open): its success closes the breaker, its failure opens it for
//! another cool-down.
//!
//! It complements the health checks rather than repeating them: a node that is unreachable
//! or times out is marked down at once and comes back with its next good `Info`
//! ([`super::Node::mark_down`]); the breaker catches a node that answers `Info` but fails
//! the requests themselves. Only failures that are the node's count (see
//! [`crate::error::NodeError::counts_against_node`]); a request's own errors and a full
//! node's refusals do not, and neither resets the count.
//!
//! Time is passed in (`now`) so that the state machine is tested without sleeping.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `--circuit-breaker-failures` and `--circuit-breaker-cooldown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker; 0: never opens.
    pub failures: u32,
    /// How long an open breaker keeps requests away before it lets a probe through.
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures: 5,
            cooldown: Duration::from_secs(10),
        }
    }
}

/// A breaker's state, as `/metrics` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Requests flow.
    Closed,
    /// No requests until the cool-down is over.
    Open,
    /// The cool-down is over: one probe request may go (or is out).
    HalfOpen,
}

impl BreakerState {
    pub const ALL: [BreakerState; 3] = [
        BreakerState::Closed,
        BreakerState::Open,
        BreakerState::HalfOpen,
    ];

    /// The gauge's value: 0 closed, 1 open, 2 half-open.
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    fn index(self) -> usize {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probing: bool },
}

#[derive(Debug)]
struct Inner {
    config: BreakerConfig,
    state: State,
    /// Transitions into each state, by [`BreakerState::ALL`]'s order.
    transitions: [u64; 3],
}

impl Inner {
    fn public(&self) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    fn enter(&mut self, state: State) {
        self.state = state;
        let to = self.public();
        self.transitions[to.index()] += 1;
    }

    /// An open breaker whose cool-down is over becomes half-open.
    fn advance(&mut self, now: Instant) {
        if let State::Open { until } = self.state
            && now >= until
        {
            self.enter(State::HalfOpen { probing: false });
        }
    }
}

/// One node's breaker (cheap to share: the node and its requests' permits hold it).
#[derive(Debug, Clone)]
pub struct Breaker {
    inner: Arc<Mutex<Inner>>,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                config,
                state: State::Closed { failures: 0 },
                transitions: [0; 3],
            })),
        }
    }

    /// New settings (the state stays).
    pub fn configure(&self, config: BreakerConfig) {
        self.lock().config = config;
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Plain values, each write whole: a panic elsewhere cannot leave them torn.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state now (an open breaker past its cool-down reads half-open).
    pub fn state(&self, now: Instant) -> BreakerState {
        let mut inner = self.lock();
        inner.advance(now);
        inner.public()
    }

    /// Transitions into closed, open and half-open so far (by [`BreakerState::ALL`]'s order).
    pub fn transitions(&self) -> [u64; 3] {
        self.lock().transitions
    }

    /// Whether a request may be routed here now: closed, or half-open with no probe out.
    /// Takes nothing: [`Breaker::begin`] does, for the node a request is sent to.
    pub fn admits(&self, now: Instant) -> bool {
        let mut inner = self.lock();
        inner.advance(now);
        match inner.state {
            State::Closed { .. } => true,
            State::Open { .. } => false,
            State::HalfOpen { probing } => !probing,
        }
    }

    /// The right to send one request to the node; `None` while open, or half-open with the
    /// probe already out (another request took it first).
    pub fn begin(&self, now: Instant) -> Option<Permit> {
        let mut inner = self.lock();
        inner.advance(now);
        let probe = match inner.state {
            State::Closed { .. } => false,
            State::Open { .. } | State::HalfOpen { probing: true } => return None,
            State::HalfOpen { probing: false } => {
                inner.state = State::HalfOpen { probing: true };
                true
            }
        };
        Some(Permit {
            breaker: self.clone(),
            probe,
            settled: false,
        })
    }

    fn succeeded(&self) {
        let mut inner = self.lock();
        match inner.state {
            State::Closed { .. } => inner.state = State::Closed { failures: 0 },
            State::HalfOpen { .. } => inner.enter(State::Closed { failures: 0 }),
            // Opened by other requests meanwhile: their failures are newer news.
            State::Open { .. } => {}
        }
    }

    fn failed(&self, probe: bool, now: Instant) {
        let mut inner = self.lock();
        let config = inner.config;
        let until = now + config.cooldown;
        match inner.state {
            State::Closed { failures } => {
                let failures = failures.saturating_add(1);
                if config.failures > 0 && failures >= config.failures {
                    inner.enter(State::Open { until });
                } else {
                    inner.state = State::Closed { failures };
                }
            }
            State::HalfOpen { .. } if probe => inner.enter(State::Open { until }),
            // A request sent while closed that fails after the breaker changed state: the
            // probe decides.
            State::HalfOpen { .. } | State::Open { .. } => {}
        }
    }

    /// A probe that ended without a verdict: the next request probes.
    fn release_probe(&self) {
        let mut inner = self.lock();
        if let State::HalfOpen { probing: true } = inner.state {
            inner.state = State::HalfOpen { probing: false };
        }
    }
}

/// One request's right to use a node, taken by [`Breaker::begin`]. Settle it with
/// [`Permit::succeeded`] or [`Permit::failed`]; dropped unsettled (the request ended for a
/// reason that says nothing about the node), it changes nothing, except that a half-open
/// breaker lets the next request probe.
#[derive(Debug)]
pub struct Permit {
    breaker: Breaker,
    probe: bool,
    settled: bool,
}

impl Permit {
    /// Whether this request is the half-open breaker's probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// The node served the request: the failure count restarts; a probe closes the breaker.
    pub fn succeeded(mut self) {
        self.settled = true;
        self.breaker.succeeded();
    }

    /// The node failed the request: one more consecutive failure (the breaker opens at the
    /// threshold); a failed probe opens it again.
    pub fn failed(mut self, now: Instant) {
        self.settled = true;
        self.breaker.failed(self.probe, now);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.settled && self.probe {
            self.breaker.release_probe();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOLDOWN: Duration = Duration::from_secs(10);

    fn breaker(failures: u32) -> Breaker {
        Breaker::new(BreakerConfig {
            failures,
            cooldown: COOLDOWN,
        })
    }

    fn fail(b: &Breaker, now: Instant) {
        b.begin(now).expect("admitted").failed(now);
    }

    #[test]
    fn consecutive_failures_open_it_and_a_success_restarts_the_count() {
        let b = breaker(3);
        let t0 = Instant::now();
        fail(&b, t0);
        fail(&b, t0);
        b.begin(t0).unwrap().succeeded();
        fail(&b, t0);
        fail(&b, t0);
        assert_eq!(b.state(t0), BreakerState::Closed);
        fail(&b, t0);
        assert_eq!(b.state(t0), BreakerState::Open);
        assert!(!b.admits(t0 + COOLDOWN / 2));
        assert!(b.begin(t0 + COOLDOWN / 2).is_none());
        assert_eq!(b.transitions(), [0, 1, 0]);
    }

    #[test]
    fn after_the_cooldown_one_probe_goes_and_its_success_closes_it() {
        let b = breaker(1);
        let t0 = Instant::now();
        fail(&b, t0);
        let later = t0 + COOLDOWN;
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        assert!(b.admits(later));
        let probe = b.begin(later).expect("the probe");
        assert!(probe.is_probe());
        // Only one probe at a time.
        assert!(!b.admits(later));
        assert!(b.begin(later).is_none());
        probe.succeeded();
        assert_eq!(b.state(later), BreakerState::Closed);
        let normal = b.begin(later).unwrap();
        assert!(!normal.is_probe());
        assert_eq!(b.transitions(), [1, 1, 1]);
    }

    #[test]
    fn a_failed_probe_opens_it_for_another_cooldown() {
        let b = breaker(2);
        let t0 = Instant::now();
        fail(&b, t0);
        fail(&b, t0);
        let t1 = t0 + COOLDOWN;
        b.begin(t1).unwrap().failed(t1);
        assert_eq!(b.state(t1), BreakerState::Open);
        assert!(!b.admits(t1 + COOLDOWN - Duration::from_millis(1)));
        assert_eq!(b.state(t1 + COOLDOWN), BreakerState::HalfOpen);
        assert_eq!(b.transitions(), [0, 2, 2]);
    }

    #[test]
    fn a_probe_dropped_without_a_verdict_lets_the_next_request_probe() {
        let b = breaker(1);
        let t0 = Instant::now();
        fail(&b, t0);
        let t1 = t0 + COOLDOWN;
        drop(b.begin(t1).unwrap());
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        assert!(b.begin(t1).unwrap().is_probe());
    }

    #[test]
    fn late_verdicts_of_requests_sent_while_closed_do_not_decide() {
        let b = breaker(1);
        let t0 = Instant::now();
        let slow = b.begin(t0).unwrap();
        fail(&b, t0);
        // Its success arrives while open: still open.
        slow.succeeded();
        assert_eq!(b.state(t0), BreakerState::Open);
        let t1 = t0 + COOLDOWN;
        let slow = b.begin(t1).unwrap(); // the probe
        let late = Permit {
            breaker: b.clone(),
            probe: false,
            settled: false,
        };
        late.failed(t1);
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        slow.succeeded();
        assert_eq!(b.state(t1), BreakerState::Closed);
    }

    #[test]
    fn zero_failures_means_never_open() {
        let b = breaker(0);
        let t0 = Instant::now();
        for _ in 0..100 {
            fail(&b, t0);
        }
        assert_eq!(b.state(t0), BreakerState::Closed);
        assert_eq!(b.transitions(), [0, 0, 0]);
    }
}
