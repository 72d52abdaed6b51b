//! Prefix-cache-aware choices (the rules are the parent module's doc): [`PrefixAware`] for
//! the nodes that compute the prompt, [`DecodeAffinity`] for decode nodes in the cluster, and
//! the scoring and balancing both share. Not here: the index the nodes feed
//! ([`crate::cache_index`]) and the router's own guess ([`super::lru`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pd_engine::kv::prefix::hash::{BlockHash, HashAlgo, block_hashes_with};

use super::lru::PrefixIndex;
use super::{BALANCE_ABS, BALANCE_REL, Candidate, LeastLoaded, RouteInput, RoutingPolicy};
use crate::cache_index::{SharedIndex, TierMatch};

/// A candidate's score in half blocks: a device block counts 2, a host block 1. A host hit
/// saves the block's computation too, but costs a copy back to the device before the request
/// can run (and restores of concurrent requests queue for the same link), so a node holding a
/// prefix on its device is worth more than one that would restore it; half a device block
/// keeps a long host run ahead of a short device run, which still saves more work.
fn score(m: TierMatch) -> usize {
    2 * m.device + m.host
}

/// The prompt's block hashes per distinct block size among `candidates` (one in any sane
/// cluster).
struct Hashes<'a> {
    input: &'a RouteInput<'a>,
    algo: HashAlgo,
    by_size: Vec<(usize, Vec<BlockHash>)>,
}

impl<'a> Hashes<'a> {
    fn new(input: &'a RouteInput<'a>, algo: HashAlgo) -> Self {
        Self {
            input,
            algo,
            by_size: Vec::new(),
        }
    }

    fn of(&mut self, block_size: usize) -> &[BlockHash] {
        let bs = block_size.max(1);
        let i = match self.by_size.iter().position(|(s, _)| *s == bs) {
            Some(i) => i,
            None => {
                let (tokens, salt) = (self.input.tokens, self.input.cache_salt);
                let hashes = block_hashes_with(tokens, bs, salt, self.algo);
                self.by_size.push((bs, hashes));
                self.by_size.len() - 1
            }
        };
        &self.by_size[i].1
    }
}

/// The choice among `candidates` given each one's `scores` (the module doc's rules 1–3).
fn decide(balance: &LeastLoaded, candidates: &[Candidate], scores: &[usize]) -> usize {
    let best = scores.iter().copied().max().unwrap_or(0);
    let all: Vec<usize> = (0..candidates.len()).collect();
    let by_score = |i: usize| scores[i];
    if best == 0 {
        return balance.pick(candidates, &all, |_| 0);
    }
    let slack = best / 8;
    let contenders: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| scores[i] + slack >= best)
        .collect();
    let winner = balance.pick(candidates, &contenders, by_score);
    let min_load = candidates.iter().map(|c| c.load).min().unwrap_or(0);
    let load = candidates[winner].load;
    if load > min_load + BALANCE_ABS && load > min_load.saturating_mul(BALANCE_REL) {
        balance.pick(candidates, &all, by_score)
    } else {
        winner
    }
}

/// Prefix-cache-aware routing of the nodes that compute the prompt (see the module doc).
#[derive(Debug)]
pub struct PrefixAware {
    capacity: usize,
    guesses: Mutex<HashMap<usize, PrefixIndex>>,
    balance: LeastLoaded,
    algo: HashAlgo,
    /// What the nodes report they cache (`None`: the router's guess only).
    index: Option<Arc<SharedIndex>>,
}

impl PrefixAware {
    /// `capacity`: block hashes the router's guess remembers per node.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            guesses: Mutex::new(HashMap::new()),
            balance: LeastLoaded::default(),
            algo: HashAlgo::default(),
            index: None,
        }
    }

    /// Hashes blocks with `algo` (the nodes' hash), not XXH3.
    pub fn with_algo(mut self, algo: HashAlgo) -> Self {
        self.algo = algo;
        self
    }

    /// Scores a node by what `index` says it caches while its view is in sync.
    pub fn with_index(mut self, index: Arc<SharedIndex>) -> Self {
        self.index = Some(index);
        self
    }

    /// Leading blocks of `input` the router's own guess believes `candidate` holds.
    pub fn guessed_blocks(&self, input: &RouteInput<'_>, candidate: &Candidate) -> usize {
        let bs = candidate.block_size.max(1);
        let hashes = block_hashes_with(input.tokens, bs, input.cache_salt, self.algo);
        let guesses = self.guesses.lock().unwrap_or_else(|e| e.into_inner());
        guesses
            .get(&candidate.node)
            .filter(|g| g.epoch == candidate.epoch)
            .map_or(0, |g| g.matched(&hashes))
    }
}

