//! How the router copes with failing nodes: retries and circuit breakers.
//!
//! - `pd_router_retries_total{role}`: requests sent to another node after a node failed them
//!   (prefill or decode step), each retry once.
//! - `pd_router_retries_denied_total{role,reason}`: failures not retried although they could
//!   have been: `budget` (the retry budget was spent) or `max_retries` (the request had used
//!   its `--max-retries`).
//! - `pd_router_node_circuit_state{node,role}`: each node's circuit breaker now, 0 closed,
//!   1 open, 2 half-open (read from the registry at scrape time).
//! - `pd_router_node_circuit_transitions_total{node,role,state}`: the breaker's moves into
//!   `state` (closed, open, half_open), raised at scrape time to the breaker's own counts.
//! - `pd_router_migrations_total`: live streams resumed on another decode node after theirs
//!   failed (`--migration-limit`).

use std::sync::Arc;

use metrics::Counter;

use super::exporter::{CounterVec, Exporter, GaugeVec};
use super::ids::{Family, label};
use crate::registry::{BreakerState, Registry, Role};
use crate::retry::Denied;

/// The retry and circuit breaker families.
#[derive(Debug)]
pub(crate) struct ResilienceSeries {
    retries: CounterVec,
    denied: CounterVec,
    circuit_state: GaugeVec,
    transitions: CounterVec,
    migrations: Counter,
}

impl ResilienceSeries {
    pub fn new(exporter: &Arc<Exporter>) -> Self {
        let counter = |family: Family, labels: &'static [&'static str]| {
            CounterVec::new(exporter, family, labels)
        };
        let circuit_state = GaugeVec::new(
            exporter,
            Family::NodeCircuitState,
            &[label::NODE, label::ROLE],
        );
        let series = Self {
            migrations: counter(Family::Migrations, &[]).with_label_values(&[]),
            retries: counter(Family::Retries, &[label::ROLE]),
            denied: counter(Family::RetriesDenied, &[label::ROLE, label::REASON]),
            circuit_state,
            transitions: counter(
                Family::NodeCircuitTransitions,
                &[label::NODE, label::ROLE, label::STATE],
            ),
        };
        // Retry series exist from the start, so rates are defined before the first failure.
        for role in [Role::Prefill, Role::Decode] {
            series.retries.create(&[role.as_str()]);
            for reason in [Denied::Budget, Denied::MaxRetries] {
                series.denied.create(&[role.as_str(), denied_label(reason)]);
            }
        }
        series
    }

    /// A stream goes on on another decode node.
    pub fn migrated(&self) {
        self.migrations.increment(1);
    }

    /// A failed request of the `role` step goes to another node.
    pub fn retried(&self, role: Role) {
        self.retries
            .with_label_values(&[role.as_str()])
            .increment(1);
    }

    /// A retryable failure of the `role` step was not retried.
    pub fn denied(&self, role: Role, reason: Denied) {
        self.denied
            .with_label_values(&[role.as_str(), denied_label(reason)])
            .increment(1);
    }

    /// Every node's breaker state and transitions as of now.
    pub fn refresh(&self, registry: &Registry) {
        let now = std::time::Instant::now();
        for node in registry.nodes() {
            let (addr, role) = (node.addr.as_str(), node.role.as_str());
            let breaker = node.breaker();
            let state = breaker.state(now);
            self.circuit_state
                .with_label_values(&[addr, role])
                .set(state.gauge() as f64);
            for (to, count) in BreakerState::ALL.iter().zip(breaker.transitions()) {
                // The breaker counts; the exported counter catches up (`absolute` keeps the
                // larger value, so it never goes back).
                (self.transitions)
                    .with_label_values(&[addr, role, to.as_str()])
                    .absolute(count);
            }
        }
    }
}

fn denied_label(reason: Denied) -> &'static str {
    match reason {
        Denied::Budget => "budget",
        Denied::MaxRetries => "max_retries",
    }
}
