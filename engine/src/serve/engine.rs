//! The serving engine's core: continuous batching over a paged KV pool with a prefix cache
//! (device tier + host tier), chunked prefill, preemption by recompute, abort, and the
//! prefix-cache accounting. It is synchronous — [`Engine::step`] runs one forward pass — so
//! every rule is testable without threads; [`super::driver`] runs it on its own thread.
//!
//! One step: (1) running sequences get their next chunk (decode: one token), preempting the
//! most recently admitted sequence when blocks run out; (2) if nothing was preempted, waiting
//! sequences are admitted in arrival order while `max_num_seqs` and the token budget allow,
//! each with one prefix lookup (device, then host tier); (3) one forward pass; (4) sampling,
//! block registration in the prefix cache, stop checks and events.
//!
//! Split by concern: `seq` (one open request), `import` (KV that arrives with a
//! request), `leases` (prefill leases and the import buffers); the settings are
//! [`super::config`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::ErrorKind;
use crate::executor::{ExecItem, Executor, ItemWants, NextToken, StepOutput};
use crate::generate::validate_prompt;
use crate::kv::block_buffers::{BlockBuffers, DEFAULT_SPARE_BYTES};
use crate::kv::hash::{BlockHash, BlockHasher};
use crate::kv::host_buffer::HostBuffer;
use crate::kv::host_tier::HostTier;
use crate::kv::placement::{HostKvMemory, ReservationId};
use crate::kv::pool::BlockPool;
use crate::kv::reservation::BlockWriter;
use crate::kv::tier::ExternalTier;
use rayon::prelude::*;

use crate::sampling::{FinishReason, SampledToken, Sampler, StopChecker};

mod blocks;
mod import;
mod leases;
mod reserve;
mod seq;

use leases::Lease;
use reserve::Reserved;
use seq::Seq;

