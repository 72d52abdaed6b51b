//! The serving engine's core: continuous batching over a paged KV pool with a prefix cache
//! (device tier + host tier), chunked prefill, preemption by recompute, abort, and the
//! prefix-cache accounting. It is synchronous — [`Engine::step`] runs one forward pass — so
//! every rule is testable without threads; [`super::driver`] runs it on its own thread.
//!
//! One step reads as three parts, each in its own file: `schedule` plans it (a `Schedule`
//! value: which sequences run, how many tokens each), `execute` runs the forward pass, and
//! `postprocess` applies the results (sampling, block registration in the prefix cache,
//! stop checks, events).
//!
//! Also split by concern: `submit` (a request's checks), `seq` (one open request), `blocks`
//! (block bookkeeping), and the KV handoff, whose state is one `handoff` value: `leases`
//! (the export side), `reserve` and `import` (the import side). The settings are
//! [`super::config`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::executor::Executor;
use crate::kv::handoff::host_buffer::HostBuffer;
use crate::kv::pool::BlockPool;
use crate::kv::prefix::events::{CacheEvent, Tier};
use crate::kv::prefix::hash::BlockHash;
use crate::kv::prefix::host_tier::HostTier;
use crate::sampling::FinishReason;

mod blocks;
mod execute;
mod handoff;
mod import;
mod leases;
mod postprocess;
mod reserve;
mod schedule;
mod seq;
mod submit;

use handoff::KvHandoff;
use seq::Seq;

use super::config::{EngineConfig, Role};
use super::counters::EngineCounters;
use super::request::{Finished, RequestError, RequestEvent, RequestId};

/// Where the time of the last step went (scheduler overhead versus the forward pass).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    pub seqs: usize,
    pub tokens: usize,
    /// Planning: lease expiry, preemption, admission, prefix lookups, block allocation.
    pub schedule: Duration,
    /// The model's forward pass.
    pub forward: Duration,
    /// Sampling, block registration, stop checks, events.
    pub postprocess: Duration,
}

/// The serving engine (see the module doc).
pub struct Engine<B: Backend> {
    config: EngineConfig,
    executor: Executor<B>,
    pool: BlockPool,
    host: HostTier,
    seqs: HashMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    /// Leases, reservations and import buffers: the KV that leaves and enters this engine.
    handoff: KvHandoff,
    counters: EngineCounters,
    eos_token_ids: Vec<u32>,
    /// Sampled ids are kept below this (ids past the tokenizer's vocabulary have no text).
    vocab_limit: usize,
    /// Blocks on their way between the host tier and the backend: one batch, in memory the
    /// backend lends (page-locked on a GPU), taken at the first spill.
    block_buf: Option<HostBuffer>,
    last_step: StepStats,
    model_steps: u64,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish_non_exhaustive()
    }
}

type Events = Vec<(RequestId, RequestEvent)>;

