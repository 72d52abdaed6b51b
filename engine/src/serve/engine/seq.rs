//! One open request inside the engine: its tokens, blocks, sampler, stop state, imported KV
//! and timings, and what it reports at the end (usage, timings). The scheduling rules that
//! move it live in the engine.

use std::time::{Duration, Instant};

use crate::executor::PromptScoring;
use crate::kv::prefix::hash::BlockHasher;
use crate::sampling::{PromptLogprob, Sampler, StopChecker};
use crate::serve::counters::PrefixOutcome;
use crate::serve::request::{EngineRequest, ImportedKv, RequestTimings, Usage};

pub(super) struct Seq {
    pub(super) req: EngineRequest,
    /// Tokens whose KV is the prompt's: computed (or imported) as a prompt, looked up in the
    /// prefix cache and counted as prompt tokens by this node.
    pub(super) prompt_len: usize,
    /// Where the output begins in `tokens`, as sampling sees it: `prompt_len`, or before it
    /// when the request was resumed ([`EngineRequest::resumed`]).
    pub(super) output_from: usize,
    /// Prompt followed by the generated tokens.
    pub(super) tokens: Vec<u32>,
    /// Where the tokens this engine samples begin in `tokens`: after the prompt, and after
    /// the first token on a decode node (the prefill node sampled it).
    pub(super) sampled_from: usize,
    pub(super) hasher: BlockHasher,
    pub(super) blocks: Vec<u32>,
    /// Tokens whose KV is in `blocks`.
    pub(super) computed: usize,
    /// Leading blocks registered in the prefix cache.
    pub(super) registered: usize,
    pub(super) sampler: Sampler,
    pub(super) stop: StopChecker,
    /// Whether the request has been admitted once (lookup and counting happen then only).
    pub(super) admitted: bool,
    /// Decode role: KV to place on first admission (dropped after it).
    pub(super) imported: Option<ImportedKv>,
    pub(super) outcome: Option<PrefixOutcome>,
    pub(super) prompt_logprobs: Option<Vec<PromptLogprob>>,
    pub(super) arrival: Instant,
    pub(super) first_scheduled: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    pub(super) last_token: Option<Instant>,
    pub(super) inter_token: Vec<Duration>,
}

impl Seq {
    pub(super) fn wants_prompt_logprobs(&self) -> bool {
        self.req.params.prompt_logprobs.is_some()
    }

    /// The positions among this step's `n` new tokens (from `computed`) to score for
    /// `prompt_logprobs`: position `p` scores prompt token `p + 1`, each position once, in
    /// order (a preempted request recomputing its prompt scores nothing twice; positions
    /// whose KV came from elsewhere are never scored, so none after them either).
    pub(super) fn prompt_scoring(&self, n: usize) -> Option<PromptScoring<'_>> {
        let top = self.req.params.prompt_logprobs?;
        let scored = self.prompt_logprobs.as_ref()?.len();
        if scored < self.computed {
            return None;
        }
        let end = (self.computed + n).min(self.prompt_len.saturating_sub(1));
        (scored < end).then(|| PromptScoring {
            first: scored - self.computed,
            next_tokens: &self.tokens[scored + 1..end + 1],
            top,
        })
    }

    pub(super) fn usage(&self) -> Usage {
        let (local, external) = self
            .outcome
            .map(|o| (o.local_hits, o.external_by_source))
            .unwrap_or_default();
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.tokens.len() - self.prompt_len,
            local_cached_tokens: local,
            external_cached_tokens: external.total(),
            external_cached_by_source: external,
        }
    }

    pub(super) fn timings(&self, now: Instant) -> RequestTimings {
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
