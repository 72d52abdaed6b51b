//! The prefix cache's data structures: `BlockPool` (device tier), `HostTier`, block hashes.
//!
//! A property test drives the pool and the host tier the way the scheduler does (lookup,
//! share, allocate under pressure, spill evicted blocks to the host tier, restore from it,
//! register, decode, finish, abort) against a simulated device whose blocks hold data derived
//! from their hash, and checks after every step that the pool agrees with a reference model;
//! deterministic tests pin the eviction order and the edge cases.

use std::collections::BTreeMap;
use std::sync::Mutex;

use pd_engine::kv::hash::{BlockHash, BlockHasher, block_hashes};
use pd_engine::kv::host_tier::HostTier;
use pd_engine::kv::pool::{BlockPool, PoolError, Registration};
use pd_engine::kv::tier::{ExternalTier, TierError, TierKind};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};

/// What the property test exercised, across all cases: the test fails if some path never ran.
static EVENTS: Mutex<BTreeMap<&'static str, usize>> = Mutex::new(BTreeMap::new());

fn event(name: &'static str) {
    *EVENTS.lock().unwrap().entry(name).or_default() += 1;
}

const BS: usize = 4;
/// Bytes per block in the simulated device and host tier.
const BLOCK_LEN: usize = 6;

/// The content a block holding `h` must have: a zero byte, then five of the hash.
fn data_for(h: BlockHash) -> [u8; BLOCK_LEN] {
    let x = h.0.to_le_bytes();
    [0, x[0], x[1], x[2], x[3], x[4]]
}

/// Written into a block when it is allocated: never equal to any `data_for` (its first byte
/// is not zero).
const GARBAGE: [u8; BLOCK_LEN] = [0xff; BLOCK_LEN];

fn docs() -> Vec<Vec<u32>> {
    let a: Vec<u32> = (0..64).collect();
    // Shares its first 3 blocks with `a`.
    let b: Vec<u32> = (0..12).chain(1000..1052).collect();
    let c: Vec<u32> = (500..564).collect();
    vec![a, b, c]
}

struct Req {
    doc: usize,
    hasher: BlockHasher,
    tokens: usize,
    blocks: Vec<u32>,
}

struct Sim {
    pool: BlockPool,
    host: HostTier,
    device: Vec<[u8; BLOCK_LEN]>,
    /// Reference model of the reference counts: references held by live requests.
    held: Vec<u32>,
    reqs: Vec<Req>,
    docs: Vec<Vec<u32>>,
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        doc: usize,
        len: usize,
        salt: bool,
        abort_before_register: bool,
    },
    Decode {
        req: Index,
        steps: usize,
    },
    Finish {
        req: Index,
        then_double_free: bool,
    },
    AbortAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 1..40usize, any::<bool>(), prop::bool::weighted(0.15)).prop_map(
            |(doc, len, salt, abort_before_register)| Op::Admit {
                doc,
                len,
                salt: salt && doc == 0,
                abort_before_register,
            }
        ),
        4 => (any::<Index>(), 1..9usize).prop_map(|(req, steps)| Op::Decode { req, steps }),
        3 => (any::<Index>(), prop::bool::weighted(0.3))
            .prop_map(|(req, then_double_free)| Op::Finish { req, then_double_free }),
        1 => Just(Op::AbortAll),
    ]
}

impl Sim {
    fn new(num_blocks: usize, host_blocks: usize) -> Self {
        Self {
            pool: BlockPool::new(num_blocks),
            host: HostTier::new(host_blocks, BLOCK_LEN),
            device: vec![GARBAGE; num_blocks],
            held: vec![0; num_blocks],
            reqs: Vec::new(),
            docs: docs(),
        }
    }

