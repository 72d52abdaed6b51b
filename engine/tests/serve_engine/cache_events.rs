//! The prefix cache's events: applied to a plain set per tier, they give exactly what each
//! tier holds, through evictions, spills to the host tier, restores from it and host-tier
//! evictions; the engine thread's feed numbers them without gaps after a snapshot, a fresh
//! snapshot matches the changes so far, and a subscriber that falls behind is dropped.

use std::collections::HashSet;
use std::time::Duration;

use pd_engine::kv::prefix::events::{CacheEvent, EventBatch, Snapshot, Tier};
use pd_engine::kv::prefix::hash::BlockHash;
use pd_engine::serve::{
    CacheEventStream, CacheUpdate, EngineHandle, EngineThread, FeedEnded, RequestEvent,
};

use crate::{config, drain, engine, prompt, req};

/// A small deterministic generator (xorshift64*): the same requests every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// What a subscriber knows of the cache: one set per tier.
#[derive(Debug, Default)]
struct Model {
    device: HashSet<BlockHash>,
    host: HashSet<BlockHash>,
    stored: [usize; 2],
    removed: [usize; 2],
}

impl Model {
    fn set(&mut self, tier: Tier) -> &mut HashSet<BlockHash> {
        match tier {
            Tier::Device => &mut self.device,
            Tier::Host => &mut self.host,
        }
    }

    fn apply(&mut self, event: &CacheEvent) {
        match event {
            CacheEvent::Stored { tier, hashes } => {
                self.stored[*tier as usize] += hashes.len();
                for h in hashes {
                    assert!(self.set(*tier).insert(*h), "{tier:?}: {h} stored twice");
                }
            }
            CacheEvent::Removed { tier, hashes } => {
                self.removed[*tier as usize] += hashes.len();
                for h in hashes {
                    assert!(self.set(*tier).remove(h), "{tier:?}: {h} removed, not held");
                }
            }
            CacheEvent::Cleared => {
                self.device.clear();
                self.host.clear();
            }
        }
    }
}

fn set(hashes: Vec<BlockHash>) -> HashSet<BlockHash> {
    let n = hashes.len();
    let s: HashSet<BlockHash> = hashes.into_iter().collect();
    assert_eq!(s.len(), n, "a hash listed twice");
    s
}

/// Prompts from a few families sharing prefixes, so requests hit, miss and evict.
fn random_prompt(rng: &mut Rng) -> Vec<u32> {
    let family = rng.below(5) as u32;
    let len = 6 + rng.below(22) as usize;
    let mut p = prompt(family, len);
    // Some requests diverge after a shared prefix.
    if rng.below(2) == 0 {
        let at = (len / 2).max(1);
        p.truncate(at);
        p.extend(prompt(10 + rng.below(20) as u32, len - at));
    }
    p
}

/// Requests in random groups through an engine with a 16-block pool and a 6-block host tier:
/// after every step, the changes applied to the model give the tiers' actual contents.
#[test]
fn changes_applied_to_sets_equal_each_tier_through_evictions_spills_and_restores() {
    let mut cfg = config();
    cfg.host_cache_blocks = 6;
    let mut e = engine(16, cfg);
    e.record_cache_changes(true);
    let mut model = Model::default();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut n = 0;
    for _round in 0..40 {
        for _ in 0..=rng.below(3) {
            n += 1;
            let max_tokens = 1 + rng.below(6) as u32;
            e.submit(req(&format!("r{n}"), random_prompt(&mut rng), max_tokens))
                .unwrap();
        }
        while e.has_work() {
            e.step();
            for event in e.drain_cache_changes() {
                model.apply(&event);
            }
            assert_eq!(model.device, set(e.cached_hashes(Tier::Device)));
            assert_eq!(model.host, set(e.cached_hashes(Tier::Host)));
            assert!(model.device.len() <= e.cache_capacity(Tier::Device));
            assert!(model.host.len() <= e.cache_capacity(Tier::Host));
        }
    }
    let (d, h) = (Tier::Device as usize, Tier::Host as usize);
    assert!(model.removed[d] > 0, "device evictions happened: {model:?}");
    assert!(model.stored[h] > 0, "spills happened: {model:?}");
    assert!(model.removed[h] > 0, "host evictions happened: {model:?}");
    assert!(
        e.counters().external_prefix_cache_hits > 0,
        "restores from the host tier happened"
    );

    // Stopping the recording stops the changes; a later start records from then on.
    e.record_cache_changes(false);
    e.submit(req("off", prompt(40, 20), 2)).unwrap();
    drain(&mut e);
    assert!(e.drain_cache_changes().is_empty());
}

