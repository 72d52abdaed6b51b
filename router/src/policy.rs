//! Which prefill node serves a request: one small trait, three policies.
//!
//! - [`RoundRobin`]: the next candidate in turn.
//! - [`LeastLoaded`]: the candidate with the least load; equal loads take turns.
//! - [`PrefixAware`] (the default): the candidate most likely to hold the prompt's prefix in
//!   its prefix cache, balanced by load. The router remembers, per prefill node, an LRU set of
//!   the block hashes of the prompts it sent there (bounded by `--prefix-index-blocks`), with
//!   the engines' own hash ([`pd_engine::kv::hash::block_hashes`], the request's cache salt
//!   applied, the node's block size), and scores each candidate by the number of leading
//!   prompt blocks found in its set (`matched`). Then, with `best` the highest score:
//!   1. `best == 0`: least loaded (equal loads take turns).
//!   2. Otherwise the **contenders** are the candidates within an eighth of the best match
//!      (`matched >= best − best/8`: near-ties count as ties); among them the least loaded
//!      wins, then the longer match, then turns.
//!   3. Cache affinity yields to balance: if the winner's load exceeds the least loaded
//!      candidate's by more than [`BALANCE_ABS`] requests *and* is more than
//!      [`BALANCE_REL`] times it, the least loaded candidate is taken instead (ties: longer
//!      match).
//!
//!   The chosen node's set then records the prompt's blocks as most recently used, last block
//!   first, so a prompt's tail is forgotten before its head (as the engines evict). A node's
//!   set is dropped whenever the node comes back up after being down (it may have restarted
//!   with an empty cache).
//!
//! Decode nodes are always chosen by [`LeastLoaded`] among the compatible ones.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

#[cfg(test)]
use pd_engine::kv::hash::block_hashes;
use pd_engine::kv::hash::{BlockHash, HashAlgo, block_hashes_with};

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

/// The policy `kind`; a prefix-aware one remembers `prefix_index_blocks` block hashes per
/// node, hashed with `algo` (the nodes' `--prefix-caching-hash-algo`).
pub fn build(
    kind: PolicyKind,
    prefix_index_blocks: usize,
    algo: HashAlgo,
) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded::default()),
        PolicyKind::PrefixAware => Box::new(PrefixAware::new(prefix_index_blocks).with_algo(algo)),
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

/// Prefix-cache-aware routing (see the module doc).
#[derive(Debug)]
pub struct PrefixAware {
    capacity: usize,
    indexes: Mutex<HashMap<usize, PrefixIndex>>,
    balance: LeastLoaded,
    algo: HashAlgo,
}

impl PrefixAware {
    /// `capacity`: block hashes remembered per node.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            indexes: Mutex::new(HashMap::new()),
            balance: LeastLoaded::default(),
            algo: HashAlgo::default(),
        }
    }

    /// Hashes blocks with `algo` (the nodes' hash), not XXH3.
    pub fn with_algo(mut self, algo: HashAlgo) -> Self {
        self.algo = algo;
        self
    }

    /// Leading blocks of `input` the policy believes `candidate` holds.
    pub fn matched_blocks(&self, input: &RouteInput<'_>, candidate: &Candidate) -> usize {
        let bs = candidate.block_size.max(1);
        let hashes = block_hashes_with(input.tokens, bs, input.cache_salt, self.algo);
        let indexes = self.indexes.lock().unwrap_or_else(|e| e.into_inner());
        indexes
            .get(&candidate.node)
            .filter(|ix| ix.epoch == candidate.epoch)
            .map_or(0, |ix| ix.matched(&hashes))
    }
}

impl RoutingPolicy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix-aware"
    }

    fn choose(&self, input: &RouteInput<'_>, candidates: &[Candidate]) -> usize {
        // Hashes per distinct block size (one in any sane cluster).
        let mut by_size: Vec<(usize, Vec<BlockHash>)> = Vec::new();
        for c in candidates {
            let bs = c.block_size.max(1);
            if !by_size.iter().any(|(s, _)| *s == bs) {
                let hashes = block_hashes_with(input.tokens, bs, input.cache_salt, self.algo);
                by_size.push((bs, hashes));
            }
        }
        let hashes_for = |bs: usize| {
            &by_size
                .iter()
                .find(|(s, _)| *s == bs.max(1))
                .expect("hashed above")
                .1
        };
        let mut indexes = self.indexes.lock().unwrap_or_else(|e| e.into_inner());
        let matched: Vec<usize> = candidates
            .iter()
            .map(|c| {
                indexes
                    .get(&c.node)
                    .filter(|ix| ix.epoch == c.epoch)
                    .map_or(0, |ix| ix.matched(hashes_for(c.block_size)))
            })
            .collect();
        let best = matched.iter().copied().max().unwrap_or(0);
        let all: Vec<usize> = (0..candidates.len()).collect();
        let by_match = |i: usize| matched[i];
        let pick = if best == 0 {
            self.balance.pick(candidates, &all, |_| 0)
        } else {
            let slack = best / 8;
            let contenders: Vec<usize> = all
                .iter()
                .copied()
                .filter(|&i| matched[i] + slack >= best)
                .collect();
            let winner = self.balance.pick(candidates, &contenders, by_match);
            let min_load = candidates.iter().map(|c| c.load).min().unwrap_or(0);
            let load = candidates[winner].load;
            if load > min_load + BALANCE_ABS && load > min_load.saturating_mul(BALANCE_REL) {
                self.balance.pick(candidates, &all, by_match)
            } else {
                winner
            }
        };
        let chosen = &candidates[pick];
        let index = indexes
            .entry(chosen.node)
            .or_insert_with(|| PrefixIndex::new(self.capacity, chosen.epoch));
        if index.epoch != chosen.epoch {
            *index = PrefixIndex::new(self.capacity, chosen.epoch);
        }
        index.insert(hashes_for(chosen.block_size));
        pick
    }
}