    /// Allocate `n` blocks like the scheduler: spill evicted content to the host tier first.
    fn allocate(&mut self, n: usize) -> Result<Vec<u32>, PoolError> {
        let free_before = self.pool.num_free();
        let a = match self.pool.allocate(n) {
            Ok(a) => a,
            Err(e) => {
                assert_eq!(
                    e,
                    PoolError::OutOfBlocks {
                        needed: n,
                        free: free_before
                    }
                );
                assert!(n > free_before);
                assert_eq!(
                    self.pool.num_free(),
                    free_before,
                    "failed allocate took blocks"
                );
                event("out of blocks");
                return Err(e);
            }
        };
        assert_eq!(a.blocks.len(), n);
        for &b in &a.blocks {
            assert_eq!(
                self.held[b as usize], 0,
                "block {b} handed out while in use"
            );
        }
        for &(b, h) in &a.evicted {
            assert!(a.blocks.contains(&b));
            assert_eq!(
                self.device[b as usize],
                data_for(h),
                "evicted content intact"
            );
            assert_eq!(self.pool.lookup(h), None, "evicted hash still found");
            assert_eq!(self.pool.cached_prefix(&[h]), 0);
            event("eviction");
            self.host.offer(h, &self.device[b as usize]);
        }
        for &b in &a.blocks {
            self.held[b as usize] += 1;
            self.device[b as usize] = GARBAGE;
        }
        Ok(a.blocks)
    }

    fn free(&mut self, blocks: &[u32]) {
        self.pool.free(blocks).expect("free of held blocks");
        for &b in blocks {
            self.held[b as usize] -= 1;
        }
    }

    /// A block's content is complete: write it and register it.
    fn complete(&mut self, block: u32, hash: BlockHash) {
        self.device[block as usize] = data_for(hash);
        match self.pool.register(block, hash).unwrap() {
            Registration::New => assert_eq!(self.pool.lookup(hash), Some(block)),
            Registration::Duplicate { existing } => {
                assert_ne!(existing, block);
                assert_eq!(self.pool.lookup(hash), Some(existing));
                assert_eq!(self.pool.block_hash(block), None);
                event("duplicate registration");
            }
            Registration::AlreadyRegistered => panic!("a fresh block was already registered"),
        }
    }

    fn admit(&mut self, doc: usize, len: usize, salt: bool, abort_before_register: bool) {
        let salt = salt.then_some("tenant");
        let tokens = &self.docs[doc][..len];
        let mut hasher = BlockHasher::new(BS, salt);
        hasher.extend(tokens);
        let hashes = block_hashes(tokens, BS, salt);
        assert_eq!(hasher.hashes(), &hashes[..]);
        // Hits never cover the last prompt token.
        let usable = (len - 1) / BS;
        let local = self.pool.cached_prefix(&hashes[..usable]);
        for h in &hashes[..local] {
            assert!(self.pool.lookup(*h).is_some());
        }
        if local < usable {
            assert_eq!(self.pool.lookup(hashes[local]), None);
        }
        let mut blocks = self.pool.acquire_cached(&hashes[..local]).unwrap();
        if local > 0 {
            event("local hit");
        }
        for (&b, &hash) in blocks.iter().zip(&hashes) {
            self.held[b as usize] += 1;
            assert_eq!(
                self.device[b as usize],
                data_for(hash),
                "cached block has other content"
            );
        }
        let need = len.div_ceil(BS) - local;
        match self.allocate(need) {
            Ok(new) => blocks.extend(new),
            Err(_) => {
                let taken = std::mem::take(&mut blocks);
                self.free(&taken);
                return;
            }
        }
        if abort_before_register {
            event("abort before register");
            self.free(&blocks);
            return;
        }
        let external = self.host.lookup(&hashes[local..usable]);
        for i in local..local + external {
            let b = blocks[i] as usize;
            self.host.fetch(hashes[i], &mut self.device[b]).unwrap();
            assert_eq!(
                self.device[b],
                data_for(hashes[i]),
                "host tier returned other data"
            );
            event("host restore");
        }
        for i in local..hashes.len() {
            self.complete(blocks[i], hashes[i]);
        }
        self.reqs.push(Req {
            doc,
            hasher,
            tokens: len,
            blocks,
        });
    }