/// Runs `prompt` on the engine thread to its end.
fn run(h: &EngineHandle, id: &str, prompt: Vec<u32>, max_tokens: u32) {
    let rx = h.submit(req(id, prompt, max_tokens));
    loop {
        match rx.recv().expect("the engine answers") {
            RequestEvent::Finished(_) => return,
            RequestEvent::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
}

/// A subscriber's view: the snapshot, then every batch, checked for order and epoch.
struct Follower {
    stream: CacheEventStream,
    epoch: u64,
    next_seq: u64,
    model: Model,
}

impl Follower {
    fn start(stream: CacheEventStream) -> (Self, Snapshot) {
        let snap = match stream.recv().expect("a snapshot first") {
            CacheUpdate::Snapshot(s) => s,
            other => panic!("expected a snapshot first, got {other:?}"),
        };
        let model = Model {
            device: set(snap.device.clone()),
            host: set(snap.host.clone()),
            ..Model::default()
        };
        let f = Self {
            stream,
            epoch: snap.epoch,
            next_seq: snap.seq + 1,
            model,
        };
        (f, snap)
    }

    fn apply(&mut self, batch: &EventBatch) {
        assert_eq!(batch.epoch, self.epoch, "one epoch per engine");
        assert_eq!(batch.first_seq, self.next_seq, "no gap, no repeat");
        assert!(!batch.events.is_empty(), "no empty batches");
        for event in &batch.events {
            self.model.apply(event);
            self.next_seq += 1;
        }
    }

    /// Apply what arrives until the model includes change `seq`.
    fn follow_to(&mut self, seq: u64) {
        while self.next_seq <= seq {
            match self.stream.recv_timeout(Duration::from_secs(30)) {
                Ok(Some(CacheUpdate::Batch(b))) => self.apply(&b),
                other => panic!("expected a batch up to {seq}, got {other:?}"),
            }
        }
        assert_eq!(
            self.next_seq,
            seq + 1,
            "batches end where the snapshot starts"
        );
    }
}

fn thread_engine() -> EngineThread {
    let mut cfg = config();
    cfg.host_cache_blocks = 6;
    EngineThread::spawn(engine(16, cfg))
}

/// Through the engine thread: snapshot then gapless batches; a snapshot taken later equals
/// the first subscriber's model at the snapshot's sequence number; the capacities and block
/// size are the engine's.
#[test]
fn a_later_snapshot_equals_the_changes_followed_so_far() {
    let thread = thread_engine();
    let h = thread.handle();
    let (mut first, snap) = Follower::start(h.subscribe_cache_events(10_000));
    assert_eq!((snap.seq, snap.block_size), (0, crate::BS));
    assert_eq!((snap.device_capacity, snap.host_capacity), (16, 6));
    assert!(snap.device.is_empty() && snap.host.is_empty());

    let mut rng = Rng(7);
    for round in 0..30 {
        run(
            &h,
            &format!("r{round}"),
            random_prompt(&mut rng),
            1 + rng.below(4) as u32,
        );
        if round % 10 == 9 {
            let (_, later) = Follower::start(h.subscribe_cache_events(1));
            assert_eq!(later.epoch, first.epoch);
            assert!(later.seq >= first.next_seq - 1, "nothing is taken back");
            first.follow_to(later.seq);
            assert_eq!(first.model.device, set(later.device), "round {round}");
            assert_eq!(first.model.host, set(later.host), "round {round}");
        }
    }
    assert!(
        first.model.removed[Tier::Host as usize] > 0,
        "the host tier evicted"
    );
    drop(thread);
    // Whatever was published is delivered, then the stream ends with the engine.
    loop {
        match first.stream.recv() {
            Ok(CacheUpdate::Batch(b)) => first.apply(&b),
            Ok(other) => panic!("a second snapshot: {other:?}"),
            Err(end) => {
                assert_eq!(end, FeedEnded::EngineStopped);
                break;
            }
        }
    }
}

/// A subscriber that reads nothing is dropped once its buffer is full (the engine goes on);
/// subscribing again gives a snapshot consistent with a subscriber that kept up.
#[test]
fn a_lagging_subscriber_is_dropped_and_a_new_one_gets_a_consistent_snapshot() {
    let thread = thread_engine();
    let h = thread.handle();
    let (mut keeper, _) = Follower::start(h.subscribe_cache_events(10_000));
    // Room for the snapshot only: the first batch does not fit.
    let laggard = h.subscribe_cache_events(1);
    run(&h, "a", prompt(1, 20), 2);
    run(&h, "b", prompt(2, 20), 2);
    assert!(matches!(laggard.recv(), Ok(CacheUpdate::Snapshot(_))));
    assert_eq!(laggard.recv(), Err(FeedEnded::Lagged));

    let (again, snap) = Follower::start(h.subscribe_cache_events(10_000));
    assert_eq!(snap.epoch, keeper.epoch);
    keeper.follow_to(snap.seq);
    assert!(snap.seq > 0);
    assert_eq!(keeper.model.device, again.model.device);
    assert_eq!(keeper.model.host, again.model.host);
    assert!(
        !again.model.device.is_empty(),
        "the prompts' blocks are cached"
    );
}