use super::config::{EngineConfig, Role};
use super::counters::{EngineCounters, PrefixOutcome};
use super::lease_store::LeaseStore;
use super::request::{EngineRequest, Finished, RequestError, RequestEvent, RequestId};

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
    leases: HashMap<u64, Lease>,
    /// Released leases whose blocks a transfer may still be reading in place.
    released_leases: Vec<Lease>,
    /// Copies of the leased blocks, for the export side (read without this thread).
    lease_store: LeaseStore,
    /// Host buffers of imported blocks, given back once copied into KV storage.
    import_buffers: BlockBuffers,
    /// Where KV storage lies in host memory (`None` on a GPU): imports can land in place.
    host_kv: Option<HostKvMemory>,
    /// How a puller writes imported blocks into device KV storage from its own thread
    /// (`None` where KV is host memory, or the backend cannot).
    block_writer: Option<BlockWriter>,
    /// Blocks set aside for imports being pulled.
    reservations: HashMap<ReservationId, Reserved>,
    next_reservation: u64,
    counters: EngineCounters,
    expired_leases: u64,
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
        let block_bytes = executor.block_bytes();
        let pool = BlockPool::new(executor.num_blocks());
        let host = HostTier::new(config.host_cache_blocks, block_bytes);
        let host_kv = executor.host_kv_memory();
        // A prefill engine never imports KV; the writer holds device memory and a stream.
        let block_writer = (config.role != Role::Prefill && host_kv.is_none())
            .then(|| executor.block_writer())
            .flatten();
        let import_buffers = BlockBuffers::with_allocator(
            block_bytes,
            DEFAULT_SPARE_BYTES,
            executor.host_allocator(),
        );
        Ok(Self {
            config,
            executor,
            pool,
            host,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            leases: HashMap::new(),
            released_leases: Vec::new(),
            lease_store: LeaseStore::default(),
            import_buffers,
            host_kv,
            block_writer,
            reservations: HashMap::new(),
            next_reservation: 1,
            counters: EngineCounters::default(),
            expired_leases: 0,
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
        c.kv_leases_expired = self.expired_leases;
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
        self.expired_leases
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

    /// Queue a request after validating it; an invalid one is refused here, before any
    /// block is touched.
    pub fn submit(&mut self, mut req: EngineRequest) -> Result<(), RequestError> {
        let invalid = |m: String| RequestError {
            kind: ErrorKind::InvalidArgument,
            message: m,
        };
        if self.seqs.contains_key(&req.id) {
            return Err(invalid(format!("request id {} is already in use", req.id)));
        }
        if req.resumed > 0 && req.resumed >= req.prompt.len() {
            return Err(invalid(format!(
                "a resumed request needs a prompt before its {} resumed tokens; it has {} tokens \
                 in all",
                req.resumed,
                req.prompt.len()
            )));
        }
        if req.resumed > 0 && req.params.prompt_logprobs.is_some() {
            return Err(invalid(
                "a resumed request does not score its prompt again (prompt_logprobs)".into(),
            ));
        }
        let c = self.executor.model().config();
        // Resumed tokens are output: they take their share of max_tokens, not of the prompt.
        validate_prompt(
            &req.prompt,
            c.vocab_size,
            self.config.max_model_len,
            req.params.max_tokens.saturating_sub(req.resumed as u32),
        )
        .map_err(|e| invalid(e.to_string()))?;
        req.params
            .validate(c.vocab_size, self.config.max_model_len as u32)
            .map_err(|e| invalid(e.to_string()))?;
        if req.params.structured_output.is_some() != req.guide.is_some() {
            return Err(invalid(
                "a structured output comes with its compiled guide, and a guide with its \
                 structured output"
                    .into(),
            ));
        }
        let bs = self.block_size();
        let need = (req.prompt.len() + req.params.max_tokens as usize)
            .saturating_sub(req.resumed)
            .div_ceil(bs);
        if need > self.num_blocks() {
            return Err(RequestError {
                kind: ErrorKind::ResourceExhausted,
                message: format!(
                    "the request needs {need} KV blocks (prompt {} + max_tokens {}); the whole pool has {}",
                    req.prompt.len(),
                    req.params.max_tokens,
                    self.num_blocks()
                ),
            });
        }
        match (&req.imported, self.config.role) {
            (None, Role::Decode) => {
                return Err(invalid(
                    "a decode node serves only requests that bring their prompt's KV".into(),
                ));
            }
            (Some(_), Role::Prefill) => {
                return Err(invalid("a prefill node does not take imported KV".into()));
            }
            (Some(imp), _) => self.check_imported(&req, imp)?,
            (None, _) => {}
        }
        let seed = req
            .params
            .effective_seed(self.config.seed ^ xxhash_rust::xxh3::xxh3_64(req.id.0.as_bytes()));
        let mut hasher =
            BlockHasher::with_algo(bs, req.cache_salt.as_deref(), self.config.hash_algo);
        hasher.extend(&req.prompt);
        let mut tokens = req.prompt.clone();
        let mut stop = StopChecker::new(&req.params, self.eos_token_ids.clone());
        let output_from = req.prompt.len() - req.resumed;
        for &token in &req.prompt[output_from..] {
            if stop.on_token(token, "").finished.is_some() {
                return Err(invalid(
                    "a resumed token already ends this request: there is nothing to resume".into(),
                ));
            }
        }
        if let Some(imp) = &req.imported {
            // The first token was sampled by the prefill node: it counts towards max_tokens
            // and stop conditions here, but its KV is computed by this node's first step.
            if stop.on_token(imp.first_token, "").finished.is_some() {
                return Err(invalid(
                    "the first token already ends this request: there is nothing to decode".into(),
                ));
            }
            tokens.push(imp.first_token);
            hasher.push(imp.first_token);
        }
        let seq = Seq {
            prompt_len: req.prompt.len(),
            output_from,
            sampled_from: tokens.len(),
            tokens,
            hasher,
            blocks: Vec::new(),
            computed: 0,
            registered: 0,
            sampler: match &req.guide {
                Some(guide) => {
                    Sampler::new(&req.params, seed, &self.eos_token_ids).with_guide(guide.clone())
                }
                None => Sampler::new(&req.params, seed, &self.eos_token_ids),
            },
            stop,
            admitted: false,
            imported: req.imported.take(),
            outcome: None,
            prompt_logprobs: req.params.prompt_logprobs.map(|_| Vec::new()),
            arrival: Instant::now(),
            first_scheduled: None,
            first_token: None,
            last_token: None,
            inter_token: Vec::new(),
            req,
        };
        self.waiting.push_back(seq.req.id.clone());
        self.seqs.insert(seq.req.id.clone(), seq);
        Ok(())
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

    /// One scheduling step and forward pass. Returns the events it produced.
    pub fn step(&mut self) -> Events {
        let started = Instant::now();
        let now = started;
        self.expire_leases(now);
        let mut events = Events::new();
        let bs = self.block_size();
        let mut budget = self.config.max_num_batched_tokens;
        // (id, number of new tokens)
        let mut scheduled: Vec<(RequestId, usize)> = Vec::new();
        let mut preempted = false;

        // 1. Running sequences, in admission order; the newest is preempted first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].clone();
            let seq = &self.seqs[&id];
            let n = (seq.tokens.len() - seq.computed).min(budget);
            let target = seq.computed + n;
            let mut got = false;
            loop {
                if self.grow(&id, target) {
                    got = true;
                    break;
                }
                let victim = self.running.pop().expect("the current sequence is running");
                self.preempt(&victim);
                preempted = true;
                if victim == id {
                    break;
                }
            }
            if got {
                scheduled.push((id, n));
                budget -= n;
                i += 1;
            }
        }

        // 2. Admit waiting sequences.
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(id) = self.waiting.front().cloned() else {
                break;
            };
            match self.admit(&id, budget, now) {
                Some(n) => {
                    self.waiting.pop_front();
                    self.running.push(id.clone());
                    scheduled.push((id, n));
                    budget -= n;
                }
                None => break,
            }
        }
        if scheduled.is_empty() {
            return events;
        }
        let planned = Instant::now();

        // 3. Forward. Sequences that finish their tokens this step get their token chosen
        // where the logits are when they have a plan (all but edits past a quarter of the
        // vocabulary); the others, and rows the backend hands back, get logits for the host
        // sampler. Prompt positions not yet scored are scored where the logits are.
        let outputs = {
            let limit = self.vocab_limit;
            let next: Vec<NextToken> = scheduled
                .iter()
                .map(|(id, n)| {
                    let seq = self.seqs.get_mut(id).expect("scheduled sequence exists");
                    let completes = seq.computed + n == seq.tokens.len();
                    if completes {
                        let (prompt, output) = seq.tokens.split_at(seq.output_from);
                        NextToken::sample(seq.sampler.device_plan(prompt, output, limit))
                    } else {
                        NextToken::None
                    }
                })
                .collect();
            let items: Vec<ExecItem<'_>> = scheduled
                .iter()
                .map(|(id, n)| {
                    let seq = &self.seqs[id];
                    ExecItem {
                        tokens: &seq.tokens[seq.computed..seq.computed + n],
                        start: seq.computed,
                        block_table: &seq.blocks,
                        all_logits: false,
                    }
                })
                .collect();
            let wants: Vec<ItemWants<'_>> = scheduled
                .iter()
                .zip(next)
                .map(|((id, n), next)| ItemWants {
                    prompt: self.seqs[id].prompt_scoring(*n),
                    next,
                })
                .collect();
            self.executor
                .execute_sampling(&items, &wants, self.vocab_limit)
        };

        // 4. Results.
        let now = Instant::now();
        self.model_steps += 1;
        self.last_step = StepStats {
            seqs: scheduled.len(),
            tokens: scheduled.iter().map(|(_, n)| n).sum(),
            schedule: planned - started,
            forward: now - planned,
            postprocess: Duration::ZERO,
        };
        let mut to_sample = Vec::new();
        for ((id, n), output) in scheduled.into_iter().zip(outputs) {
            let caching = self.config.enable_prefix_caching;
            let seq = self.seqs.get_mut(&id).expect("scheduled sequence exists");
            seq.computed += n;
            if let Some(lp) = seq.prompt_logprobs.as_mut() {
                lp.extend(output.prompt_logprobs);
            }
            if caching {
                let full = seq.computed / bs;
                let pending: Vec<(u32, BlockHash)> = (seq.registered..full)
                    .map(|b| (seq.blocks[b], seq.hasher.hashes()[b]))
                    .collect();
                seq.registered = seq.registered.max(full);
                for (block, hash) in pending {
                    self.pool
                        .register(block, hash)
                        .expect("pool invariant: the engine registers only blocks it holds");
                }
            }
            if let Some(next) = output.next {
                to_sample.push((id, next));
            } // else: prefill continues next step
        }

        // Sampling is independent per sequence: run it on every core.
        let limit = self.vocab_limit;
        let mut sampled: Vec<(RequestId, Seq, SampledToken)> = to_sample
            .into_iter()
            .map(|(id, logits)| {
                let seq = self.seqs.remove(&id).expect("scheduled sequence exists");
                (id, seq, logits)
            })
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|(id, mut seq, output)| {
                let token = match output {
                    StepOutput::Sampled(sample) => seq.sampler.accept(sample),
                    StepOutput::Logits(logits) => {
                        // Candidates are the columns that are real tokens, logprobs are
                        // over the whole row: the backend's sampling does the same, so
                        // both paths draw and score alike.
                        let row = logits.row(logits.rows - 1);
                        let (prompt, output) = seq.tokens.split_at(seq.output_from);
                        seq.sampler.sample_within(row, limit, prompt, output)
                    }
                };
                (id, seq, token)
            })
            .collect();

        for (id, mut seq, sampled) in sampled.drain(..) {
            let token = sampled.token_id;
            seq.tokens.push(token);
            seq.hasher.push(token);
            if seq.first_token.is_none() {
                seq.first_token = Some(now);
            }
            if let Some(last) = seq.last_token {
                seq.inter_token.push(now - last);
            }
            seq.last_token = Some(now);
            self.counters.generation_tokens += 1;
            // The prompt is all computed: its logprobs go out before its first token (taken,
            // so a recomputed prompt is not scored again).
            if let Some(scores) = seq.prompt_logprobs.take() {
                events.push((id.clone(), RequestEvent::PromptLogprobs(scores)));
            }
            let decision = seq.stop.on_token(token, "");
            self.seqs.insert(id.clone(), seq);
            events.push((id.clone(), RequestEvent::Token(sampled)));
            let reason = match (decision.finished, self.config.role) {
                (Some(reason), _) => Some(reason),
                (None, Role::Prefill) => Some(FinishReason::Length),
                (None, Role::Mixed | Role::Decode) => None,
            };
            if let Some(reason) = reason {
                self.running.retain(|r| r != &id);
                let event = self.finish(&id, reason, now);
                events.push((id, event));
            }
        }
        self.last_step.postprocess = now.elapsed();
        events
    }

    /// Admit a waiting sequence: prefix lookup (counted the first time only), reuse of cached
    /// and restored blocks, and blocks for its first chunk. Returns the chunk's token count,
    /// or `None` (nothing held) if the pool cannot take it now.
    fn admit(&mut self, id: &RequestId, budget: usize, now: Instant) -> Option<usize> {
        if let Some(result) = self.admit_imported(id, budget, now) {
            return result;
        }
        let bs = self.block_size();
        let seq = &self.seqs[id];
        let lookup = self.config.enable_prefix_caching && !seq.wants_prompt_logprobs();
        // Hits never cover the last token: it must be computed to produce logits.
        let max_hit_blocks = (seq.tokens.len() - 1) / bs;
        let hashes: Vec<BlockHash> = if lookup {
            seq.hasher.hashes()[..max_hit_blocks.min(seq.hasher.hashes().len())].to_vec()
        } else {
            Vec::new()
        };
        let local = self.pool.cached_prefix(&hashes);
        let external = self.host.lookup(&hashes[local..]);

        let mut blocks = self
            .pool
            .acquire_cached(&hashes[..local])
            .expect("pool invariant: cached_prefix blocks can be acquired");
        // Restore host-tier blocks into fresh device blocks.
        let mut restored = 0;
        if external > 0 {
            let Some(fresh) = self.allocate(external) else {
                self.free_blocks(&blocks);
                return None;
            };
            restored = self.restore_from_host(&hashes[local..local + external], &fresh);
            blocks.extend_from_slice(&fresh[..restored]);
            self.free_blocks(&fresh[restored..]);
        }
        let cached = (local + restored) * bs;
        let seq = self.seqs.get_mut(id).expect("exists");
        seq.blocks = blocks;
        seq.computed = cached;
        seq.registered = local + restored;
        let n = (seq.tokens.len() - cached).min(budget);
        if !self.grow(id, cached + n) {
            let seq = self.seqs.get_mut(id).expect("exists");
            let blocks = std::mem::take(&mut seq.blocks);
            seq.computed = 0;
            seq.registered = 0;
            self.free_blocks(&blocks);
            return None;
        }
        let seq = self.seqs.get_mut(id).expect("exists");
        if !seq.admitted {
            seq.admitted = true;
            seq.first_scheduled = Some(now);
            seq.outcome =
                lookup.then(|| PrefixOutcome::new(seq.prompt_len, local * bs, restored * bs));
            self.counters
                .on_admitted(seq.prompt_len, seq.outcome.as_ref());
        }
        Some(n)
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
