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

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::ErrorKind;
use crate::executor::{ExecItem, Executor};
use crate::generate::validate_prompt;
use crate::kv::block_buffers::{BlockBuffers, DEFAULT_SPARE_BYTES};
use crate::kv::hash::{BlockHash, BlockHasher};
use crate::kv::host_tier::HostTier;
use crate::kv::pool::BlockPool;
use crate::kv::tier::ExternalTier;
use rayon::prelude::*;

use crate::sampling::{
    FinishReason, PromptLogprob, SampledToken, Sampler, StopChecker, prompt_logprobs,
};

use super::counters::{EngineCounters, PrefixOutcome};
use super::lease_store::LeaseStore;
use super::request::{
    EngineRequest, Finished, ImportedKv, KvLease, RequestError, RequestEvent, RequestId,
    RequestTimings, Usage,
};

/// What a node does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Prefill and decode in one engine.
    Mixed,
    /// Prefill only: stop after the first token and keep the KV blocks under a lease.
    Prefill,
    /// Decode only: every request brings its prompt's KV ([`super::ImportedKv`]).
    Decode,
}

/// Engine settings (the nodes' and `pdctl run`'s flags).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub role: Role,
    pub enable_prefix_caching: bool,
    /// Blocks in the host tier (0 disables it).
    pub host_cache_blocks: usize,
    /// Token budget of one step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Context limit (prompt + generated).
    pub max_model_len: usize,
    /// How long a prefill lease pins its blocks if never released.
    pub lease_timeout: Duration,
    /// Seed for requests without one (each request gets `seed ^ hash(request id)`).
    pub seed: u64,
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), RequestError> {
        let bad = |m: String| RequestError {
            kind: ErrorKind::InvalidArgument,
            message: m,
        };
        if self.max_num_batched_tokens == 0 {
            return Err(bad("max-num-batched-tokens must be > 0".into()));
        }
        if self.max_num_seqs == 0 {
            return Err(bad("max-num-seqs must be > 0".into()));
        }
        Ok(())
    }
}

struct Seq {
    req: EngineRequest,
    prompt_len: usize,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    hasher: BlockHasher,
    blocks: Vec<u32>,
    /// Tokens whose KV is in `blocks`.
    computed: usize,
    /// Leading blocks registered in the prefix cache.
    registered: usize,
    sampler: Sampler,
    stop: StopChecker,
    /// Whether the request has been admitted once (lookup and counting happen then only).
    admitted: bool,
    /// Decode role: KV to place on first admission (dropped after it).
    imported: Option<ImportedKv>,
    outcome: Option<PrefixOutcome>,
    prompt_logprobs: Option<Vec<PromptLogprob>>,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    inter_token: Vec<Duration>,
}

impl Seq {
    fn wants_prompt_logprobs(&self) -> bool {
        self.req.params.prompt_logprobs.is_some()
    }

    fn usage(&self) -> Usage {
        let (local, external) = self
            .outcome
            .map(|o| (o.local_hits, o.external_hits))
            .unwrap_or((0, 0));
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.tokens.len() - self.prompt_len,
            local_cached_tokens: local,
            external_cached_tokens: external,
        }
    }

    fn timings(&self, now: Instant) -> RequestTimings {
        let scheduled = self.first_scheduled.unwrap_or(now);
        let first = self.first_token;
        RequestTimings {
            queue: scheduled - self.arrival,
            prefill: first.unwrap_or(now) - scheduled,
            decode: first.map(|f| now - f).unwrap_or_default(),
            time_to_first_token: first.map(|f| f - self.arrival),
            end_to_end: now - self.arrival,
            inter_token: self.inter_token.clone(),
        }
    }
}

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