impl<B: Backend> Engine<B> {
    pub fn new(
        executor: Executor<B>,
        config: EngineConfig,
        eos_token_ids: Vec<u32>,
        vocab_limit: usize,
    ) -> Result<Self, RequestError> {
        config.validate()?;
        let pool = BlockPool::new(executor.num_blocks());
        let host = HostTier::new(config.host_cache_blocks, executor.block_bytes());
        let handoff = KvHandoff::new(&executor, config.role);
        Ok(Self {
            config,
            executor,
            pool,
            host,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            handoff,
            counters: EngineCounters::default(),
            eos_token_ids,
            vocab_limit,
            block_buf: None,
            last_step: StepStats::default(),
            model_steps: 0,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.executor.layout().block_size
    }

    /// Counters with the gauges filled in.
    pub fn counters(&self) -> EngineCounters {
        let mut c = self.counters.clone();
        c.num_running = self.running.len() as u64;
        c.num_waiting = self.waiting.len() as u64;
        c.kv_cache_usage = self.pool.usage();
        c.kv_leases_expired = self.handoff.expired_leases;
        c
    }

    /// How many steps have run the model so far (a step with nothing to schedule does not).
    pub fn model_steps(&self) -> u64 {
        self.model_steps
    }

    /// Timings of the last step that ran the model.
    pub fn last_step(&self) -> StepStats {
        self.last_step
    }

    pub fn expired_leases(&self) -> u64 {
        self.handoff.expired_leases
    }

    /// Requests waiting or running.
    pub fn num_open(&self) -> usize {
        self.seqs.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Free KV blocks (cached blocks count as free: they are evictable).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    pub fn num_blocks(&self) -> usize {
        self.executor.num_blocks()
    }

    /// Every block hash `tier` of the prefix cache holds now, in no particular order.
    pub fn cached_hashes(&self, tier: Tier) -> Vec<BlockHash> {
        match tier {
            Tier::Device => self.pool.cached_hashes(),
            Tier::Host => self.host.hashes(),
        }
    }

    /// The most blocks `tier` can hold (the host tier: `host_cache_blocks`, 0 when off).
    pub fn cache_capacity(&self, tier: Tier) -> usize {
        match tier {
            Tier::Device => self.pool.num_blocks(),
            Tier::Host => self.host.capacity(),
        }
    }

    /// Record which hashes enter and leave each tier from now on, for
    /// [`Self::drain_cache_changes`] (or stop, dropping what was not drained). Off at first:
    /// an engine nobody subscribes to records nothing.
    pub fn record_cache_changes(&mut self, on: bool) {
        self.pool.record_changes(on);
        self.host.record_changes(on);
    }

    /// The changes recorded since the last call: the device tier's in order, then the host
    /// tier's in order (each tier's set follows from its own changes alone).
    pub fn drain_cache_changes(&mut self) -> Vec<CacheEvent> {
        let mut out = Vec::new();
        self.pool.drain_changes(&mut out);
        self.host.drain_changes(&mut out);
        out
    }

    /// End a request now. Returns its terminal event, or `None` if it is not open.
    pub fn abort(&mut self, id: &RequestId) -> Option<RequestEvent> {
        if !self.seqs.contains_key(id) {
            return None;
        }
        self.waiting.retain(|w| w != id);
        self.running.retain(|r| r != id);
        Some(self.finish(id, FinishReason::Abort, Instant::now()))
    }

    /// One step: plan, one forward pass, results. Returns the events it produced (none,
    /// and no forward pass, when nothing can be scheduled).
    pub fn step(&mut self) -> Events {
        let started = Instant::now();
        self.expire_leases(started);
        let schedule = self.schedule(started);
        if schedule.is_empty() {
            return Events::new();
        }
        let planned = Instant::now();
        let outputs = self.execute(&schedule);
        let now = Instant::now();
        self.model_steps += 1;
        self.last_step = StepStats {
            seqs: schedule.items.len(),
            tokens: schedule.num_tokens(),
            schedule: planned - started,
            forward: now - planned,
            postprocess: Duration::ZERO,
        };
        let events = self.post_process(schedule, outputs, now);
        self.last_step.postprocess = now.elapsed();
        events
    }

    /// Remove a request, free or lease its blocks, count it, and build its terminal event.
    fn finish(&mut self, id: &RequestId, reason: FinishReason, now: Instant) -> RequestEvent {
        let mut seq = self.seqs.remove(id).expect("finishing an open request");
        let blocks = std::mem::take(&mut seq.blocks);
        let lease = if self.config.role == Role::Prefill
            && reason != FinishReason::Abort
            && seq.req.lease_kv
        {
            Some(self.lease_prompt_blocks(&seq, &blocks, now))
        } else {
            self.free_blocks(&blocks);
            None
        };
        match reason {
            FinishReason::Stop => self.counters.requests_finished_stop += 1,
            FinishReason::Length => self.counters.requests_finished_length += 1,
            FinishReason::Abort => self.counters.requests_finished_abort += 1,
        }
        RequestEvent::Finished(Box::new(Finished {
            reason,
            usage: seq.usage(),
            timings: seq.timings(now),
            lease,
            max_tokens: seq.req.params.max_tokens,
            sampled_tokens: seq.tokens.len() - seq.sampled_from,
        }))
    }
}
