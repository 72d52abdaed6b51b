//! Applying one step's results: computed tokens and prompt scores recorded, full blocks
//! registered in the prefix cache, next tokens sampled (in parallel: sampling is
//! independent per sequence), stop checks, and the events the step produced. Sequences
//! whose prompt is not done yet only advance.

use std::time::Instant;

use rayon::prelude::*;

use crate::backend::Backend;
use crate::executor::{ItemOutput, StepOutput};
use crate::kv::prefix::hash::BlockHash;
use crate::sampling::{FinishReason, SampledToken};
use crate::serve::config::Role;
use crate::serve::request::{RequestEvent, RequestId};

use super::schedule::Schedule;
use super::seq::Seq;
use super::{Engine, Events};

impl<B: Backend> Engine<B> {
    /// Apply the outputs of `schedule` (one per item, in order); returns the step's events.
    pub(super) fn post_process(
        &mut self,
        schedule: Schedule,
        outputs: Vec<ItemOutput>,
        now: Instant,
    ) -> Events {
        let mut to_sample = Vec::new();
        for (s, output) in schedule.items.into_iter().zip(outputs) {
            if let Some(next) = self.advance(&s.id, s.tokens, output) {
                to_sample.push((s.id, next));
            } // else: prefill continues next step
        }
        let mut events = Events::new();
        for (id, seq, sampled) in self.sample_all(to_sample) {
            self.accept_token(id, seq, sampled, now, &mut events);
        }
        events
    }

    /// Record `n` computed tokens of `id` and its prompt scores, and register its blocks
    /// that became full. Returns what its next token is chosen from, if it wants one.
    fn advance(&mut self, id: &RequestId, n: usize, output: ItemOutput) -> Option<StepOutput> {
        let bs = self.block_size();
        let seq = self.seqs.get_mut(id).expect("scheduled sequence exists");
        seq.computed += n;
        if let Some(lp) = seq.prompt_logprobs.as_mut() {
            lp.extend(output.prompt_logprobs);
        }
        if self.config.enable_prefix_caching {
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
        output.next
    }

    /// The next token of each sequence, sampled on every core. The sequences are taken out
    /// of the engine meanwhile (`accept_token` puts them back).
    fn sample_all(
        &mut self,
        to_sample: Vec<(RequestId, StepOutput)>,
    ) -> Vec<(RequestId, Seq, SampledToken)> {
        let limit = self.vocab_limit;
        to_sample
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
            .collect()
    }

    /// Append a sampled token to its sequence (put back into the engine), with its events:
    /// prompt scores first (once), the token, and the end if it stops the request here.
    fn accept_token(
        &mut self,
        id: RequestId,
        mut seq: Seq,
        sampled: SampledToken,
        now: Instant,
        events: &mut Events,
    ) {
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
}
