//! The logits processors' own arithmetic, shared by the host sampler ([`super::Sampler`],
//! which applies them to a row) and its device plan (which turns them into per-id
//! [`TokenEdit`]s): vLLM's repetition, frequency and presence penalties, `logit_bias` merged
//! to one entry per id, and the builder of those edits. Which processors act on a step, and
//! in what order, is the sampler's business.

use super::device::TokenEdit;

/// vLLM's repetition penalty: every id present in the prompt or the output, counted once,
/// has its logit divided by `penalty` when positive and multiplied by it otherwise.
pub(super) fn apply_repetition_penalty(
    logits: &mut [f32],
    seen: &mut Vec<u32>,
    stamp: &mut u32,
    penalty: f32,
    prompt_tokens: &[u32],
    output_tokens: &[u32],
) {
    if seen.len() < logits.len() {
        seen.resize(logits.len(), 0);
    }
    *stamp = stamp.wrapping_add(1);
    if *stamp == 0 {
        seen.fill(0);
        *stamp = 1;
    }
    for &t in prompt_tokens.iter().chain(output_tokens) {
        let i = t as usize;
        if i < logits.len() && seen[i] != *stamp {
            seen[i] = *stamp;
            let l = logits[i];
            logits[i] = if l > 0.0 { l / penalty } else { l * penalty };
        }
    }
}

/// vLLM's frequency and presence penalties (OpenAI's): every id in the output has
/// `frequency × its count` and then `presence` subtracted from its logit. `counts` is all
/// zero on entry and on return.
pub(super) fn apply_output_penalties(
    logits: &mut [f32],
    counts: &mut Vec<u32>,
    counted: &mut Vec<u32>,
    frequency: f32,
    presence: f32,
    output_tokens: &[u32],
) {
    if counts.len() < logits.len() {
        counts.resize(logits.len(), 0);
    }
    counted.clear();
    for &t in output_tokens {
        let i = t as usize;
        if i < logits.len() {
            if counts[i] == 0 {
                counted.push(t);
            }
            counts[i] += 1;
        }
    }
    for &t in counted.iter() {
        let i = t as usize;
        logits[i] = (logits[i] - frequency * counts[i] as f32) - presence;
        counts[i] = 0;
    }
}

/// `logit_bias` with one entry per id, sorted by id: an id listed twice gets the sum of its
/// biases in the order given (added once, so the host and a backend's edits round alike).
/// Non-finite values are dropped.
pub(super) fn merge_logit_bias(bias: &[(u32, f32)]) -> Vec<(u32, f32)> {
    let mut sorted: Vec<(u32, f32)> = bias
        .iter()
        .copied()
        .filter(|(_, b)| b.is_finite())
        .collect();
    // Stable: equal ids keep their order, so the sum is the one the list spells.
    sorted.sort_by_key(|&(id, _)| id);
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(sorted.len());
    for (id, b) in sorted {
        match out.last_mut() {
            Some((last, sum)) if *last == id => *sum += b,
            _ => out.push((id, b)),
        }
    }
    out
}

/// Builds a [`Reshape`]'s edits, one per id, through a dense id → edit index map.
pub(super) struct EditBuilder<'a> {
    /// All `u32::MAX` on entry and after [`EditBuilder::finish`]; ids past its end are not
    /// real tokens and get no edit.
    pub(super) slots: &'a mut [u32],
    pub(super) edits: Vec<TokenEdit>,
}

impl EditBuilder<'_> {
    /// `id`'s edit with `op` added, or `None` for an id past the vocabulary limit.
    pub(super) fn add(&mut self, id: u32, op: u32) -> Option<&mut TokenEdit> {
        let slot = self.slots.get_mut(id as usize)?;
        if *slot == u32::MAX {
            *slot = self.edits.len() as u32;
            self.edits.push(TokenEdit {
                id,
                ops: 0,
                bias: 0.0,
                frequency: 0.0,
            });
        }
        let e = &mut self.edits[*slot as usize];
        e.ops |= op;
        Some(e)
    }

    pub(super) fn finish(self) -> Vec<TokenEdit> {
        for e in &self.edits {
            self.slots[e.id as usize] = u32::MAX;
        }
        self.edits
    }
}