impl RoutingPolicy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix-aware"
    }

    fn choose(&self, input: &RouteInput<'_>, candidates: &[Candidate]) -> usize {
        let mut hashes = Hashes::new(input, self.algo);
        let mut guesses = self.guesses.lock().unwrap_or_else(|e| e.into_inner());
        // Per candidate: what its cache events say it holds (None: not in sync), and what the
        // guess says (the node computed those blocks recently: taken for device blocks).
        let (reported, guessed): (Vec<Option<usize>>, Vec<usize>) = candidates
            .iter()
            .map(|c| {
                let hashes = hashes.of(c.block_size);
                let reported = self.index.as_ref().and_then(|ix| ix.lookup(c.node, hashes));
                let guessed = guesses
                    .get(&c.node)
                    .filter(|g| g.epoch == c.epoch)
                    .map_or(0, |g| {
                        score(TierMatch {
                            device: g.matched(hashes),
                            host: 0,
                        })
                    });
                (reported.map(score), guessed)
            })
            .unzip();
        // A prompt that no node is reported to hold any of (evicted everywhere, or new) goes
        // where the guess says it went last, so that each prefix keeps returning to one node
        // rather than spreading over all of them and evicting more (load still balances).
        let nothing_held = reported.iter().all(|r| r.is_none_or(|s| s == 0));
        let scores: Vec<usize> = (reported.iter().zip(&guessed))
            .map(|(r, g)| match r {
                Some(s) if !nothing_held => *s,
                _ => *g,
            })
            .collect();
        let pick = decide(&self.balance, candidates, &scores);
        // The guess learns every choice, so that it is warm when a node's stream breaks.
        let chosen = &candidates[pick];
        let guess = guesses
            .entry(chosen.node)
            .or_insert_with(|| PrefixIndex::new(self.capacity, chosen.epoch));
        if guess.epoch != chosen.epoch {
            *guess = PrefixIndex::new(self.capacity, chosen.epoch);
        }
        guess.insert(hashes.of(chosen.block_size));
        pick
    }
}

/// Decode nodes in the cluster: the least loaded, and among equally loaded ones the one
/// holding most of the prompt's earlier KV (an earlier turn of the conversation, by what it
/// reports in its cache events). Load comes first because on a decode node a hit saves only
/// the pull of those blocks, once, while a busier node slows every token of the stream; and
/// a node that joins empty (scaled out, restarted) must take traffic at once.
#[derive(Debug)]
pub struct DecodeAffinity {
    index: Arc<SharedIndex>,
    balance: LeastLoaded,
    algo: HashAlgo,
}

impl DecodeAffinity {
    pub fn new(index: Arc<SharedIndex>, algo: HashAlgo) -> Self {
        Self {
            index,
            balance: LeastLoaded::default(),
            algo,
        }
    }
}

