//! THE one place where the nodes' cumulative counters become the router's increments.
//!
//! # Invariant
//!
//! Every count a node makes is added to the router's counters **exactly once**, whatever
//! happens to the reports on the way:
//!
//! - Nodes never send deltas. Each report (`pb::CounterReport`: the `Info` poll every
//!   `--health-interval`, every `PrefillResponse`, the last `DecodeResponse` of a stream)
//!   carries the node's **cumulative** totals since its process started, tagged with that
//!   process's random nonzero `epoch`.
//! - Per (node, epoch) the router keeps the highest value it has seen of every counter (the
//!   high-water mark) and applies `max(0, new − highest_seen)`, then raises the mark.
//!   - A **dropped** report loses nothing: the next one carries the same counts.
//!   - A **repeated** report adds 0.
//!   - A **reordered** (older) report is below the mark and adds 0; its counts were already
//!     applied from the newer one.
//!   - So the router's counters never decrease, and within one epoch the sum of the
//!     increments equals the largest total that reached the router.
//! - A report with an epoch never seen for that node is a **restart**: a new process that
//!   counts from zero. Its totals are applied from zero (no negative jump, no reset of the
//!   router's counters) and [`Increments::restarted`] is set (epochs beyond the first seen
//!   per node: `pd_router_node_restarts_total`). The marks of the last [`KEPT_EPOCHS`] epochs
//!   of each node are kept, so a late report of the previous process is still deduplicated.
//! - Hence, per node: router total = Σ over the node's epochs of the highest total each epoch
//!   reported. Counts a node made after its last report reached the router and before it
//!   crashed are the only ones that can be missed (a pull cannot see them; a clean shutdown
//!   drains requests, and each request's response carries its counts).
//! - Epoch 0 means "not counting" (a node without counters): such reports are ignored.
//!
//! Hit rates stay in [0, 1] as long as each node's own totals keep `hits ≤ queries` (the
//! engine guarantees it, docs/accounting.md): at any moment the router's total of a pair is a
//! sum of marks of the same reports' fields, except that hits and queries are raised from the
//! same report together.
//!
//! This module is pure (no clock, no I/O, no metrics library): `metrics/mod.rs` feeds it and
//! adds the returned [`Increments`] to the exported counters, and the property tests below
//! drive it with dropped, repeated, reordered reports and restarts.

use std::collections::{BTreeMap, HashMap, VecDeque};

use pd_proto::pb::CounterReport;

use crate::registry::Role;

/// Epochs remembered per node (the current one and the ones before it).
pub const KEPT_EPOCHS: usize = 8;

/// Longest `reason` label accepted from a node; longer ones are cut (a node's bug must not
/// make unbounded label values).
const MAX_REASON_LEN: usize = 64;

/// A node as the router names it: its role and its address from the command line.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeKey {
    pub role: Role,
    pub addr: String,
}

/// By address, then role: the order nodes are listed in on `/metrics`.
impl Ord for NodeKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (&self.addr, self.role.as_str()).cmp(&(&other.addr, other.role.as_str()))
    }
}

impl PartialOrd for NodeKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// What one report adds to the router's counters (all zero for a stale or repeated report).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Increments {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub external_prefix_cache_queries: u64,
    pub external_prefix_cache_hits: u64,
    /// `external_prefix_cache_hits` by source (each raised on its own mark, like every
    /// counter: from a node that splits, they sum to the external hits).
    pub external_prefix_cache_hits_host: u64,
    pub external_prefix_cache_hits_peer: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub kv_transfer_bytes: u64,
    pub kv_transfers: u64,
    pub kv_transfer_seconds: f64,
    pub kv_transfer_failures: BTreeMap<String, u64>,
    pub kv_leases_expired: u64,
    /// The report opened a new epoch after an earlier one: the node restarted.
    pub restarted: bool,
}

impl Increments {
    pub fn is_empty(&self) -> bool {
        *self == Increments::default()
    }
}

/// Highest values seen in one epoch.
#[derive(Debug, Clone, Default)]
struct Marks {
    epoch: u64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    external_prefix_cache_queries: u64,
    external_prefix_cache_hits: u64,
    external_prefix_cache_hits_host: u64,
    external_prefix_cache_hits_peer: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    preemptions: u64,
    kv_transfer_bytes: u64,
    kv_transfers: u64,
    kv_transfer_seconds: f64,
    kv_transfer_failures: BTreeMap<String, u64>,
    kv_leases_expired: u64,
}

/// Raises `mark` to `new`; returns by how much (0 if `new` is not above it).
fn raise(mark: &mut u64, new: u64) -> u64 {
    let delta = new.saturating_sub(*mark);
    *mark = (*mark).max(new);
    delta
}

