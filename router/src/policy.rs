//! Which node serves a request: one small trait, three policies.
//!
//! - [`RoundRobin`]: the next candidate in turn.
//! - [`LeastLoaded`]: the candidate with the least load; equal loads take turns.
//! - [`PrefixAware`] (the default): the candidate most likely to hold the prompt's prefix in
//!   its prefix cache, balanced by load. Each candidate gets a **score** from the prompt's
//!   leading blocks (the engines' own hash, [`pd_engine::kv::prefix::hash::block_hashes`], the
//!   request's cache salt applied, the node's block size), in half blocks:
//!   - while the node's cache events are in sync ([`crate::cache_index`]: the node's own
//!     report of what its device and host tiers hold), `2 × device + host`: the leading
//!     blocks on its device count 2, the blocks after them it would restore from its host
//!     tier count 1 (a restore is a copy, cheaper than computing, dearer than a device hit);
//!   - otherwise (no stream yet, a broken or lagging stream, a node too old to publish one)
//!     the router's own guess: an LRU set, per node, of the block hashes of the prompts it
//!     sent there (bounded by `--prefix-index-blocks`), its leading matches counted as device
//!     blocks (`2 × matched`);
//!   - when no candidate's events report any of the prompt (new, or evicted everywhere), the
//!     guess scores every candidate, so the prompt returns to the node that last computed it
//!     rather than spreading over the nodes.
//!
//!   Then, with `best` the highest score:
//!   1. `best == 0`: least loaded (equal loads take turns).
//!   2. Otherwise the **contenders** are the candidates within an eighth of the best score
//!      (`score >= best − best/8`: near-ties count as ties); among them the least loaded
//!      wins, then the higher score, then turns.
//!   3. Cache affinity yields to balance: if the winner's load exceeds the least loaded
//!      candidate's by more than [`BALANCE_ABS`] requests *and* is more than
//!      [`BALANCE_REL`] times it, the least loaded candidate is taken instead (ties: higher
//!      score).
//!
//!   The chosen node's guess then records the prompt's blocks as most recently used, last
//!   block first, so a prompt's tail is forgotten before its head (as the engines evict); it
//!   learns every choice, in sync or not, so it is warm when a stream breaks. A node's guess
//!   is dropped whenever the node comes back up after being down (it may have restarted with
//!   an empty cache).
//!
//! Decode nodes in the cluster: with the prefix-aware policy, [`DecodeAffinity`] takes the
//! least loaded compatible decode node and, among equally loaded ones, the one whose in-sync
//! cache events hold most of the prompt's earlier KV (e.g. the previous turn of a
//! conversation: it pulls less from the prefill node); a node out of sync scores 0, so with
//! no stream anywhere this is [`LeastLoaded`]. With the other policies decode nodes are chosen by [`LeastLoaded`]. In
//! aggregated mode the decode nodes compute the prompt and are chosen by the policy itself.
//!
//! Parts: `prefix` (the prefix-aware policies and their scoring), `lru` (the router's guess).

mod lru;
mod prefix;

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pd_engine::kv::prefix::hash::HashAlgo;

pub use self::prefix::{DecodeAffinity, PrefixAware};
use crate::cache_index::SharedIndex;
use crate::config::PolicyKind;

/// Prefix affinity is dropped only when the preferred node has more than this many requests
/// above the least loaded one...
pub const BALANCE_ABS: u64 = 4;
/// ...and more than this many times its load.
pub const BALANCE_REL: u64 = 2;

/// One node a request may go to, as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The registry's node id.
    pub node: usize,
    pub load: u64,
    /// The node's KV block size (prefix hashes depend on it).
    pub block_size: usize,
    /// Changes whenever the node comes back up: what the policy remembers about an older
    /// epoch is stale.
    pub epoch: u64,
}

/// What a policy may look at in a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    pub tokens: &'a [u32],
    pub cache_salt: Option<&'a str>,
}

/// A way to choose among candidate nodes.
pub trait RoutingPolicy: Send + Sync + Debug {
    fn name(&self) -> &'static str;

    /// The index in `candidates` (never empty) of the node to use, remembering the choice
    /// where the policy learns from it.
    fn choose(&self, input: &RouteInput<'_>, candidates: &[Candidate]) -> usize;
}

/// The policy `kind` for the nodes that compute the prompt; a prefix-aware one scores nodes
/// by `index` while they are in sync, and remembers `prefix_index_blocks` block hashes per
/// node as its guess otherwise, hashed with `algo` (the nodes' `--prefix-caching-hash-algo`).
pub fn build(
    kind: PolicyKind,
    prefix_index_blocks: usize,
    algo: HashAlgo,
    index: Arc<SharedIndex>,
) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded::default()),
        PolicyKind::PrefixAware => Box::new(
            PrefixAware::new(prefix_index_blocks)
                .with_algo(algo)
                .with_index(index),
        ),
    }
}

/// How decode nodes are chosen in the cluster under policy `kind` (see the module doc).
pub fn build_decode(
    kind: PolicyKind,
    algo: HashAlgo,
    index: Arc<SharedIndex>,
) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::PrefixAware => Box::new(DecodeAffinity::new(index, algo)),
        PolicyKind::RoundRobin | PolicyKind::LeastLoaded => Box::new(LeastLoaded::default()),
    }
}

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn choose(&self, _input: &RouteInput<'_>, candidates: &[Candidate]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()
    }
}

#[derive(Debug, Default)]
pub struct LeastLoaded {
    turn: AtomicUsize,
}

impl LeastLoaded {
    /// The least loaded of `among` (indices into `candidates`), ranked then by `tie` (higher
    /// first), then by turns.
    fn pick(
        &self,
        candidates: &[Candidate],
        among: &[usize],
        tie: impl Fn(usize) -> usize,
    ) -> usize {
        let key = |i: usize| (candidates[i].load, std::cmp::Reverse(tie(i)));
        let best = among
            .iter()
            .map(|&i| key(i))
            .min()
            .expect("candidates are never empty");
        let tied: Vec<usize> = among.iter().copied().filter(|&i| key(i) == best).collect();
        tied[self.turn.fetch_add(1, Ordering::Relaxed) % tied.len()]
    }
}

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn choose(&self, _input: &RouteInput<'_>, candidates: &[Candidate]) -> usize {
        let all: Vec<usize> = (0..candidates.len()).collect();
        self.pick(candidates, &all, |_| 0)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Candidates `10 + i` with these loads, block size 4 (shared with `prefix`'s tests).
    pub(crate) fn cands(loads: &[u64]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                node: 10 + i,
                load,
                block_size: 4,
                epoch: 1,
            })
            .collect()
    }

    pub(crate) fn input(tokens: &[u32]) -> RouteInput<'_> {
        RouteInput {
            tokens,
            cache_salt: None,
        }
    }

    #[test]
    fn round_robin_cycles() {
        let p = RoundRobin::default();
        let c = cands(&[5, 0, 9]);
        let picks: Vec<usize> = (0..6).map(|_| p.choose(&input(&[1]), &c)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_loaded_picks_min_and_rotates_ties() {
        let p = LeastLoaded::default();
        assert_eq!(p.choose(&input(&[1]), &cands(&[3, 1, 2])), 1);
        let c = cands(&[1, 0, 0]);
        let mut picks: Vec<usize> = (0..4).map(|_| p.choose(&input(&[1]), &c)).collect();
        picks.sort();
        assert_eq!(picks, [1, 1, 2, 2], "equal loads take turns");
    }
}
