//! TEST-ONLY fault injection on the way from the nodes' counter reports to the aggregation.
//!
//! Set `PD_ROUTER_REPORT_FAULTS=drop=0.3,dup=0.3,reorder=0.3,seed=7` in the router's
//! environment and each incoming report (Info poll or request response) is, at random:
//! dropped; delivered twice; or held back and delivered after the node's next report
//! (reordered). It exists so the end-to-end tests can prove that the router's totals stay
//! exact when reports are lost, repeated or reordered ([`super::aggregate`]). It is read only
//! when the variable is set, logs a warning at start, and has no command-line flag: never set
//! it in production.

use std::collections::HashMap;
use std::sync::Mutex;

use pd_proto::pb::CounterReport;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::aggregate::NodeKey;

/// The environment variable that turns the fault hook on.
pub const ENV: &str = "PD_ROUTER_REPORT_FAULTS";

/// A malformed `PD_ROUTER_REPORT_FAULTS`.
#[derive(Debug, thiserror::Error)]
#[error(
    "{ENV}={value:?}: {message} (expected e.g. drop=0.3,dup=0.3,reorder=0.3,seed=7; \
     probabilities in [0, 1])"
)]
pub struct FaultSpecError {
    value: String,
    message: String,
}

/// Probabilities of each fault, per report.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FaultSpec {
    pub drop: f64,
    pub dup: f64,
    pub reorder: f64,
    pub seed: u64,
}

impl FaultSpec {
    /// The spec from the environment; `None` when the variable is unset or empty.
    pub fn from_env() -> Result<Option<Self>, FaultSpecError> {
        match std::env::var(ENV) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v).map(Some),
            _ => Ok(None),
        }
    }

    pub fn parse(value: &str) -> Result<Self, FaultSpecError> {
        let error = |message: String| FaultSpecError {
            value: value.to_string(),
            message,
        };
        let mut spec = FaultSpec::default();
        for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, number) = part
                .split_once('=')
                .ok_or_else(|| error(format!("`{part}` is not key=value")))?;
            if key == "seed" {
                spec.seed = number
                    .parse()
                    .map_err(|_| error(format!("seed `{number}` is not an integer")))?;
                continue;
            }
            let p: f64 = number
                .parse()
                .ok()
                .filter(|p| (0.0..=1.0).contains(p))
                .ok_or_else(|| error(format!("{key}: `{number}` is not a probability")))?;
            match key {
                "drop" => spec.drop = p,
                "dup" => spec.dup = p,
                "reorder" => spec.reorder = p,
                other => return Err(error(format!("unknown fault `{other}`"))),
            }
        }
        Ok(spec)
    }
}

/// The fault hook's state: its random source and the report held back per node.
#[derive(Debug)]
pub struct ReportFaults {
    spec: FaultSpec,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    rng: ChaCha8Rng,
    held: HashMap<NodeKey, CounterReport>,
}

impl ReportFaults {
    pub fn new(spec: FaultSpec) -> Self {
        Self {
            spec,
            state: Mutex::new(State {
                rng: ChaCha8Rng::seed_from_u64(spec.seed),
                held: HashMap::new(),
            }),
        }
    }

    /// What reaches the aggregation of `report`, in order: nothing, it, it twice, and/or
    /// a report of this node held back before.
    pub fn deliver(&self, node: &NodeKey, report: &CounterReport) -> Vec<CounterReport> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State { rng, held } = &mut *state;
        let mut out = Vec::new();
        if rng.random::<f64>() < self.spec.drop {
            // Dropped.
        } else if !held.contains_key(node) && rng.random::<f64>() < self.spec.reorder {
            held.insert(node.clone(), report.clone());
            return out;
        } else {
            out.push(report.clone());
            if rng.random::<f64>() < self.spec.dup {
                out.push(report.clone());
            }
        }
        // The held-back report goes after a newer one: reordered.
        out.extend(held.remove(node));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Role;

    #[test]
    fn specs_parse_and_bad_ones_are_refused() {
        let spec = FaultSpec::parse("drop=0.3, dup=0.2,reorder=1,seed=9").unwrap();
        assert_eq!(
            spec,
            FaultSpec {
                drop: 0.3,
                dup: 0.2,
                reorder: 1.0,
                seed: 9
            }
        );
        assert!(FaultSpec::parse("drop=2").is_err());
        assert!(FaultSpec::parse("lose=0.1").is_err());
        assert!(FaultSpec::parse("drop").is_err());
        assert!(FaultSpec::parse("seed=x").is_err());
    }

    #[test]
    fn faults_drop_repeat_and_reorder() {
        let node = NodeKey {
            role: Role::Decode,
            addr: "n:1".into(),
        };
        let r = |q| CounterReport {
            epoch: 1,
            prefix_cache_queries: q,
            ..Default::default()
        };
        let none = ReportFaults::new(FaultSpec::default());
        assert_eq!(none.deliver(&node, &r(1)), vec![r(1)]);
        let dup = ReportFaults::new(FaultSpec {
            dup: 1.0,
            ..Default::default()
        });
        assert_eq!(dup.deliver(&node, &r(1)).len(), 2);
        let drop = ReportFaults::new(FaultSpec {
            drop: 1.0,
            ..Default::default()
        });
        assert!(drop.deliver(&node, &r(1)).is_empty());
        let reorder = ReportFaults::new(FaultSpec {
            reorder: 1.0,
            ..Default::default()
        });
        assert!(reorder.deliver(&node, &r(1)).is_empty());
        assert_eq!(reorder.deliver(&node, &r(2)), vec![r(2), r(1)]);
    }
}
