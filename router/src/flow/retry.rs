//! One request's side of failure handling: whether a step a node failed is tried again
//! elsewhere (the router-wide policy and budget are [`crate::retry`]'s), and what the
//! failure tells the node's circuit breaker.

use crate::error::NodeError;
use crate::registry::Permit;

use super::{End, Job};

impl Job {
    /// Whether this request, which `error` failed after `retries` retries of the current
    /// step, goes to another node: a retryable failure, within `--max-retries` and the retry
    /// budget. The backoff is waited here; an abort, the deadline or the client leaving ends
    /// the wait (and the request).
    pub(super) async fn retry_after(
        &mut self,
        error: &NodeError,
        retries: &mut u32,
    ) -> Result<bool, End> {
        if !error.is_retryable() {
            return Ok(false);
        }
        let series = &self.shared.metrics.resilience;
        let now = std::time::Instant::now();
        match self.shared.retries.admit(*retries, now, rand::random()) {
            Ok(wait) => {
                *retries += 1;
                series.retried(error.role);
                if !wait.is_zero() {
                    self.watch.run(tokio::time::sleep(wait)).await?;
                }
                Ok(true)
            }
            Err(reason) => {
                tracing::debug!(request_id = %self.req.request_id, ?reason, %error, "failure not retried");
                series.denied(error.role, reason);
                Ok(false)
            }
        }
    }
}

/// A node failed an attempt: its breaker counts the failure if it is the node's
/// ([`NodeError::counts_against_node`]); otherwise the permit goes back unsettled.
pub(super) fn settle_failure(permit: Permit, error: &NodeError) {
    if error.counts_against_node() {
        permit.failed(std::time::Instant::now());
    }
}