/// A bounded set of block hashes with least-recently-used eviction.
#[derive(Debug)]
struct PrefixIndex {
    capacity: usize,
    epoch: u64,
    clock: u64,
    stamps: HashMap<BlockHash, u64>,
    by_age: BTreeMap<u64, BlockHash>,
}

impl PrefixIndex {
    fn new(capacity: usize, epoch: u64) -> Self {
        Self {
            capacity,
            epoch,
            clock: 0,
            stamps: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    /// Leading hashes present (hashes are chained: block i stands for blocks 0..=i).
    fn matched(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamps.contains_key(h))
            .count()
    }

    /// Marks a prompt's blocks most recently used, its first block the most recent.
    fn insert(&mut self, hashes: &[BlockHash]) {
        for &h in hashes.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamps.insert(h, self.clock) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.clock, h);
        }
        while self.stamps.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.stamps.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(loads: &[u64]) -> Vec<Candidate> {
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

    fn input(tokens: &[u32]) -> RouteInput<'_> {
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

    #[test]
    fn prefix_aware_follows_the_prefix() {
        let p = PrefixAware::new(1000);
        let c = cands(&[0, 0, 0]);
        let doc: Vec<u32> = (0..64).collect();
        let first = p.choose(&input(&doc), &c);
        // The same prompt, and one extending it, go back to the same node.
        for _ in 0..3 {
            assert_eq!(p.choose(&input(&doc), &c), first);
        }
        let mut longer = doc.clone();
        longer.extend(100..120);
        assert_eq!(p.choose(&input(&longer), &c), first);
        assert_eq!(p.matched_blocks(&input(&longer), &c[first]), 21);
        // A salt isolates: no affinity across salts.
        let salted = RouteInput {
            tokens: &doc,
            cache_salt: Some("tenant"),
        };
        assert_eq!(p.matched_blocks(&salted, &c[first]), 0);
    }

    #[test]
    fn prefix_aware_spreads_cold_prompts() {
        let p = PrefixAware::new(1000);
        let c = cands(&[0, 0]);
        let a: Vec<u32> = (0..32).collect();
        let b: Vec<u32> = (1000..1032).collect();
        let na = p.choose(&input(&a), &c);
        let nb = p.choose(&input(&b), &c);
        assert_ne!(na, nb, "unknown prompts at equal load take turns");
        assert_eq!(p.choose(&input(&a), &c), na);
        assert_eq!(p.choose(&input(&b), &c), nb);
    }

    #[test]
    fn prefix_aware_balances_by_load() {
        let p = PrefixAware::new(1000);
        let doc: Vec<u32> = (0..64).collect();
        let home = p.choose(&input(&doc), &cands(&[0, 0]));
        let other = 1 - home;
        // A little more load on the node with the prefix: affinity wins.
        let mut loads = [0u64; 2];
        loads[home] = 3;
        assert_eq!(p.choose(&input(&doc), &cands(&loads)), home);
        loads[home] = BALANCE_ABS;
        assert_eq!(p.choose(&input(&doc), &cands(&loads)), home);
        // Far more: balance wins.
        loads[home] = 50;
        loads[other] = 2;
        assert_eq!(p.choose(&input(&doc), &cands(&loads)), other);
        // Near-ties in match length are decided by load.
        let p = PrefixAware::new(1000);
        let c = cands(&[0, 0]);
        let long: Vec<u32> = (0..160).collect(); // 40 blocks
        let n0 = p.choose(&input(&long), &c);
        // The other node learns the first 36 blocks (within 1/8 of 40).
        let mut only = c.clone();
        only.remove(n0);
        assert_eq!(p.choose(&input(&long[..144]), &only), 0);
        assert_eq!(
            p.choose(&input(&long), &c),
            n0,
            "equal load: the longer match"
        );
        let mut loads = [0u64; 2];
        loads[n0] = 1;
        assert_eq!(p.choose(&input(&long), &cands(&loads)), 1 - n0);
    }

    #[test]
    fn prefix_index_is_bounded_and_forgets_tails_first() {
        let mut ix = PrefixIndex::new(4, 0);
        let a = block_hashes(&(0..12).collect::<Vec<u32>>(), 4, None); // 3 blocks
        let b = block_hashes(&(100..108).collect::<Vec<u32>>(), 4, None); // 2 blocks
        ix.insert(&a);
        ix.insert(&b);
        assert_eq!(ix.stamps.len(), 4);
        assert_eq!(ix.matched(&b), 2);
        assert_eq!(ix.matched(&a), 2, "a's last block went first");
    }

    #[test]
    fn a_node_back_from_down_starts_empty() {
        let p = PrefixAware::new(100);
        let doc: Vec<u32> = (0..32).collect();
        let c = cands(&[0]);
        p.choose(&input(&doc), &c);
        assert_eq!(p.matched_blocks(&input(&doc), &c[0]), 8);
        let mut restarted = c[0];
        restarted.epoch += 1;
        assert_eq!(p.matched_blocks(&input(&doc), &restarted), 0);
    }
}