struct Lease {
    blocks: Vec<u32>,
    deadline: Instant,
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
    /// Copies of the leased blocks, for the export side (read without this thread).
    lease_store: LeaseStore,
    /// Host buffers of imported blocks, given back once copied into KV storage.
    import_buffers: BlockBuffers,
    next_lease: u64,
    counters: EngineCounters,
    expired_leases: u64,
    eos_token_ids: Vec<u32>,
    /// Sampled ids are kept below this (ids past the tokenizer's vocabulary have no text).
    vocab_limit: usize,
    block_buf: Vec<f32>,
    last_step: StepStats,
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
        let block_len = executor.block_len();
        let pool = BlockPool::new(executor.num_blocks());
        let host = HostTier::new(config.host_cache_blocks, block_len);
        Ok(Self {
            config,
            executor,
            pool,
            host,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            leases: HashMap::new(),
            lease_store: LeaseStore::default(),
            import_buffers: BlockBuffers::new(block_len, DEFAULT_SPARE_BYTES),
            next_lease: 1,
            counters: EngineCounters::default(),
            expired_leases: 0,
            eos_token_ids,
            vocab_limit,
            block_buf: vec![0.0; block_len],
            last_step: StepStats::default(),
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
        let c = self.executor.model().config();
        validate_prompt(
            &req.prompt,
            c.vocab_size,
            self.config.max_model_len,
            req.params.max_tokens,
        )
        .map_err(|e| invalid(e.to_string()))?;
        req.params
            .validate(c.vocab_size, self.config.max_model_len as u32)
            .map_err(|e| invalid(e.to_string()))?;
        let bs = self.block_size();
        let need = (req.prompt.len() + req.params.max_tokens as usize).div_ceil(bs);
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
        let mut hasher = BlockHasher::new(bs, req.cache_salt.as_deref());
        hasher.extend(&req.prompt);
        let mut tokens = req.prompt.clone();
        let mut stop = StopChecker::new(&req.params, self.eos_token_ids.clone());
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
            tokens,
            hasher,
            blocks: Vec::new(),
            computed: 0,
            registered: 0,
            sampler: Sampler::new(&req.params, seed),
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

    /// Release a prefill lease; false if it does not exist (released or expired).
    pub fn release_lease(&mut self, lease_id: u64) -> bool {
        self.lease_store.remove(lease_id);
        match self.leases.remove(&lease_id) {
            Some(lease) => {
                self.free_blocks(&lease.blocks);
                true
            }
            None => false,
        }
    }

    /// Release every lease past its deadline.
    pub fn expire_leases(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.release_lease(id);
            self.expired_leases += 1;
        }
    }

    /// Copy blocks `first .. first + count` of a lease out of KV storage (the export side of
    /// a KV transfer). `None` if the lease does not exist or is shorter.
    pub fn read_lease(&self, lease_id: u64, first: usize, count: usize) -> Option<Vec<Vec<f32>>> {
        self.lease_store.read(lease_id, first, count)
    }

    /// The buffers imported KV arrives in: the importer takes them, this engine gives them
    /// back after copying their blocks into KV storage.
    pub fn import_buffers(&self) -> BlockBuffers {
        self.import_buffers.clone()
    }

    /// The copies of leased blocks, shared with whoever exports them (see [`LeaseStore`]).
    pub fn lease_store(&self) -> LeaseStore {
        self.lease_store.clone()
    }

    pub fn num_leases(&self) -> usize {
        self.leases.len()
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

        // 3. Forward.
        let logits = {
            let items: Vec<ExecItem<'_>> = scheduled
                .iter()
                .map(|(id, n)| {
                    let seq = &self.seqs[id];
                    ExecItem {
                        tokens: &seq.tokens[seq.computed..seq.computed + n],
                        start: seq.computed,
                        block_table: &seq.blocks,
                        all_logits: seq.wants_prompt_logprobs() && seq.computed < seq.prompt_len,
                    }
                })
                .collect();
            self.executor.execute(&items)
        };

        // 4. Results.
        let now = Instant::now();
        self.last_step = StepStats {
            seqs: scheduled.len(),
            tokens: scheduled.iter().map(|(_, n)| n).sum(),
            schedule: planned - started,
            forward: now - planned,
            postprocess: Duration::ZERO,
        };
        let mut to_sample = Vec::new();
        for ((id, n), logits) in scheduled.into_iter().zip(logits) {
            let caching = self.config.enable_prefix_caching;
            let seq = self.seqs.get_mut(&id).expect("scheduled sequence exists");
            let start = seq.computed;
            seq.computed += n;
            if let (Some(lp), Some(k)) =
                (seq.prompt_logprobs.as_mut(), seq.req.params.prompt_logprobs)
                && logits.rows == n
            {
                for r in 0..n {
                    let p = start + r;
                    // Row at position p scores prompt token p + 1; each position once, even
                    // when a preempted request recomputes its prompt.
                    if p + 1 < seq.prompt_len && lp.len() == p {
                        lp.push(prompt_logprobs(logits.row(r), seq.tokens[p + 1], k));
                    }
                }
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
            if seq.computed == seq.tokens.len() {
                to_sample.push((id, logits));
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
            .map(|(id, mut seq, logits)| {
                let mut row = logits.row(logits.rows - 1).to_vec();
                let limit = limit.min(row.len());
                row[limit..].fill(f32::NEG_INFINITY);
                let (prompt, output) = seq.tokens.split_at(seq.prompt_len);
                let token = seq.sampler.sample(&row, prompt, output);
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

    /// Make `id`'s blocks cover `tokens` tokens. False (nothing allocated) if the pool is
    /// short.
    fn grow(&mut self, id: &RequestId, tokens: usize) -> bool {
        let bs = self.block_size();
        let have = self.seqs[id].blocks.len();
        let need = tokens.div_ceil(bs).saturating_sub(have);
        if need == 0 {
            return true;
        }
        match self.allocate(need) {
            Some(blocks) => {
                self.seqs.get_mut(id).expect("exists").blocks.extend(blocks);
                true
            }
            None => false,
        }
    }

    /// Allocate blocks, spilling evicted cached blocks to the host tier first.
    fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        let alloc = self.pool.allocate(n).ok()?;
        for (block, hash) in alloc.evicted {
            if self.config.host_cache_blocks > 0 {
                self.executor.read_block(block, &mut self.block_buf);
                self.host.offer(hash, &self.block_buf);
            }
        }
        Some(alloc.blocks)
    }

    /// Free a sequence's blocks, given in logical order (the pool releases them tail first).
    fn free_blocks(&mut self, blocks: &[u32]) {
        self.pool
            .free(blocks)
            .expect("pool invariant: the engine frees only blocks it holds");
    }

    fn register(&mut self, block: u32, hash: BlockHash) {
        self.pool
            .register(block, hash)
            .expect("pool invariant: the engine registers only blocks it holds");
    }

    /// Put a running sequence back in front of the queue, its blocks freed (their content
    /// stays in the prefix cache where registered).
    fn preempt(&mut self, id: &RequestId) {
        let seq = self.seqs.get_mut(id).expect("exists");
        let blocks = std::mem::take(&mut seq.blocks);
        seq.computed = 0;
        seq.registered = 0;
        self.free_blocks(&blocks);
        self.counters.preemptions += 1;
        self.waiting.push_front(id.clone());
    }

    /// Imported KV must cover the prompt to its end in whole blocks of this node's layout.
    fn check_imported(&self, req: &EngineRequest, imp: &ImportedKv) -> Result<(), RequestError> {
        let invalid = |m: String| RequestError {
            kind: ErrorKind::InvalidArgument,
            message: m,
        };
        let bs = self.block_size();
        let total = req.prompt.len().div_ceil(bs);
        if imp.first_block + imp.blocks.len() != total || imp.first_block * bs >= req.prompt.len() {
            return Err(invalid(format!(
                "imported KV covers blocks {}..{}, the prompt needs blocks ..{total}",
                imp.first_block,
                imp.first_block + imp.blocks.len()
            )));
        }
        let len = self.executor.block_len();
        if let Some(b) = imp.blocks.iter().position(|b| b.len() != len) {
            return Err(invalid(format!(
                "imported KV block {} has {} values; this node's layout needs {len}",
                imp.first_block + b,
                imp.blocks[b].len()
            )));
        }
        let vocab = self.executor.model().config().vocab_size;
        if imp.first_token as usize >= vocab {
            return Err(invalid(format!(
                "first token {} is outside the vocabulary (size {vocab})",
                imp.first_token
            )));
        }
        Ok(())
    }

    /// Leading blocks of `tokens` (with `salt`) this node's device cache holds now: what a
    /// decode node need not pull.
    pub fn cached_prefix_blocks(&self, tokens: &[u32], salt: Option<&str>) -> usize {
        if !self.config.enable_prefix_caching || tokens.is_empty() {
            return 0;
        }
        let bs = self.block_size();
        let hashes = crate::kv::hash::block_hashes(tokens, bs, salt);
        // Never the block holding the last token (a prefill node computes it).
        let usable = (tokens.len() - 1) / bs;
        self.pool.cached_prefix(&hashes[..usable.min(hashes.len())])
    }

    /// First admission of a request that brings its prompt's KV: reuse the local prefix,
    /// place the imported blocks after it, compute only the first token. `None` (nothing
    /// held) if the pool cannot take it now; the imported KV is kept for the next try.
    fn admit_imported(
        &mut self,
        id: &RequestId,
        budget: usize,
        now: Instant,
    ) -> Option<Option<usize>> {
        let bs = self.block_size();
        let seq = &self.seqs[id];
        let imp = seq.imported.as_ref()?;
        let lookup = self.config.enable_prefix_caching;
        let prompt_len = seq.prompt_len;
        let total = prompt_len.div_ceil(bs);
        let full = prompt_len / bs;
        let hashes: Vec<BlockHash> = if lookup {
            seq.hasher.hashes()[..full].to_vec()
        } else {
            Vec::new()
        };
        let local = self.pool.cached_prefix(&hashes);
        if local < imp.first_block {
            // Blocks the puller saw cached were evicted since: the imported KV no longer
            // joins up, so the prompt is computed here instead (and nothing counts as
            // external).
            self.seqs.get_mut(id).expect("exists").imported = None;
            return None;
        }
        let mut blocks = self
            .pool
            .acquire_cached(&hashes[..local])
            .expect("pool invariant: cached_prefix blocks can be acquired");
        let fresh = match self.allocate(total - local) {
            Some(fresh) => fresh,
            None => {
                self.free_blocks(&blocks);
                return Some(None);
            }
        };
        let imp = self
            .seqs
            .get_mut(id)
            .expect("exists")
            .imported
            .take()
            .expect("checked");
        for (j, &block) in fresh.iter().enumerate() {
            let logical = local + j;
            self.executor
                .write_block(block, &imp.blocks[logical - imp.first_block]);
            if logical < hashes.len() {
                self.register(block, hashes[logical]);
            }
        }
        self.import_buffers.give_all(imp.blocks);
        blocks.extend(fresh);
        let seq = self.seqs.get_mut(id).expect("exists");
        seq.blocks = blocks;
        seq.computed = prompt_len;
        seq.registered = full;
        let n = (seq.tokens.len() - prompt_len).min(budget);
        if !self.grow(id, prompt_len + n) {
            // Keep nothing; the KV is gone, so the next try computes the prompt.
            let seq = self.seqs.get_mut(id).expect("exists");
            let blocks = std::mem::take(&mut seq.blocks);
            seq.computed = 0;
            seq.registered = 0;
            self.free_blocks(&blocks);
            return Some(None);
        }
        let seq = self.seqs.get_mut(id).expect("exists");
        seq.admitted = true;
        seq.first_scheduled = Some(now);
        seq.outcome =
            lookup.then(|| PrefixOutcome::new(prompt_len, local * bs, prompt_len - local * bs));
        self.counters.on_admitted(prompt_len, seq.outcome.as_ref());
        Some(Some(n))
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
            for (j, &block) in fresh.iter().enumerate() {
                let hash = hashes[local + j];
                if restored == j && self.host.fetch(hash, &mut self.block_buf).is_ok() {
                    self.executor.write_block(block, &self.block_buf);
                    self.register(block, hash);
                    restored += 1;
                }
            }
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
        let lease = if self.config.role == Role::Prefill && reason != FinishReason::Abort {
            let lease_id = self.next_lease;
            self.next_lease += 1;
            // The lease covers the prompt's KV (the first token's KV is not computed yet).
            let prompt_blocks = seq.prompt_len.div_ceil(self.block_size());
            let (keep, rest) = blocks.split_at(prompt_blocks.min(blocks.len()));
            self.free_blocks(rest);
            let copies = keep
                .iter()
                .map(|&b| {
                    let mut data = vec![0.0; self.executor.block_len()];
                    self.executor.read_block(b, &mut data);
                    data
                })
                .collect();
            self.lease_store.insert(lease_id, copies);
            self.leases.insert(
                lease_id,
                Lease {
                    blocks: keep.to_vec(),
                    deadline: now + self.config.lease_timeout,
                },
            );
            let full = seq.prompt_len / self.block_size();
            Some(KvLease {
                lease_id,
                blocks: keep.to_vec(),
                block_hashes: seq.hasher.hashes()[..full].to_vec(),
                num_tokens: seq.prompt_len,
            })
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
            prompt_logprobs: seq.prompt_logprobs.take(),
            lease,
        }))
    }
}
