//! Planning one step: which sequences run and how many new tokens each computes, as a
//! [`Schedule`] value (executed by `execute`, its results applied by `postprocess`).
//!
//! The rules: (1) running sequences, in admission order, get their next chunk (decode: one
//! token) within the step's token budget, preempting the most recently admitted sequence
//! when blocks run out; (2) if nothing was preempted, waiting sequences are admitted in
//! arrival order while `max_num_seqs` and the budget allow, each with one prefix lookup
//! (device, then host tier). Blocks are allocated here; nothing runs the model.

use std::time::Instant;

use crate::backend::Backend;
use crate::kv::prefix::hash::BlockHash;
use crate::kv::prefix::tier::ExternalTier;
use crate::serve::counters::PrefixOutcome;
use crate::serve::external::PerTier;
use crate::serve::request::RequestId;

use super::Engine;

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Scheduled {
    pub(super) id: RequestId,
    /// New tokens whose KV this step computes (a prefill chunk, or one decode token).
    pub(super) tokens: usize,
}

/// The plan of one step, in batch order: the running sequences kept (admission order),
/// then the sequences admitted this step (arrival order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Schedule {
    pub(super) items: Vec<Scheduled>,
    /// Whether a running sequence was preempted (then nothing was admitted).
    pub(super) preempted: bool,
}

impl Schedule {
    pub(super) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Tokens the step computes, over all sequences.
    pub(super) fn num_tokens(&self) -> usize {
        self.items.iter().map(|s| s.tokens).sum()
    }
}

impl<B: Backend> Engine<B> {
    /// Plan the next step (see the module doc). An empty plan means nothing can run now.
    pub(super) fn schedule(&mut self, now: Instant) -> Schedule {
        let mut budget = self.config.max_num_batched_tokens;
        let mut schedule = Schedule::default();
        self.schedule_running(&mut schedule, &mut budget);
        if !schedule.preempted {
            self.admit_waiting(&mut schedule, &mut budget, now);
        }
        schedule
    }

    /// Running sequences, in admission order; the newest is preempted first.
    fn schedule_running(&mut self, schedule: &mut Schedule, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i].clone();
            let seq = &self.seqs[&id];
            let n = (seq.tokens.len() - seq.computed).min(*budget);
            if self.grow_or_preempt(&id, seq.computed + n, schedule) {
                schedule.items.push(Scheduled { id, tokens: n });
                *budget -= n;
                i += 1;
            }
        }
    }

    /// Make `id`'s blocks cover `target` tokens, preempting the most recently admitted
    /// sequences until they do. False if `id` itself had to be preempted.
    fn grow_or_preempt(&mut self, id: &RequestId, target: usize, schedule: &mut Schedule) -> bool {
        loop {
            if self.grow(id, target) {
                return true;
            }
            let victim = self.running.pop().expect("the current sequence is running");
            self.preempt(&victim);
            schedule.preempted = true;
            if &victim == id {
                return false;
            }
        }
    }

    /// Waiting sequences in arrival order, while there is room, budget and blocks.
    fn admit_waiting(&mut self, schedule: &mut Schedule, budget: &mut usize, now: Instant) {
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(id) = self.waiting.front().cloned() else {
                break;
            };
            let Some(n) = self.admit(&id, *budget, now) else {
                break;
            };
            self.waiting.pop_front();
            self.running.push(id.clone());
            schedule.items.push(Scheduled { id, tokens: n });
            *budget -= n;
        }
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
        let (blocks, local, restored) = self.take_cached_prefix(&hashes)?;
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
        // The restored blocks' external hits count for the tier they came from.
        let restored_from = self.host.kind();
        let seq = self.seqs.get_mut(id).expect("exists");
        if !seq.admitted {
            seq.admitted = true;
            seq.first_scheduled = Some(now);
            seq.outcome = lookup.then(|| {
                let restored = PerTier::only(restored_from, restored * bs);
                PrefixOutcome::new(seq.prompt_len, local * bs, restored)
            });
            self.counters
                .on_admitted(seq.prompt_len, seq.outcome.as_ref());
        }
        Some(n)
    }

    /// The blocks of the longest cached prefix of `hashes`: device hits acquired, then host
    /// tier hits restored into fresh blocks. Returns them with the number of device hits and
    /// of restored blocks; `None` (nothing held) if fresh blocks for the restore are short.
    fn take_cached_prefix(&mut self, hashes: &[BlockHash]) -> Option<(Vec<u32>, usize, usize)> {
        let local = self.pool.cached_prefix(hashes);
        let external = self.host.lookup(&hashes[local..]);
        let mut blocks = self
            .pool
            .acquire_cached(&hashes[..local])
            .expect("pool invariant: cached_prefix blocks can be acquired");
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
        Some((blocks, local, restored))
    }
}

#[cfg(test)]
mod tests;
