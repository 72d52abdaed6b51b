//! The command line of failure handling: retries of requests a node failed (count, backoff,
//! budget: [`crate::retry`]) and the nodes' circuit breakers ([`crate::registry::Breaker`]).

use std::time::Duration;

use clap::Args;

use super::parse_duration;
use crate::registry::BreakerConfig;
use crate::retry::RetryPolicy;

/// `--max-retries`, `--retry-backoff*`, `--retry-budget*`, `--circuit-breaker-*`.
#[derive(Debug, Clone, Args)]
pub struct FailureArgs {
    /// Retries of a request on another node after a node failed it (no answer, a broken
    /// stream, an internal error), per step (prefill, decode) and only while the client has
    /// seen nothing. A node's engine panic and the request's own errors are never retried.
    #[arg(long, env = "PD_MAX_RETRIES", default_value_t = RetryPolicy::default().max_retries,
          help_heading = "Failures")]
    pub max_retries: u32,

    /// Base of the exponential backoff before a retry: retry n waits a random time below
    /// min(--retry-backoff-max, this × 2^n) (same syntax as --request-timeout).
    #[arg(long, env = "PD_RETRY_BACKOFF", default_value = "25ms", value_parser = parse_duration,
          help_heading = "Failures")]
    pub retry_backoff: Duration,

    /// Cap of the backoff before a retry.
    #[arg(long, env = "PD_RETRY_BACKOFF_MAX", default_value = "1s", value_parser = parse_duration,
          help_heading = "Failures")]
    pub retry_backoff_max: Duration,

    /// Retry budget: retries over the last 10 s may be at most this fraction of the client
    /// requests that arrived in them (or --retry-budget-min per second, whichever is more),
    /// so that a failing node cannot turn its failures into a retry storm.
    #[arg(long, env = "PD_RETRY_BUDGET", default_value_t = RetryPolicy::default().budget_ratio,
          value_parser = non_negative, help_heading = "Failures")]
    pub retry_budget: f64,

    /// Retries per second the budget always allows, however little traffic there is.
    #[arg(long, env = "PD_RETRY_BUDGET_MIN", default_value_t = RetryPolicy::default().budget_min_per_sec,
          value_parser = non_negative, help_heading = "Failures")]
    pub retry_budget_min: f64,

    /// Times one request's stream may move to another decode node when its decode node fails
    /// after tokens went out: the prompt and the tokens already sent are prefilled again and
    /// decoding goes on elsewhere, the client's stream without a gap or a repeat. 0: such a
    /// failure ends the stream with UNAVAILABLE.
    #[arg(
        long,
        env = "PD_MIGRATION_LIMIT",
        default_value_t = 2,
        help_heading = "Failures"
    )]
    pub migration_limit: u32,

    /// Consecutive failed requests that open a node's circuit breaker: it then gets no
    /// requests for --circuit-breaker-cooldown, after which one probe request goes and its
    /// success closes the breaker. 0: no breaker.
    #[arg(long, env = "PD_CIRCUIT_BREAKER_FAILURES", default_value_t = BreakerConfig::default().failures,
          help_heading = "Failures")]
    pub circuit_breaker_failures: u32,

    /// How long an open circuit breaker keeps requests away from its node.
    #[arg(long, env = "PD_CIRCUIT_BREAKER_COOLDOWN", default_value = "10s", value_parser = parse_duration,
          help_heading = "Failures")]
    pub circuit_breaker_cooldown: Duration,
}

impl FailureArgs {
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_retries: self.max_retries,
            backoff: self.retry_backoff,
            backoff_max: self.retry_backoff_max.max(self.retry_backoff),
            budget_ratio: self.retry_budget,
            budget_min_per_sec: self.retry_budget_min,
        }
    }

    pub fn breaker(&self) -> BreakerConfig {
        BreakerConfig {
            failures: self.circuit_breaker_failures,
            cooldown: self.circuit_breaker_cooldown,
        }
    }
}

fn non_negative(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{text}` must be a number >= 0")),
    }
}