    fn decode(&mut self, r: usize, steps: usize) {
        for _ in 0..steps {
            let req = &self.reqs[r];
            let pos = req.tokens;
            // Same document, same continuation: decode creates shared (duplicate) blocks too.
            let token = self.docs[req.doc]
                .get(pos)
                .copied()
                .unwrap_or(9000 + pos as u32);
            if pos == req.blocks.len() * BS {
                match self.allocate(1) {
                    Ok(b) => self.reqs[r].blocks.extend(b),
                    Err(_) => {
                        // Preempted: give everything back.
                        event("preemption");
                        self.finish(r, false);
                        return;
                    }
                }
            }
            let req = &mut self.reqs[r];
            req.tokens += 1;
            if let Some(h) = req.hasher.push(token) {
                let b = req.blocks[req.hasher.hashes().len() - 1];
                self.complete(b, h);
            }
        }
    }

    fn finish(&mut self, r: usize, then_double_free: bool) {
        let req = self.reqs.swap_remove(r);
        self.free(&req.blocks);
        if then_double_free && req.blocks.iter().any(|&b| self.held[b as usize] == 0) {
            let refcounts: Vec<u32> = (0..self.held.len() as u32)
                .map(|b| self.pool.refcount(b))
                .collect();
            let (free, cached, order) = (
                self.pool.num_free(),
                self.pool.num_cached(),
                self.pool.eviction_order(),
            );
            let err = self.pool.free(&req.blocks).unwrap_err();
            assert!(
                matches!(err, PoolError::DoubleFree { block } if self.held[block as usize] == 0)
            );
            let after: Vec<u32> = (0..self.held.len() as u32)
                .map(|b| self.pool.refcount(b))
                .collect();
            assert_eq!(after, refcounts, "a failed free changed reference counts");
            assert_eq!(self.pool.num_free(), free);
            assert_eq!(self.pool.num_cached(), cached);
            assert_eq!(self.pool.eviction_order(), order);
            event("double free");
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Admit {
                doc,
                len,
                salt,
                abort_before_register,
            } => self.admit(doc, len, salt, abort_before_register),
            Op::Decode { req, steps } if !self.reqs.is_empty() => {
                let r = req.index(self.reqs.len());
                self.decode(r, steps);
            }
            Op::Finish {
                req,
                then_double_free,
            } if !self.reqs.is_empty() => {
                let r = req.index(self.reqs.len());
                self.finish(r, then_double_free);
            }
            Op::AbortAll => {
                while !self.reqs.is_empty() {
                    self.finish(self.reqs.len() - 1, false);
                }
            }
            Op::Decode { .. } | Op::Finish { .. } => {}
        }
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        let n = self.held.len();
        for b in 0..n as u32 {
            assert_eq!(self.pool.refcount(b), self.held[b as usize], "block {b}");
            if let Some(h) = self.pool.block_hash(b) {
                assert_eq!(
                    self.device[b as usize],
                    data_for(h),
                    "block {b} cached as {h}"
                );
            }
        }
        let free = self.held.iter().filter(|&&c| c == 0).count();
        assert_eq!(self.pool.num_free(), free);
        assert_eq!(self.pool.num_in_use(), n - free);
        assert!(self.host.len() <= self.host.capacity());
        // Every live request's table covers its tokens and holds distinct blocks.
        for req in &self.reqs {
            assert_eq!(req.blocks.len(), req.tokens.div_ceil(BS));
            let mut sorted = req.blocks.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), req.blocks.len());
        }
    }
}

