//! Running one [`Schedule`]: the batch's items, what each wants back, and one forward pass.
//! Nothing here changes a sequence; `postprocess` applies the results.
//!
//! Sequences that finish their tokens this step get their token chosen where the logits
//! are when they have a plan (all but edits past a quarter of the vocabulary); the others,
//! and rows the backend hands back, get logits for the host sampler. Prompt positions not
//! yet scored are scored where the logits are.

use crate::backend::Backend;
use crate::executor::{ExecItem, ItemOutput, ItemWants, NextToken};

use super::Engine;
use super::schedule::Schedule;

impl<B: Backend> Engine<B> {
    /// One forward pass over the schedule; one output per scheduled sequence, in order.
    pub(super) fn execute(&mut self, schedule: &Schedule) -> Vec<ItemOutput> {
        let limit = self.vocab_limit;
        let next: Vec<NextToken> = schedule
            .items
            .iter()
            .map(|s| {
                let seq = self.seqs.get_mut(&s.id).expect("scheduled sequence exists");
                if seq.computed + s.tokens == seq.tokens.len() {
                    let (prompt, output) = seq.tokens.split_at(seq.output_from);
                    NextToken::sample(seq.sampler.device_plan(prompt, output, limit))
                } else {
                    NextToken::None
                }
            })
            .collect();
        let items: Vec<ExecItem<'_>> = schedule
            .items
            .iter()
            .map(|s| {
                let seq = &self.seqs[&s.id];
                ExecItem {
                    tokens: &seq.tokens[seq.computed..seq.computed + s.tokens],
                    start: seq.computed,
                    block_table: &seq.blocks,
                    all_logits: false,
                }
            })
            .collect();
        let wants: Vec<ItemWants<'_>> = schedule
            .items
            .iter()
            .zip(next)
            .map(|(s, next)| ItemWants {
                prompt: self.seqs[&s.id].prompt_scoring(s.tokens),
                next,
            })
            .collect();
        self.executor.execute_sampling(&items, &wants, limit)
    }
}
