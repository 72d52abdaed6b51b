//! What the router has measured of its nodes, for the disaggregation decision: each prefill
//! node's prefill time by tokens computed, each decode node's time to compute a prompt itself,
//! each (prefill, decode) pair's KV transfer time by bytes, each decode node's time per decode
//! step (alone, while it computes a prompt itself, while it pulls KV, and while other nodes
//! compute or pull: how much each kind of work slows its streams), and the prefill work and
//! KV pulls the router has in flight on each node right now. All of it is
//! learnt from requests as they are served ([`Fit`]); nothing is configured. Not here: the
//! decision itself ([`super::Disagg`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::Path;
use super::fit::Fit;

/// Weight of the newest decode-step sample.
const STEP_DECAY: f64 = 0.1;

/// Node ids are the registry's (`Node::id`).
type NodeId = usize;

#[derive(Debug, Default)]
struct State {
    /// Prefill nodes: seconds of a `Prefill` call by tokens computed (its own and those the
    /// router had queued on the node when it was sent).
    prefill: HashMap<NodeId, Fit>,
    /// Decode nodes computing a prompt themselves: seconds to the first message by tokens
    /// computed (likewise).
    local: HashMap<NodeId, Fit>,
    /// (prefill node, decode node): seconds from `Decode` to its first message by KV bytes the
    /// decode node pulled.
    transfer: HashMap<(NodeId, NodeId), Fit>,
    /// Decode nodes: seconds between two messages of a stream, by what was being computed
    /// meanwhile.
    step: HashMap<NodeId, Steps>,
    /// Prefill nodes: bytes of one KV block (from their handles).
    block_bytes: HashMap<NodeId, u64>,
    /// Prompt tokens the router has sent to each node to compute and not heard back about.
    queued: HashMap<NodeId, u64>,
    /// Decode nodes: KV pulls the router started (a `Decode` with a handle) whose first
    /// message has not come yet.
    pulling: HashMap<NodeId, u64>,
}

/// What the router had in flight while a decode step was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// No prompt was being computed and no KV pulled anywhere.
    Quiet,
    /// The decode node itself was computing a prompt.
    Here,
    /// The decode node itself was pulling KV (and computing no prompt).
    Pulling,
    /// Only other nodes were computing prompts or pulling KV.
    Elsewhere,
}

/// A decode node's step time by [`Busy`] (EWMAs; `None` before a sample).
#[derive(Debug, Clone, Copy, Default)]
struct Steps {
    quiet: Option<f64>,
    here: Option<f64>,
    pulling: Option<f64>,
    elsewhere: Option<f64>,
}

impl Steps {
    fn slot(&mut self, busy: Busy) -> &mut Option<f64> {
        match busy {
            Busy::Quiet => &mut self.quiet,
            Busy::Here => &mut self.here,
            Busy::Pulling => &mut self.pulling,
            Busy::Elsewhere => &mut self.elsewhere,
        }
    }

    /// The step time whatever was going on (the quiet one first).
    fn any(&self) -> Option<f64> {
        self.quiet.or(self.elsewhere).or(self.pulling).or(self.here)
    }

    /// The fraction of a step that `busy` adds: 1 - quiet / busy, within [0, 1]; `None`
    /// until both were measured.
    fn slowdown(&self, busy: Busy) -> Option<f64> {
        let quiet = self.quiet?;
        let busy = match busy {
            Busy::Quiet => return Some(0.0),
            Busy::Here => self.here?,
            Busy::Pulling => self.pulling?,
            Busy::Elsewhere => self.elsewhere?,
        };
        if busy <= 0.0 {
            return Some(0.0);
        }
        Some((1.0 - quiet / busy).clamp(0.0, 1.0))
    }
}

/// The measurements, shared by every request of a router.
#[derive(Debug, Default)]
pub struct Costs {
    state: Arc<Mutex<State>>,
}

/// What the router counts as in flight on a node.
#[derive(Debug, Clone, Copy)]
enum Work {
    /// Prompt tokens sent to compute.
    Prompt,
    /// KV pulls into a decode node.
    Pull,
}

/// Work counted as in flight on a node until dropped.
#[derive(Debug)]
pub struct InFlight {
    state: Arc<Mutex<State>>,
    work: Work,
    node: NodeId,
    amount: u64,
    /// What was in flight on the node before this (prompt tokens queued ahead).
    pub ahead: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        if let Some(n) = state.in_flight(self.work).get_mut(&self.node) {
            *n = n.saturating_sub(self.amount);
        }
    }
}

impl State {
    fn in_flight(&mut self, work: Work) -> &mut HashMap<NodeId, u64> {
        match work {
            Work::Prompt => &mut self.queued,
            Work::Pull => &mut self.pulling,
        }
    }