fn raise_f64(mark: &mut f64, new: f64) -> f64 {
    if new.is_finite() && new > *mark {
        let delta = new - *mark;
        *mark = new;
        delta
    } else {
        0.0
    }
}

impl Marks {
    fn apply(&mut self, r: &CounterReport, out: &mut Increments) {
        out.prefix_cache_queries = raise(&mut self.prefix_cache_queries, r.prefix_cache_queries);
        out.prefix_cache_hits = raise(&mut self.prefix_cache_hits, r.prefix_cache_hits);
        out.external_prefix_cache_queries = raise(
            &mut self.external_prefix_cache_queries,
            r.external_prefix_cache_queries,
        );
        out.external_prefix_cache_hits = raise(
            &mut self.external_prefix_cache_hits,
            r.external_prefix_cache_hits,
        );
        out.external_prefix_cache_hits_host = raise(
            &mut self.external_prefix_cache_hits_host,
            r.external_prefix_cache_hits_host,
        );
        out.external_prefix_cache_hits_peer = raise(
            &mut self.external_prefix_cache_hits_peer,
            r.external_prefix_cache_hits_peer,
        );
        out.prompt_tokens = raise(&mut self.prompt_tokens, r.prompt_tokens);
        out.generation_tokens = raise(&mut self.generation_tokens, r.generation_tokens);
        out.preemptions = raise(&mut self.preemptions, r.preemptions);
        out.kv_transfer_bytes = raise(&mut self.kv_transfer_bytes, r.kv_transfer_bytes);
        out.kv_transfers = raise(&mut self.kv_transfers, r.kv_transfers);
        out.kv_transfer_seconds =
            raise_f64(&mut self.kv_transfer_seconds, r.kv_transfer_seconds_sum);
        out.kv_leases_expired = raise(&mut self.kv_leases_expired, r.kv_leases_expired);
        for (reason, &total) in &r.kv_transfer_failures {
            let reason = clip(reason);
            let mark = self.kv_transfer_failures.entry(reason.clone()).or_default();
            let delta = raise(mark, total);
            if delta > 0 {
                *out.kv_transfer_failures.entry(reason).or_default() += delta;
            }
        }
    }
}

fn clip(reason: &str) -> String {
    let reason = if reason.is_empty() { "unknown" } else { reason };
    match reason.char_indices().nth(MAX_REASON_LEN) {
        Some((cut, _)) => reason[..cut].to_string(),
        None => reason.to_string(),
    }
}

/// The high-water marks of every node's recent epochs.
#[derive(Debug, Default)]
pub struct Aggregator {
    /// Per node, its epochs, most recent first.
    nodes: HashMap<NodeKey, VecDeque<Marks>>,
}

