//! The property test: a simulated scheduler and device drive `BlockPool` and `HostTier`
//! through random admissions, decodes, finishes and aborts, checked against a reference model
//! after every step (and every interesting path must have been exercised).

use std::collections::BTreeMap;
use std::sync::Mutex;

use pd_engine::kv::pool::{BlockPool, PoolError, Registration};
use pd_engine::kv::prefix::hash::{BlockHash, BlockHasher, block_hashes};
use pd_engine::kv::prefix::host_tier::HostTier;
use pd_engine::kv::prefix::tier::ExternalTier;
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