    /// The prefill fits of `path`'s nodes.
    fn fits(&self, path: Path) -> &HashMap<NodeId, Fit> {
        match path {
            Path::Remote => &self.prefill,
            Path::Local => &self.local,
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Costs {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn hold(&self, work: Work, node: NodeId, amount: u64) -> InFlight {
        let mut state = self.state();
        let n = state.in_flight(work).entry(node).or_default();
        let ahead = *n;
        *n += amount;
        InFlight {
            state: self.state.clone(),
            work,
            node,
            amount,
            ahead,
        }
    }

    /// Counts `tokens` to compute as queued on `node` until the guard is dropped.
    pub fn queue(&self, node: NodeId, tokens: u64) -> InFlight {
        self.hold(Work::Prompt, node, tokens)
    }

    /// Counts a KV pull as in flight on decode node `node` until the guard is dropped.
    pub fn pull(&self, node: NodeId) -> InFlight {
        self.hold(Work::Pull, node, 1)
    }

    /// Prompt tokens queued on `node` now.
    pub fn queued(&self, node: NodeId) -> u64 {
        self.state().queued.get(&node).copied().unwrap_or(0)
    }

    /// A `Prefill` on `node` computed `tokens` (with those queued ahead of it) in `seconds`.
    pub fn prefilled(&self, node: NodeId, tokens: u64, seconds: f64) {
        (self.state().prefill.entry(node).or_default()).add(tokens as f64, seconds);
    }

    /// Decode node `node` computed `tokens` of a prompt itself (with those queued ahead of
    /// it) and sent its first message after `seconds`.
    pub fn computed_locally(&self, node: NodeId, tokens: u64, seconds: f64) {
        (self.state().local.entry(node).or_default()).add(tokens as f64, seconds);
    }

    /// Decode node `decode` pulled `bytes` of KV from `prefill` and sent its first message
    /// after `seconds`.
    pub fn transferred(&self, prefill: NodeId, decode: NodeId, bytes: u64, seconds: f64) {
        (self.state().transfer.entry((prefill, decode)).or_default()).add(bytes as f64, seconds);
    }

    /// One gap of `seconds` between two messages of a stream on decode node `node`, filed by
    /// what the router had in flight at its end.
    pub fn stepped(&self, node: NodeId, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let mut state = self.state();
        let busy_on = |map: &HashMap<NodeId, u64>, n: NodeId| map.get(&n).is_some_and(|v| *v > 0);
        let busy_anywhere = |map: &HashMap<NodeId, u64>| map.values().any(|v| *v > 0);
        let busy = if busy_on(&state.queued, node) {
            Busy::Here
        } else if busy_on(&state.pulling, node) {
            Busy::Pulling
        } else if busy_anywhere(&state.queued) || busy_anywhere(&state.pulling) {
            Busy::Elsewhere
        } else {
            Busy::Quiet
        };
        let slot = state.step.entry(node).or_default().slot(busy);
        *slot = Some(match *slot {
            Some(step) => step * (1.0 - STEP_DECAY) + seconds * STEP_DECAY,
            None => seconds,
        });
    }

    /// The fraction by which `busy` (a prompt computed on the decode node itself, a KV pull
    /// into it, work elsewhere) slows decode node `node`'s steps, as measured; `None` until
    /// it was.
    pub fn slowdown(&self, node: NodeId, busy: Busy) -> Option<f64> {
        self.state().step.get(&node).and_then(|s| s.slowdown(busy))
    }

    /// A KV handle of `node` said one block is `bytes`.
    pub fn saw_block_bytes(&self, node: NodeId, bytes: u64) {
        self.state().block_bytes.insert(node, bytes);
    }

    /// Seconds for `node` to compute `tokens` after those queued on it and answer (a
    /// prefill node's `Prefill` for [`Path::Remote`], a decode node's first message for
    /// [`Path::Local`]); from the prefill nodes' measurements (the same engine) while it has
    /// none of its own. `None` before any prefill was measured.
    pub fn prefill(&self, path: Path, node: NodeId, tokens: u64) -> Option<f64> {
        let state = self.state();
        let units = (tokens + state.queued.get(&node).copied().unwrap_or(0)) as f64;
        (state.fits(path).get(&node))
            .and_then(|f| f.predict(units))
            .or_else(|| mean(state.prefill.values().filter_map(|f| f.predict(units))))
    }

    /// Seconds of compute alone (no fixed part, nothing queued) for `node` to compute
    /// `tokens` on `path`: how long a node's streams wait for it, at most.
    pub fn compute(&self, path: Path, node: NodeId, tokens: u64) -> f64 {
        let state = self.state();
        let per_token = |f: &Fit| f.line().map(|(_, per)| per);
        let per = (state.fits(path).get(&node))
            .and_then(per_token)
            .or_else(|| mean(state.prefill.values().filter_map(per_token)));
        per.unwrap_or(0.0) * tokens as f64
    }

    /// Seconds from `Decode` to the first message when decode node `decode` pulls `blocks`
    /// blocks from `prefill`; from other pairs' measurements while this pair has none, and 0
    /// before any transfer was measured.
    pub fn transfer(&self, prefill: NodeId, decode: NodeId, blocks: u64) -> f64 {
        let state = self.state();
        let bytes = blocks * state.block_bytes.get(&prefill).copied().unwrap_or(0);
        let units = bytes as f64;
        state
            .transfer
            .get(&(prefill, decode))
            .and_then(|f| f.predict(units))
            .or_else(|| mean(state.transfer.values().filter_map(|f| f.predict(units))))
            .unwrap_or(0.0)
    }

    /// Seconds per decode step on `node` (0 before its first stream).
    pub fn step(&self, node: NodeId) -> f64 {
        (self.state().step.get(&node))
            .and_then(Steps::any)
            .unwrap_or(0.0)
    }
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / f64::from(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_work_is_counted_until_its_guard_drops() {
        let costs = Costs::default();
        let a = costs.queue(1, 100);
        let b = costs.queue(1, 50);
        assert_eq!((a.ahead, b.ahead), (0, 100));
        assert_eq!(costs.queued(1), 150);
        drop(a);
        assert_eq!(costs.queued(1), 50);
        drop(b);
        assert_eq!(costs.queued(1), 0);
    }

    #[test]
    fn a_decode_node_without_measurements_borrows_the_prefill_nodes_rate() {
        let costs = Costs::default();
        assert_eq!(costs.prefill(Path::Local, 7, 100), None);
        for tokens in [10, 100, 300] {
            costs.prefilled(1, tokens, 0.001 * tokens as f64);
        }
        let borrowed = costs.prefill(Path::Local, 7, 100).unwrap();
        assert!((borrowed - 0.1).abs() < 1e-9, "{borrowed}");
        for tokens in [10, 100, 300] {
            costs.computed_locally(7, tokens, 0.002 * tokens as f64);
        }
        let own = costs.prefill(Path::Local, 7, 100).unwrap();
        assert!((own - 0.2).abs() < 1e-9, "{own}");
    }

    #[test]
    fn queued_tokens_make_a_node_slower() {
        let costs = Costs::default();
        for tokens in [10, 100, 300] {
            costs.prefilled(1, tokens, 0.001 * tokens as f64);
        }
        let idle = costs.prefill(Path::Remote, 1, 100).unwrap();
        let _busy = costs.queue(1, 400);
        let queued = costs.prefill(Path::Remote, 1, 100).unwrap();
        assert!(queued > idle * 4.0, "{idle} {queued}");
    }

    #[test]
    fn steps_are_filed_by_what_was_being_computed() {
        let costs = Costs::default();
        assert_eq!(costs.slowdown(2, Busy::Here), None);
        costs.stepped(2, 0.010);
        let here = costs.queue(2, 100);
        costs.stepped(2, 0.040);
        drop(here);
        let elsewhere = costs.queue(1, 100);
        costs.stepped(2, 0.0125);
        drop(elsewhere);
        assert_eq!(costs.slowdown(2, Busy::Quiet), Some(0.0));
        assert!((costs.slowdown(2, Busy::Here).unwrap() - 0.75).abs() < 1e-9);
        assert!((costs.slowdown(2, Busy::Elsewhere).unwrap() - 0.2).abs() < 1e-9);
        assert_eq!(costs.step(2), 0.010);
    }

    #[test]
    fn steps_during_a_pull_are_filed_apart_from_quiet_ones() {
        let costs = Costs::default();
        costs.stepped(2, 0.010);
        let pull = costs.pull(2);
        costs.stepped(2, 0.020);
        // A pull into another node is work elsewhere for node 3.
        costs.stepped(3, 0.030);
        drop(pull);
        costs.stepped(3, 0.015);
        assert!((costs.slowdown(2, Busy::Pulling).unwrap() - 0.5).abs() < 1e-9);
        assert!((costs.slowdown(3, Busy::Elsewhere).unwrap() - 0.5).abs() < 1e-9);
        // The quiet step time is untouched by the steps taken during the pull.
        assert_eq!(costs.step(2), 0.010);
        assert_eq!(costs.slowdown(2, Busy::Here), None);
    }

    #[test]
    fn transfers_scale_with_the_blocks_pulled() {
        let costs = Costs::default();
        assert_eq!(costs.transfer(1, 2, 10), 0.0);
        costs.saw_block_bytes(1, 1000);
        for blocks in [1u64, 10, 40] {
            costs.transferred(1, 2, blocks * 1000, 0.001 + 0.0001 * blocks as f64);
        }
        let few = costs.transfer(1, 2, 2);
        let many = costs.transfer(1, 2, 20);
        assert!(many > few, "{few} {many}");
        // Another pair borrows this one's measurements.
        assert_eq!(costs.transfer(1, 3, 20), many);
    }
}
