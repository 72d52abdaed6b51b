//! The device side of a request's sampler: the plan a backend samples a row by (the method,
//! the uniform draw, the logits processors as edits of the ids they touch), and taking back
//! the token it chose. The host's own draw is `super`'s.

use rand::RngExt;

use super::super::device::{
    DeviceSample, DeviceSampling, MAX_DEVICE_TOP_K, Reshape, SamplePlan, edit,
};
use super::super::processors::EditBuilder;
use super::{SampledToken, Sampler, allowed_within, step_ids};

impl Sampler {
    /// How a backend may choose this request's next token where the logits are (see
    /// [`super::super::device`]), given the request's tokens so far and the number of logits columns
    /// that are real tokens, or `None` when it needs the host: logits processors that touch
    /// more than a quarter of the vocabulary this step (their edits would then weigh more
    /// than the row of logits). (A dense top-p may still come back,
    /// see [`super::super::DeviceSample::needs_host`].) The uniform draw is the one [`Sampler::sample`] would make for this
    /// output token (each token has its own place in the request's RNG stream).
    pub fn device_plan(
        &mut self,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        vocab_limit: usize,
    ) -> Option<SamplePlan> {
        // The host's threshold is `lmax + temperature * ln(min_p)`, in this order.
        let min_p_margin = if self.min_p > 0.0 {
            self.temperature * self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        if !self.greedy {
            self.seek_draw(output_tokens.len());
        }
        let method = if self.greedy {
            DeviceSampling::Greedy
        } else if self.top_k == 0 || self.top_k > MAX_DEVICE_TOP_K {
            DeviceSampling::Dense {
                top_k: self.top_k,
                inv_temperature: 1.0 / self.temperature,
                top_p: self.top_p,
                min_p_margin,
                uniform: self.rng.clone().random::<f64>(),
            }
        } else {
            DeviceSampling::TopK {
                k: self.top_k,
                inv_temperature: 1.0 / self.temperature,
                top_p: self.top_p,
                min_p_margin,
                uniform: self.rng.clone().random::<f64>(),
            }
        };
        // An allowed set whose edits alone are past the limit goes to the host before they
        // are built and thrown away: one that holds a quarter of the vocabulary or more, and
        // leaves out a quarter or more (a set larger than that travels as masks of the ids it
        // leaves out: a guide inside a JSON string allows nearly every token).
        let allowed = if self.step_allowed(output_tokens) {
            let real = allowed_within(
                step_ids(&self.guide, &self.allowed, &self.guided),
                vocab_limit,
            );
            if real > vocab_limit / 4 && vocab_limit - real > vocab_limit / 4 {
                return None;
            }
            Some(real)
        } else {
            None
        };
        let reshape = self.reshape(prompt_tokens, output_tokens, vocab_limit, allowed);
        if reshape
            .as_ref()
            .is_some_and(|r| r.edits.len() > vocab_limit / 4)
        {
            return None;
        }
        Some(SamplePlan {
            method,
            reshape,
            top_logprobs: self.logprobs.unwrap_or(0),
        })
    }

    /// The logits processors of the next step as one edit per touched id (the host's
    /// [`Sampler::sample`] applies the same operations, in the same order, to a dense copy).
    /// `allowed`: how many real ids this step allows, when it restricts them.
    fn reshape(
        &mut self,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        vocab_limit: usize,
        allowed: Option<usize>,
    ) -> Option<Reshape> {
        let active = self.active(prompt_tokens, output_tokens);
        if !active.any() {
            return None;
        }
        let restricted = allowed.is_some();
        if self.edit_slots.len() < vocab_limit {
            self.edit_slots.resize(vocab_limit, u32::MAX);
        }
        let mut b = EditBuilder {
            slots: &mut self.edit_slots[..vocab_limit],
            edits: Vec::new(),
        };
        // More than half the vocabulary allowed: the ids left out are fewer, and masking them
        // (`-inf`, as `allowed_only` would) gives every logit the same value.
        let complement = allowed.is_some_and(|real| real > vocab_limit / 2);
        let allowed = step_ids(&self.guide, &self.allowed, &self.guided);
        if complement {
            self.allowed_bits.clear();
            self.allowed_bits.resize(vocab_limit, false);
            for &id in allowed {
                if let Some(bit) = self.allowed_bits.get_mut(id as usize) {
                    *bit = true;
                }
            }
            for (id, _) in self.allowed_bits.iter().enumerate().filter(|(_, a)| !**a) {
                b.add(id as u32, edit::MASK);
            }
        } else {
            for &id in allowed {
                b.add(id, edit::ALLOWED);
            }
        }
        for &(id, bias) in &self.logit_bias {
            if let Some(e) = b.add(id, edit::BIAS) {
                e.bias = bias;
            }
        }
        for seq in &self.bad_words {
            if let Some((&last, prefix)) = seq.split_last()
                && output_tokens.ends_with(prefix)
            {
                b.add(last, edit::MASK);
            }
        }
        if active.suppress {
            for &id in &self.suppress {
                b.add(id, edit::MASK);
            }
        }
        if active.repetition {
            for &id in prompt_tokens.iter().chain(output_tokens) {
                b.add(id, edit::REPEAT);
            }
        }
        if active.additive {
            // Count first (exact in f32 far past any output length), multiply once: the
            // host's `frequency * count as f32`.
            for &id in output_tokens {
                if let Some(e) = b.add(id, edit::OUTPUT) {
                    e.frequency += 1.0;
                }
            }
        }
        let mut edits = b.finish();
        for e in &mut edits {
            if e.ops & edit::OUTPUT != 0 {
                e.frequency *= self.frequency_penalty;
            }
        }
        Some(Reshape {
            allowed_only: restricted && !complement,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            edits,
        })
    }

    /// The token a backend chose for this request following [`Sampler::device_plan`]. (The
    /// draw is the token's own, by its place in the output: nothing to advance.)
    pub fn accept(&mut self, sample: DeviceSample) -> SampledToken {
        debug_assert!(
            !sample.needs_host,
            "a row handed back is sampled on the host"
        );
        SampledToken {
            token_id: sample.token_id,
            logprob: sample.logprob,
            top: sample.top,
        }
    }
}