impl RoutingPolicy for DecodeAffinity {
    fn name(&self) -> &'static str {
        "prefix-aware"
    }

    fn choose(&self, input: &RouteInput<'_>, candidates: &[Candidate]) -> usize {
        let mut hashes = Hashes::new(input, self.algo);
        let scores: Vec<usize> = candidates
            .iter()
            .map(|c| {
                let hashes = hashes.of(c.block_size);
                self.index.lookup(c.node, hashes).map_or(0, score)
            })
            .collect();
        let all: Vec<usize> = (0..candidates.len()).collect();
        self.balance.pick(candidates, &all, |i| scores[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache_index::{Snapshot, Tier};
    use crate::policy::tests::{cands, input};
    use pd_engine::kv::prefix::events::{CacheEvent, EventBatch};

    fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
        block_hashes_with(tokens, 4, None, HashAlgo::default())
    }

    /// An index where node `10 + i` holds `device[i]` and `host[i]`.
    fn index(nodes: &[(Vec<BlockHash>, Vec<BlockHash>)]) -> Arc<SharedIndex> {
        let ix = Arc::new(SharedIndex::new(10_000));
        for (i, (device, host)) in nodes.iter().enumerate() {
            let snap = Snapshot {
                epoch: 1,
                seq: 0,
                block_size: 4,
                device_capacity: 1000,
                host_capacity: 1000,
                device: device.clone(),
                host: host.clone(),
            };
            ix.update(|ix| ix.apply_snapshot(10 + i, snap)).unwrap();
        }
        ix
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
        assert_eq!(p.guessed_blocks(&input(&longer), &c[first]), 21);
        // A salt isolates: no affinity across salts.
        let salted = RouteInput {
            tokens: &doc,
            cache_salt: Some("tenant"),
        };
        assert_eq!(p.guessed_blocks(&salted, &c[first]), 0);
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
    fn a_node_back_from_down_starts_empty() {
        let p = PrefixAware::new(100);
        let doc: Vec<u32> = (0..32).collect();
        let c = cands(&[0]);
        p.choose(&input(&doc), &c);
        assert_eq!(p.guessed_blocks(&input(&doc), &c[0]), 8);
        let mut restarted = c[0];
        restarted.epoch += 1;
        assert_eq!(p.guessed_blocks(&input(&doc), &restarted), 0);
    }

    #[test]
    fn a_prompt_no_node_holds_returns_to_the_node_that_last_computed_it() {
        let doc: Vec<u32> = (0..64).collect();
        // Both nodes in sync and holding nothing (the prompt was evicted everywhere).
        let ix = index(&[(vec![], vec![]), (vec![], vec![])]);
        let p = PrefixAware::new(1000).with_index(ix);
        let c = cands(&[0, 0]);
        let home = p.choose(&input(&doc), &c);
        let other: Vec<u32> = (1000..1064).collect();
        assert_ne!(
            p.choose(&input(&other), &c),
            home,
            "cold prompts take turns"
        );
        for _ in 0..3 {
            assert_eq!(p.choose(&input(&doc), &c), home, "not spread by turns");
        }
    }

    #[test]
    fn reported_caches_beat_the_guess_and_device_beats_host() {
        let doc: Vec<u32> = (0..64).collect(); // 16 blocks
        let h = hashes(&doc);
        // Node 0 holds the prompt on its host tier, node 1 on its device.
        let ix = index(&[(vec![], h.clone()), (h.clone(), vec![]), (vec![], vec![])]);
        let p = PrefixAware::new(1000).with_index(ix.clone());
        let c = cands(&[0, 0, 0]);
        assert_eq!(p.choose(&input(&doc), &c), 1, "device beats host");
        // Without node 1, the host copy beats a node holding nothing.
        let c02 = vec![c[0], c[2]];
        assert_eq!(p.choose(&input(&doc), &c02), 0);
        // A long host run beats a short device run: 16 host blocks (16) > 6 device (12).
        ix.update(|ix| {
            ix.apply_events(
                11,
                EventBatch {
                    epoch: 1,
                    first_seq: 1,
                    events: vec![CacheEvent::Removed {
                        tier: Tier::Device,
                        hashes: h[6..].to_vec(),
                    }],
                },
            )
        })
        .unwrap();
        assert_eq!(p.choose(&input(&doc), &c), 0);
        // The guess learned every choice, but a node in sync is scored by its report only.
        ix.update(|ix| ix.apply_snapshot(10, snapshot_of(vec![], vec![])))
            .unwrap();
        assert_eq!(p.choose(&input(&doc), &c), 1);
        // Out of sync, node 0 falls back to the guess (it was chosen for this prompt before).
        ix.update(|ix| ix.lost_stream(10));
        assert!(p.guessed_blocks(&input(&doc), &c[0]) > 0);
        assert_eq!(p.choose(&input(&doc), &c), 0);
    }

    fn snapshot_of(device: Vec<BlockHash>, host: Vec<BlockHash>) -> Snapshot {
        Snapshot {
            epoch: 1,
            seq: 100,
            block_size: 4,
            device_capacity: 1000,
            host_capacity: 1000,
            device,
            host,
        }
    }

    #[test]
    fn decode_affinity_breaks_load_ties_by_the_earlier_turn() {
        let turn1: Vec<u32> = (0..40).collect();
        let mut turn2 = turn1.clone();
        turn2.extend(500..540);
        let ix = index(&[(vec![], vec![]), (hashes(&turn1), vec![])]);
        let d = DecodeAffinity::new(ix, HashAlgo::default());
        assert_eq!(d.choose(&input(&turn2), &cands(&[0, 0])), 1);
        assert_eq!(d.choose(&input(&turn2), &cands(&[2, 2])), 1);
        assert_eq!(d.choose(&input(&turn2), &cands(&[0, 1])), 0, "load first");
        // Nobody holds it: least loaded.
        let cold: Vec<u32> = (900..940).collect();
        assert_eq!(d.choose(&input(&cold), &cands(&[3, 1])), 1);
    }
}