#[test]
fn pool_never_leaks_or_hands_out_held_blocks() {
    let strategy = (
        4..28usize,
        prop::sample::select(vec![0usize, 3, 16]),
        prop::collection::vec(op(), 1..120),
    );
    let mut runner = TestRunner::new(Config::with_cases(200));
    let result = runner.run(&strategy, |(num_blocks, host_blocks, ops)| {
        let mut sim = Sim::new(num_blocks, host_blocks);
        for op in ops {
            sim.apply(op);
            sim.check();
        }
        sim.apply(Op::AbortAll);
        sim.check();
        prop_assert_eq!(sim.pool.num_free(), num_blocks);
        prop_assert_eq!(sim.pool.num_in_use(), 0);
        prop_assert_eq!(sim.pool.usage(), 0.0);
        prop_assert!(sim.pool.num_cached() <= num_blocks);
        prop_assert_eq!(sim.pool.num_evictable(), sim.pool.num_cached());
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let events = EVENTS.lock().unwrap();
    for name in [
        "local hit",
        "out of blocks",
        "eviction",
        "host restore",
        "duplicate registration",
        "preemption",
        "double free",
        "abort before register",
    ] {
        assert!(
            events.get(name).copied().unwrap_or(0) > 0,
            "the property test never exercised `{name}`: {events:?}"
        );
    }
    eprintln!("exercised: {events:?}");
}

proptest! {
    #[test]
    fn incremental_hashes_match_one_shot(
        tokens in prop::collection::vec(any::<u32>(), 0..200),
        chunks in prop::collection::vec(0..20usize, 1..30),
        bs in 1..20usize,
    ) {
        let want = block_hashes(&tokens, bs, None);
        prop_assert_eq!(want.len(), tokens.len() / bs);
        let mut h = BlockHasher::new(bs, None);
        let mut at = 0;
        for c in chunks.iter().cycle() {
            let end = (at + c + 1).min(tokens.len());
            h.extend(&tokens[at..end]);
            prop_assert_eq!(h.hashes(), &block_hashes(&tokens[..end], bs, None)[..]);
            at = end;
            if at == tokens.len() {
                break;
            }
        }
        prop_assert_eq!(h.into_hashes(), want);
    }
}

fn h(i: u128) -> BlockHash {
    BlockHash(i)
}

/// Allocate `n` blocks and register them with hashes `hashes`.
fn cached_blocks(pool: &mut BlockPool, hashes: &[BlockHash]) -> Vec<u32> {
    let blocks = pool.allocate(hashes.len()).unwrap().blocks;
    for (&b, &hash) in blocks.iter().zip(hashes) {
        assert_eq!(pool.register(b, hash).unwrap(), Registration::New);
    }
    blocks
}

#[test]
fn eviction_is_least_recently_freed_first() {
    let mut pool = BlockPool::new(4);
    let a = cached_blocks(&mut pool, &[h(10), h(11)]);
    let b = cached_blocks(&mut pool, &[h(20), h(21)]);
    pool.free(&b).unwrap();
    pool.free(&a).unwrap();
    // Tail first within each request, requests in the order they ended.
    assert_eq!(pool.eviction_order(), [b[1], b[0], a[1], a[0]]);
    assert_eq!(pool.num_cached(), 4);
    let x = pool.allocate(1).unwrap();
    assert_eq!(x.blocks, [b[1]]);
    assert_eq!(x.evicted, [(b[1], h(21))]);
    let y = pool.allocate(2).unwrap();
    assert_eq!(y.evicted, [(b[0], h(20)), (a[1], h(11))]);
    assert_eq!(pool.lookup(h(21)), None);
    assert_eq!(pool.lookup(h(11)), None);
    assert_eq!(pool.lookup(h(10)), Some(a[0]));
    assert_eq!(pool.num_cached(), 1);
    pool.check_invariants().unwrap();
}

#[test]
fn uncached_free_blocks_go_before_cached_ones() {
    let mut pool = BlockPool::new(4);
    let blocks = pool.allocate(4).unwrap().blocks;
    pool.register(blocks[0], h(1)).unwrap();
    pool.register(blocks[1], h(2)).unwrap();
    pool.free(&blocks).unwrap();
    assert_eq!(pool.num_free(), 4);
    assert_eq!(pool.num_evictable(), 2);
    let a = pool.allocate(2).unwrap();
    assert_eq!(
        a.blocks,
        [blocks[3], blocks[2]],
        "uncached, least recently freed first"
    );
    assert!(a.evicted.is_empty());
    assert_eq!(pool.cached_prefix(&[h(1), h(2)]), 2);
    let b = pool.allocate(1).unwrap();
    assert_eq!(b.evicted, [(blocks[1], h(2))]);
    assert_eq!(pool.cached_prefix(&[h(1), h(2)]), 1);
    // A block freed after the cached ones is still used before them.
    pool.free(&b.blocks).unwrap();
    assert_eq!(pool.allocate(1).unwrap().blocks, b.blocks);
    assert_eq!(pool.cached_prefix(&[h(1)]), 1);
}

#[test]
fn tail_first_free_keeps_the_prefix() {
    let tokens: Vec<u32> = (0..64).collect();
    let hashes = block_hashes(&tokens, 16, None);
    let mut pool = BlockPool::new(4);
    let blocks = cached_blocks(&mut pool, &hashes);
    pool.free(&blocks).unwrap();
    let a = pool.allocate(2).unwrap();
    let evicted: Vec<BlockHash> = a.evicted.iter().map(|e| e.1).collect();
    assert_eq!(evicted, [hashes[3], hashes[2]]);
    assert_eq!(
        pool.cached_prefix(&hashes),
        2,
        "the first two blocks survive"
    );
    assert_eq!(pool.acquire_cached(&hashes[..2]).unwrap(), blocks[..2]);
}

#[test]
fn acquire_cached_shares_and_protects_blocks() {
    let mut pool = BlockPool::new(3);
    let blocks = cached_blocks(&mut pool, &[h(1), h(2)]);
    pool.free(&blocks).unwrap();
    assert_eq!(pool.num_evictable(), 2);
    assert_eq!(pool.usage(), 0.0);
    let x = pool.acquire_cached(&[h(1), h(2)]).unwrap();
    assert_eq!(x, blocks);
    assert_eq!(pool.num_evictable(), 0);
    assert_eq!(pool.num_free(), 1);
    let y = pool.acquire_cached(&[h(1)]).unwrap();
    assert_eq!(pool.refcount(y[0]), 2);
    assert!((pool.usage() - 2.0 / 3.0).abs() < 1e-12);
    // Held cached blocks are never evicted.
    assert_eq!(
        pool.allocate(2).unwrap_err(),
        PoolError::OutOfBlocks { needed: 2, free: 1 }
    );
    // A missing hash fails the whole call.
    assert_eq!(
        pool.acquire_cached(&[h(2), h(3)]).unwrap_err(),
        PoolError::NotCached {
            index: 1,
            hash: h(3)
        }
    );
    assert_eq!(pool.refcount(blocks[1]), 1);
    pool.free(&x).unwrap();
    assert_eq!(pool.refcount(y[0]), 1);
    assert_eq!(pool.eviction_order(), [blocks[1]]);
    pool.free(&y).unwrap();
    assert_eq!(pool.eviction_order(), [blocks[1], blocks[0]]);
    pool.check_invariants().unwrap();
}

#[test]
fn duplicate_registration_keeps_the_first_block() {
    let mut pool = BlockPool::new(3);
    let a = pool.allocate(1).unwrap().blocks[0];
    let b = pool.allocate(1).unwrap().blocks[0];
    assert_eq!(pool.register(a, h(5)).unwrap(), Registration::New);
    assert_eq!(
        pool.register(b, h(5)).unwrap(),
        Registration::Duplicate { existing: a }
    );
    assert_eq!(
        pool.register(a, h(5)).unwrap(),
        Registration::AlreadyRegistered
    );
    assert_eq!(pool.lookup(h(5)), Some(a));
    assert_eq!(pool.block_hash(b), None);
    assert_eq!(pool.num_cached(), 1);
    assert_eq!(
        pool.register(a, h(6)).unwrap_err(),
        PoolError::HashConflict {
            block: a,
            registered: h(5),
            new: h(6)
        }
    );
    // The duplicate goes back uncached and is reused before the cached block.
    pool.free(&[b]).unwrap();
    pool.free(&[a]).unwrap();
    assert_eq!(pool.num_evictable(), 1);
    let next = pool.allocate(2).unwrap();
    assert_eq!(next.blocks[..2], [2, b]);
    assert!(next.evicted.is_empty());
    assert_eq!(pool.lookup(h(5)), Some(a));
    // Only a held block can be registered.
    assert_eq!(
        pool.register(a, h(7)).unwrap_err(),
        PoolError::NotInUse { block: a }
    );
    let c = pool.allocate(1).unwrap();
    assert_eq!(c.evicted, [(a, h(5))]);
    pool.free(&c.blocks).unwrap();
    assert_eq!(
        pool.register(a, h(8)).unwrap_err(),
        PoolError::NotInUse { block: a }
    );
    assert_eq!(
        pool.register(9, h(8)).unwrap_err(),
        PoolError::InvalidBlock {
            block: 9,
            num_blocks: 3
        }
    );
    pool.check_invariants().unwrap();
}

#[test]
fn double_free_is_an_error_and_changes_nothing() {
    let mut pool = BlockPool::new(3);
    let blocks = pool.allocate(2).unwrap().blocks;
    pool.register(blocks[0], h(1)).unwrap();
    pool.free(&blocks[1..]).unwrap();
    let err = pool.free(&blocks).unwrap_err();
    assert_eq!(err, PoolError::DoubleFree { block: blocks[1] });
    assert!(err.to_string().contains("double free"), "{err}");
    assert_eq!(
        pool.refcount(blocks[0]),
        1,
        "the first block was not released"
    );
    assert_eq!(pool.num_free(), 2);
    // Listing a block twice needs two references.
    assert_eq!(
        pool.free(&[blocks[0], blocks[0]]).unwrap_err(),
        PoolError::DoubleFree { block: blocks[0] }
    );
    assert_eq!(pool.refcount(blocks[0]), 1);
    assert_eq!(
        pool.free(&[7]).unwrap_err(),
        PoolError::InvalidBlock {
            block: 7,
            num_blocks: 3
        }
    );
    pool.free(&blocks[..1]).unwrap();
    assert_eq!(pool.num_free(), 3);
    pool.check_invariants().unwrap();
}

#[test]
fn allocate_is_all_or_nothing() {
    let mut pool = BlockPool::new(3);
    pool.allocate(2).unwrap();
    let err = pool.allocate(2).unwrap_err();
    assert_eq!(err, PoolError::OutOfBlocks { needed: 2, free: 1 });
    assert!(err.to_string().contains("2 needed, 1 free"), "{err}");
    assert_eq!(pool.num_free(), 1);
    assert_eq!(pool.allocate(0).unwrap().blocks, Vec::<u32>::new());
    assert_eq!(pool.allocate(1).unwrap().blocks, [2]);
}

#[test]
fn touch_refreshes_recency_of_evictable_blocks() {
    let mut pool = BlockPool::new(4);
    let a = cached_blocks(&mut pool, &[h(1), h(2)]);
    let b = cached_blocks(&mut pool, &[h(3), h(4)]);
    pool.free(&a).unwrap();
    pool.free(&b).unwrap();
    assert_eq!(pool.touch(&[h(1), h(2), h(99)]), 2);
    assert_eq!(pool.eviction_order(), [b[1], b[0], a[1], a[0]]);
    assert_eq!(pool.touch(&[h(99)]), 0);
    let held = pool.acquire_cached(&[h(3)]).unwrap();
    assert_eq!(
        pool.touch(&[h(3), h(4)]),
        2,
        "held blocks are counted but not listed"
    );
    assert_eq!(pool.eviction_order(), [a[1], a[0], b[1]]);
    pool.free(&held).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn evicted_blocks_spill_to_the_host_tier_and_come_back() {
    let tokens: Vec<u32> = (0..33).collect();
    let hashes = block_hashes(&tokens, 16, None);
    let mut pool = BlockPool::new(2);
    let mut host = HostTier::new(4, 2);
    let mut device = [[0u8; 2]; 2];
    let blocks = cached_blocks(&mut pool, &hashes);
    for (i, &b) in blocks.iter().enumerate() {
        device[b as usize] = [i as u8, 10 + i as u8];
    }
    pool.free(&blocks).unwrap();
    let other = pool.allocate(2).unwrap();
    for &(b, hash) in &other.evicted {
        host.offer(hash, &device[b as usize]);
    }
    assert_eq!(pool.cached_prefix(&hashes), 0);
    assert_eq!(host.lookup(&hashes), 2);
    let mut dst = [0u8; 2];
    host.fetch(hashes[1], &mut dst).unwrap();
    assert_eq!(dst, [1, 11]);
    host.fetch(hashes[0], &mut dst).unwrap();
    assert_eq!(dst, [0, 10]);
    assert_eq!(host.len(), 2, "fetched blocks stay in the host tier");
}

#[test]
fn host_tier_evicts_least_recently_used() {
    let mut host = HostTier::new(2, 3);
    assert_eq!(host.kind(), TierKind::Host);
    assert_eq!(host.block_bytes(), 3);
    host.offer(h(1), &[1; 3]);
    host.offer(h(2), &[2; 3]);
    assert_eq!(host.eviction_order(), [h(1), h(2)]);
    let mut dst = [0u8; 3];
    host.fetch(h(1), &mut dst).unwrap();
    assert_eq!(dst, [1; 3]);
    assert_eq!(host.eviction_order(), [h(2), h(1)], "fetch touches");
    host.offer(h(3), &[3; 3]);
    assert!(!host.contains(h(2)), "least recently used evicted");
    assert_eq!(host.len(), 2);
    assert_eq!(
        host.fetch(h(2), &mut dst).unwrap_err(),
        TierError::Miss {
            tier: TierKind::Host,
            hash: h(2)
        }
    );
    // Offering a held hash only refreshes it (content is immutable per hash).
    host.offer(h(1), &[9; 3]);
    assert_eq!(host.eviction_order(), [h(3), h(1)]);
    host.fetch(h(1), &mut dst).unwrap();
    assert_eq!(dst, [1; 3]);
    // Lookups count leading hashes and do not touch.
    assert_eq!(host.lookup(&[h(3), h(1), h(2), h(1)]), 2);
    assert_eq!(host.lookup(&[h(2), h(1)]), 0);
    assert_eq!(host.eviction_order(), [h(3), h(1)]);
    host.offer(h(4), &[4; 3]);
    host.fetch(h(4), &mut dst).unwrap();
    assert_eq!(dst, [4; 3]);
    host.fetch(h(1), &mut dst).unwrap();
    assert_eq!(dst, [1; 3]);
    assert!(!host.contains(h(3)));
    assert_eq!(
        host.fetch(h(1), &mut [0u8; 2]).unwrap_err(),
        TierError::LengthMismatch {
            tier: TierKind::Host,
            expected: 3,
            got: 2
        }
    );
}

#[test]
fn host_tier_of_capacity_zero_is_disabled() {
    let mut host = HostTier::new(0, 8);
    assert!(!host.is_enabled());
    host.offer(h(1), &[5; 8]);
    assert_eq!(host.lookup(&[h(1)]), 0);
    assert!(host.is_empty());
    assert!(matches!(
        host.fetch(h(1), &mut [0u8; 8]),
        Err(TierError::Miss { .. })
    ));
}

#[test]
fn tiers_are_usable_as_trait_objects() {
    fn assert_send<T: Send>(_: &T) {}
    let mut tiers: Vec<Box<dyn ExternalTier>> = vec![Box::new(HostTier::new(1, 1))];
    assert_send(&tiers);
    tiers[0].offer(h(1), &[15]);
    assert_eq!(tiers[0].lookup(&[h(1)]), 1);
    assert_eq!(tiers[0].kind().to_string(), "host");
}
