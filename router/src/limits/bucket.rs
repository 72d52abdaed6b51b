//! One token bucket: its level, refilled at a rate up to a burst, and the arithmetic of
//! admitting and charging against it. Pure: time is passed in.
//!
//! Buckets may go into debt: a request is admitted while its token buckets are not negative
//! and charged what it actually used once that is known, which can take a bucket below zero;
//! its subject is then refused until the refill has paid the debt back. A request bucket
//! needs one whole request's room (a level of at least 1) and is charged 1 at admission.
//!
//! Not here: which buckets a request draws on ([`super`]), the limits ([`super::file`]).

use std::time::{Duration, Instant};

use super::file::Rate;

/// A bucket's level as of an instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    /// A bucket that starts full.
    pub fn full(rate: Rate, now: Instant) -> Self {
        Self {
            level: rate.burst,
            at: now,
        }
    }

    /// The level now: refilled at `rate` since the last update, never above the burst (a
    /// bucket above a lowered burst is cut down to it).
    pub fn refill(&mut self, rate: Rate, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * rate.per_second).min(rate.burst);
        self.at = now.max(self.at);
    }

    pub fn level(&self) -> f64 {
        self.level
    }

    /// How long until the level reaches `need` at `rate` (zero if it has).
    pub fn wait_for(&self, rate: Rate, need: f64) -> Duration {
        let missing = need - self.level;
        if missing <= 0.0 {
            return Duration::ZERO;
        }
        Duration::try_from_secs_f64(missing / rate.per_second).unwrap_or(Duration::MAX)
    }

    /// Takes `amount` (which may leave the bucket in debt).
    pub fn take(&mut self, amount: f64) {
        if amount.is_finite() && amount > 0.0 {
            self.level -= amount;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATE: Rate = Rate {
        per_second: 10.0,
        burst: 20.0,
    };

    #[test]
    fn refills_at_the_rate_up_to_the_burst() {
        let t0 = Instant::now();
        let mut b = Bucket::full(RATE, t0);
        assert_eq!(b.level(), 20.0);
        b.take(25.0);
        assert_eq!(b.level(), -5.0, "in debt");
        assert_eq!(b.wait_for(RATE, 0.0), Duration::from_millis(500));
        assert_eq!(b.wait_for(RATE, 1.0), Duration::from_millis(600));
        b.refill(RATE, t0 + Duration::from_millis(500));
        assert!(b.level().abs() < 1e-9, "{}", b.level());
        assert_eq!(b.wait_for(RATE, -1.0), Duration::ZERO);
        b.refill(RATE, t0 + Duration::from_secs(60));
        assert_eq!(b.level(), 20.0, "never above the burst");
        // An earlier instant (a caller that read the clock before another) takes nothing.
        b.refill(RATE, t0);
        assert_eq!(b.level(), 20.0);
        b.take(f64::NAN);
        b.take(-3.0);
        assert_eq!(b.level(), 20.0, "only real charges count");
    }

    #[test]
    fn a_lowered_burst_cuts_the_level() {
        let t0 = Instant::now();
        let mut b = Bucket::full(RATE, t0);
        let lower = Rate {
            per_second: 1.0,
            burst: 3.0,
        };
        b.refill(lower, t0);
        assert_eq!(b.level(), 3.0);
        b.take(3.0);
        assert_eq!(b.wait_for(lower, 1.0), Duration::from_secs(1));
    }
}