impl Aggregator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one report of `node`; returns what it adds (see the module's invariant).
    pub fn apply(&mut self, node: &NodeKey, report: &CounterReport) -> Increments {
        let mut out = Increments::default();
        if report.epoch == 0 {
            return out;
        }
        // Looked up before inserting: a report of a known node clones no key.
        if !self.nodes.contains_key(node) {
            self.nodes.insert(node.clone(), VecDeque::new());
        }
        let epochs = self.nodes.get_mut(node).expect("inserted above");
        let position = epochs.iter().position(|m| m.epoch == report.epoch);
        let marks = match position {
            Some(i) => &mut epochs[i],
            None => {
                out.restarted = !epochs.is_empty();
                epochs.push_front(Marks {
                    epoch: report.epoch,
                    ..Marks::default()
                });
                epochs.truncate(KEPT_EPOCHS);
                &mut epochs[0]
            }
        };
        marks.apply(report, &mut out);
        out
    }

    /// The epochs remembered for `node`, most recent first.
    pub fn epochs(&self, node: &NodeKey) -> Vec<u64> {
        self.nodes
            .get(node)
            .map(|e| e.iter().map(|m| m.epoch).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(addr: &str) -> NodeKey {
        NodeKey {
            role: Role::Prefill,
            addr: addr.into(),
        }
    }

    fn report(epoch: u64, queries: u64, hits: u64) -> CounterReport {
        CounterReport {
            epoch,
            prefix_cache_queries: queries,
            prefix_cache_hits: hits,
            ..Default::default()
        }
    }

    #[test]
    fn repeated_and_stale_reports_add_nothing() {
        let mut agg = Aggregator::new();
        let n = key("a:1");
        assert_eq!(agg.apply(&n, &report(7, 100, 32)).prefix_cache_queries, 100);
        assert!(agg.apply(&n, &report(7, 100, 32)).is_empty());
        let later = agg.apply(&n, &report(7, 150, 48));
        assert_eq!(
            (later.prefix_cache_queries, later.prefix_cache_hits),
            (50, 16)
        );
        // An older report arriving late.
        assert!(agg.apply(&n, &report(7, 120, 40)).is_empty());
    }

    #[test]
    fn a_new_epoch_is_a_restart_counted_from_zero() {
        let mut agg = Aggregator::new();
        let n = key("a:1");
        assert!(!agg.apply(&n, &report(7, 100, 0)).restarted);
        let fresh = agg.apply(&n, &report(9, 10, 0));
        assert!(fresh.restarted);
        assert_eq!(fresh.prefix_cache_queries, 10);
        // A late report of the old process still deduplicates, and is no restart.
        let late = agg.apply(&n, &report(7, 110, 0));
        assert!(!late.restarted);
        assert_eq!(late.prefix_cache_queries, 10);
        assert_eq!(agg.epochs(&n), vec![9, 7]);
        // Other nodes are independent.
        assert_eq!(
            agg.apply(&key("b:2"), &report(7, 5, 0))
                .prefix_cache_queries,
            5
        );
    }

    #[test]
    fn epoch_zero_is_ignored_and_maps_are_per_reason() {
        let mut agg = Aggregator::new();
        let n = key("a:1");
        assert!(agg.apply(&n, &report(0, 100, 0)).is_empty());
        let mut r = report(3, 0, 0);
        r.kv_transfer_failures.insert("timeout".into(), 2);
        r.kv_transfer_seconds_sum = 0.5;
        assert_eq!(agg.apply(&n, &r).kv_transfer_failures["timeout"], 2);
        r.kv_transfer_failures.insert("checksum".into(), 1);
        r.kv_transfer_seconds_sum = 0.75;
        let more = agg.apply(&n, &r);
        assert_eq!(more.kv_transfer_failures.len(), 1);
        assert_eq!(more.kv_transfer_failures["checksum"], 1);
        assert_eq!(more.kv_transfer_seconds, 0.25);
        r.kv_transfer_seconds_sum = f64::NAN;
        assert!(agg.apply(&n, &r).is_empty());
    }

    /// One node process counting requests: (queries, local hits, external queries, external
    /// hits, generated) per request; reports are cumulative snapshots.
    #[derive(Debug, Clone)]
    struct Epoch {
        id: u64,
        requests: Vec<(u64, u64, u64)>,
    }

    fn snapshots(epoch: &Epoch) -> Vec<CounterReport> {
        let mut total = CounterReport {
            epoch: epoch.id,
            ..Default::default()
        };
        let mut out = vec![total.clone()];
        for &(prompt, local_blocks, external_blocks) in &epoch.requests {
            let local = (local_blocks * 16).min(prompt.saturating_sub(1));
            let external = (external_blocks * 16).min(prompt - local);
            total.prefix_cache_queries += prompt;
            total.prefix_cache_hits += local;
            total.external_prefix_cache_queries += prompt - local;
            total.external_prefix_cache_hits += external;
            // Some of it from the host tier, the rest from a peer (a decode node's import).
            let host = (external / 16).div_ceil(2) * 16;
            total.external_prefix_cache_hits_host += host;
            total.external_prefix_cache_hits_peer += external - host;
            total.prompt_tokens += prompt;
            total.generation_tokens += 1;
            total.kv_transfer_seconds_sum += 0.125;
            *total
                .kv_transfer_failures
                .entry("timeout".into())
                .or_default() += local_blocks % 2;
            out.push(total.clone());
        }
        out
    }

    fn epoch_strategy() -> impl Strategy<Value = Vec<Epoch>> {
        let request = (1u64..200, 0u64..8, 0u64..8);
        prop::collection::vec(prop::collection::vec(request, 0..12), 1..5).prop_map(|epochs| {
            epochs
                .into_iter()
                .enumerate()
                .map(|(i, requests)| Epoch {
                    // Random-looking, distinct, nonzero.
                    id: (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                    requests,
                })
                .collect()
        })
    }

    proptest! {
        /// Reports dropped, repeated and reordered (within and across epochs, a node
        /// restarted several times): the router's totals equal the sum over epochs of the
        /// last cumulative value each epoch reported, never decrease, and hit rates stay in
        /// [0, 1] at every step.
        #[test]
        fn exactly_once_under_drops_duplicates_reordering_and_restarts(
            epochs in epoch_strategy(),
            faults in prop::collection::vec((0u8..10, 0usize..4), 0..200),
        ) {
            // The delivery: each epoch's snapshots in order, with random drops, repeats and
            // swaps with a later report (possibly of the next epoch); the last snapshot of
            // each epoch always arrives at least once (the node's final Info).
            let mut sent: Vec<CounterReport> = Vec::new();
            let mut fault = faults.iter().cycle();
            for epoch in &epochs {
                let snaps = snapshots(epoch);
                let last = snaps.len() - 1;
                for (i, s) in snaps.into_iter().enumerate() {
                    let (kind, extra) = if faults.is_empty() { (9, 0) } else { *fault.next().unwrap() };
                    match kind {
                        0..=2 if i != last => {} // dropped
                        3..=4 => {
                            for _ in 0..=extra { sent.push(s.clone()); }
                        }
                        _ => sent.push(s),
                    }
                }
            }
            // Reorder: move some reports later by a few places.
            for (i, &(kind, extra)) in faults.iter().enumerate() {
                if kind >= 8 && !sent.is_empty() {
                    let from = i % sent.len();
                    let to = (from + extra + 1).min(sent.len() - 1);
                    let r = sent.remove(from);
                    sent.insert(to, r);
                }
            }
            // Reordering may have moved an epoch's last snapshot before an earlier one: that
            // is fine, the high-water mark keeps the largest.
            let mut agg = Aggregator::new();
            let n = key("node:1");
            let mut totals = Increments::default();
            let mut restarts = 0u64;
            for r in &sent {
                let inc = agg.apply(&n, r);
                let before = totals.clone();
                totals.prefix_cache_queries += inc.prefix_cache_queries;
                totals.prefix_cache_hits += inc.prefix_cache_hits;
                totals.external_prefix_cache_queries += inc.external_prefix_cache_queries;
                totals.external_prefix_cache_hits += inc.external_prefix_cache_hits;
                totals.external_prefix_cache_hits_host += inc.external_prefix_cache_hits_host;
                totals.external_prefix_cache_hits_peer += inc.external_prefix_cache_hits_peer;
                totals.prompt_tokens += inc.prompt_tokens;
                totals.generation_tokens += inc.generation_tokens;
                totals.kv_transfer_seconds += inc.kv_transfer_seconds;
                for (k, v) in &inc.kv_transfer_failures {
                    *totals.kv_transfer_failures.entry(k.clone()).or_default() += v;
                }
                restarts += u64::from(inc.restarted);
                prop_assert!(totals.prefix_cache_queries >= before.prefix_cache_queries);
                prop_assert!(totals.prefix_cache_hits <= totals.prefix_cache_queries);
                prop_assert!(
                    totals.external_prefix_cache_hits <= totals.external_prefix_cache_queries
                );
            }
            let expect = |f: fn(&CounterReport) -> u64| -> u64 {
                epochs.iter().map(|e| f(snapshots(e).last().unwrap())).sum()
            };
            prop_assert_eq!(totals.prefix_cache_queries, expect(|r| r.prefix_cache_queries));
            prop_assert_eq!(totals.prefix_cache_hits, expect(|r| r.prefix_cache_hits));
            prop_assert_eq!(
                totals.external_prefix_cache_queries,
                expect(|r| r.external_prefix_cache_queries)
            );
            prop_assert_eq!(
                totals.external_prefix_cache_hits,
                expect(|r| r.external_prefix_cache_hits)
            );
            prop_assert_eq!(
                totals.external_prefix_cache_hits_host,
                expect(|r| r.external_prefix_cache_hits_host)
            );
            prop_assert_eq!(
                totals.external_prefix_cache_hits_peer,
                expect(|r| r.external_prefix_cache_hits_peer)
            );
            // Each report's split sums to its external hits, so the totals' does too.
            prop_assert_eq!(
                totals.external_prefix_cache_hits_host + totals.external_prefix_cache_hits_peer,
                totals.external_prefix_cache_hits
            );
            prop_assert_eq!(totals.prompt_tokens, expect(|r| r.prompt_tokens));
            prop_assert_eq!(totals.generation_tokens, expect(|r| r.generation_tokens));
            let failures: u64 = totals.kv_transfer_failures.values().sum();
            prop_assert_eq!(
                failures,
                expect(|r| r.kv_transfer_failures.values().sum::<u64>())
            );
            let seconds: f64 = epochs
                .iter()
                .map(|e| snapshots(e).last().unwrap().kv_transfer_seconds_sum)
                .sum();
            prop_assert!((totals.kv_transfer_seconds - seconds).abs() < 1e-9);
            // Every epoch after the first that reached the router is one restart.
            prop_assert_eq!(restarts, epochs.len() as u64 - 1);
        }
    }
}
