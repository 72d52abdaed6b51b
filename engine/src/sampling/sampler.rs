//! Per-request token sampler: allowed ids, logit bias, the min-tokens mask, repetition /
//! frequency / presence penalties, greedy / temperature, min-p, top-k, top-p, seeded draw, and raw
//! log-probabilities. Owns a request's parameters, RNG and
//! scratch buffers; the arithmetic over a row of logits is `truncation`'s, the plan a
//! backend samples by is `plan`'s.
//!
//! Cost per token for a 151,936-entry vocabulary is a few linear passes.

use std::fmt;
use std::sync::Arc;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::bad_words::mask_bad_words;
use super::params::{GREEDY_TEMPERATURE_EPS, SamplingParams, additive_penalty_in_range};
use super::processors::{apply_output_penalties, apply_repetition_penalty, merge_logit_bias};
use super::structured::{Guide, GuideState};

mod plan;
use super::truncation::{
    Buffers, SMALL_TOP_K, Survivors, Weights, argmax, dense_weights, draw_candidates, draw_weights,
    log_sum_exp, raw_logprob, top_k_sorted, top_p_sorted,
};

/// One token and its raw log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    /// Vocabulary id.
    pub token_id: u32,
    /// `log_softmax` of the raw logits (before penalties and temperature) at this id.
    pub logprob: f32,
}

/// What [`Sampler::sample`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The chosen token.
    pub token_id: u32,
    /// The chosen token's raw log-probability (see [`TokenLogprob::logprob`]).
    pub logprob: f32,
    /// The `K` most likely tokens by raw logit, most likely first, ties by lower id, when
    /// the request asked for `logprobs = Some(K)`; empty otherwise. The chosen token is
    /// not necessarily among them. Tokens with a `-inf` or NaN logit are never listed.
    pub top: Vec<TokenLogprob>,
}

/// Chooses the tokens of one request.
///
/// Processing order (vLLM v1): ids outside `allowed_token_ids` (when given) get `-inf` →
/// `logit_bias` is added → tokens that would complete a bad word get `-inf` → while fewer than `min_tokens` tokens are out, EOS and the stop
/// token ids get `-inf` → repetition penalty (prompt and output) → frequency and presence
/// penalties (output) → greedy argmax when the temperature is below
/// [`GREEDY_TEMPERATURE_EPS`] (ties to the lower id) → temperature → min-p → top-k → top-p →
/// one draw from the renormalised distribution with the request's ChaCha RNG.
/// Reported log-probabilities are always those of the *raw* logits.
///
/// The sampler keeps scratch buffers sized to the vocabulary, so after the first call a
/// step allocates nothing except the returned `top` vector (and nothing at all when
/// logprobs are off). NaN logits are treated as `-inf`.
///
/// Tie-breaking is deterministic where vLLM's batched GPU kernels are not: top-k keeps
/// exactly `k` tokens (equal logits ordered by lower id) and top-p ranks tokens the same
/// way.
pub struct Sampler {
    greedy: bool,
    temperature: f32,
    top_p: f32,
    top_k: u32,
    min_p: f32,
    repetition_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    /// Ids never sampled while fewer than `min_tokens` tokens are out: the stop token ids and,
    /// unless `ignore_eos`, the model's EOS ids.
    suppress: Vec<u32>,
    min_tokens: u32,
    logit_bias: Vec<(u32, f32)>,
    /// Sorted, without repeats; empty allows every id.
    allowed: Vec<u32>,
    /// The structured output's walk, if the request has one.
    guide: Option<GuideState>,
    /// With a guide and `allowed_token_ids`: the guide's ids this step that are also in
    /// `allowed`.
    guided: Vec<u32>,
    bad_words: Vec<Vec<u32>>,
    logprobs: Option<u32>,
    rng: ChaCha8Rng,
    penalty: Penalty,
    /// `edit_slots[id]`: the index of `id`'s edit while [`Sampler::device_plan`] builds a
    /// [`Reshape`]; `u32::MAX` otherwise.
    edit_slots: Vec<u32>,
    /// Which ids the step allows, while a large allowed set is turned into masks of the rest.
    allowed_bits: Vec<bool>,
    bufs: Buffers,
}

/// The penalised copy of the logits, reused from step to step.
#[derive(Default)]
struct Penalty {
    /// Penalised copy of the logits.
    logits: Vec<f32>,
    /// `seen[id] == stamp` marks ids already penalised in this call.
    seen: Vec<u32>,
    stamp: u32,
    /// Occurrences of each id in the output (all zero between calls) and the ids counted.
    counts: Vec<u32>,
    counted: Vec<u32>,
}

impl fmt::Debug for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler")
            .field("greedy", &self.greedy)
            .field("temperature", &self.temperature)
            .field("top_p", &self.top_p)
            .field("top_k", &self.top_k)
            .field("min_p", &self.min_p)
            .field("repetition_penalty", &self.repetition_penalty)
            .field("presence_penalty", &self.presence_penalty)
            .field("frequency_penalty", &self.frequency_penalty)
            .field("min_tokens", &self.min_tokens)
            .field("logprobs", &self.logprobs)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for one request. `seed` is used as given: pass
    /// [`SamplingParams::effective_seed`] so that unseeded requests are still reproducible
    /// for a given engine seed. `eos_token_ids` are the model's (masked until `min_tokens`
    /// unless `ignore_eos`). `params` should have passed [`SamplingParams::validate`];
    /// out-of-range values are neutralised (NaN temperature → greedy, bad `top_p`,
    /// `min_p` or penalty → disabled), never trusted.
    pub fn new(params: &SamplingParams, seed: u64, eos_token_ids: &[u32]) -> Self {
        let penalty = params.repetition_penalty;
        let additive = |p: f32| {
            if additive_penalty_in_range(p) { p } else { 0.0 }
        };
        let mut suppress = params.stop_token_ids.clone();
        if !params.ignore_eos {
            suppress.extend_from_slice(eos_token_ids);
        }
        suppress.sort_unstable();
        suppress.dedup();
        let mut allowed = params.allowed_token_ids.clone();
        allowed.sort_unstable();
        allowed.dedup();
        Self {
            greedy: params.temperature.is_nan() || params.temperature < GREEDY_TEMPERATURE_EPS,
            temperature: params.temperature,
            top_p: if params.top_p > 0.0 && params.top_p < 1.0 {
                params.top_p
            } else {
                1.0
            },
            top_k: params.top_k,
            min_p: if params.min_p > 0.0 {
                params.min_p.min(1.0)
            } else {
                0.0
            },
            repetition_penalty: if penalty > 0.0 && penalty.is_finite() {
                penalty
            } else {
                1.0
            },
            presence_penalty: additive(params.presence_penalty),
            frequency_penalty: additive(params.frequency_penalty),
            suppress,
            min_tokens: params.min_tokens,
            logit_bias: merge_logit_bias(&params.logit_bias),
            allowed,
            guide: None,
            guided: Vec::new(),
            bad_words: params.bad_words_token_ids.clone(),
            logprobs: params.logprobs,
            rng: ChaCha8Rng::seed_from_u64(seed),
            penalty: Penalty::default(),
            edit_slots: Vec::new(),
            allowed_bits: Vec::new(),
            bufs: Buffers::default(),
        }
    }

    /// Constrain the output to `guide` (the request's compiled
    /// [`SamplingParams::structured_output`]): each step allows only the tokens that keep
    /// the text a prefix of a match, and EOS where it is a whole one.
    pub fn with_guide(mut self, guide: Arc<Guide>) -> Self {
        self.guide = Some(GuideState::new(guide));
        self
    }

    /// Whether this sampler decodes greedily (it then never touches its RNG).
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// Chooses the next token from one row of logits, every column a candidate: the same as
    /// [`Sampler::sample_within`] with `vocab_limit = logits.len()`.
    ///
    /// # Panics
    /// If `logits` is empty or longer than `u32::MAX`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> SampledToken {
        self.sample_within(logits, logits.len(), prompt_tokens, output_tokens)
    }

    /// Chooses the next token from the first `vocab_limit` columns of one row of logits (the
    /// ids the tokenizer knows), while log-probabilities are normalized over the whole row
    /// (the model's `vocab_size` outputs, padding rows included), as transformers and vLLM
    /// report them. Listed alternatives are real tokens only.
    ///
    /// `prompt_tokens` and `output_tokens` are the request's tokens so far; they feed the
    /// penalties and the `min_tokens` mask (ids outside the logits are ignored).
    ///
    /// # Panics
    /// If `logits` or its first `vocab_limit` columns are empty, or it is longer than
    /// `u32::MAX`.
    pub fn sample_within(
        &mut self,
        logits: &[f32],
        vocab_limit: usize,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> SampledToken {
        let candidates = &logits[..vocab_limit.min(logits.len())];
        assert!(!candidates.is_empty(), "Sampler::sample: empty logits row");
        assert!(
            u32::try_from(logits.len()).is_ok(),
            "Sampler::sample: vocabulary larger than u32::MAX"
        );
        let token_id = self.choose(candidates, prompt_tokens, output_tokens);
        let lse = log_sum_exp(logits);
        let top = match self.logprobs {
            Some(k) if k > 0 => top_logprobs(candidates, k, lse),
            _ => Vec::new(),
        };
        SampledToken {
            token_id,
            logprob: raw_logprob(logits[token_id as usize], lse),
            top,
        }
    }

    /// Puts the RNG where the draw of output token `output_len` (0-based) begins: each token
    /// has its own two words of the request's ChaCha stream, so the draw depends only on the
    /// seed and the token's place in the output, not on how many draws this sampler made
    /// before. A decode node (which did not sample the first token) and a request resumed on
    /// another node after a failure draw exactly what one uninterrupted sampler would.
    fn seek_draw(&mut self, output_len: usize) {
        // One f64 is one u64: two 32-bit words.
        self.rng.set_word_pos(2 * output_len as u128);
    }

    /// Whether the `min_tokens` mask applies to the token after `output_len` tokens.
    fn suppressing(&self, output_len: usize) -> bool {
        !self.suppress.is_empty() && output_len < self.min_tokens as usize
    }

    /// Which logits processors act on the next step (the host's and the device's paths
    /// decide alike).
    fn active(&self, prompt_tokens: &[u32], output_tokens: &[u32]) -> Active {
        Active {
            repetition: self.repetition_penalty != 1.0
                && !(prompt_tokens.is_empty() && output_tokens.is_empty()),
            additive: (self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
                && !output_tokens.is_empty(),
            suppress: self.suppressing(output_tokens.len()),
            reshaped: !self.allowed.is_empty()
                || self.guide.is_some()
                || !self.logit_bias.is_empty()
                || !self.bad_words.is_empty(),
        }
    }

    /// Whether this step samples among a subset of the ids ([`step_ids`] then lists it),
    /// advancing the guide, if any, over `output_tokens`.
    fn step_allowed(&mut self, output_tokens: &[u32]) -> bool {
        let Some(guide) = &mut self.guide else {
            return !self.allowed.is_empty();
        };
        let ids = guide.allowed(output_tokens);
        if !self.allowed.is_empty() {
            let allowed = &self.allowed;
            self.guided.clear();
            self.guided
                .extend(ids.iter().filter(|id| allowed.binary_search(id).is_ok()));
        }
        true
    }

    fn choose(&mut self, logits: &[f32], prompt_tokens: &[u32], output_tokens: &[u32]) -> u32 {
        let active = self.active(prompt_tokens, output_tokens);
        let work: &[f32] = if active.any() {
            let restricted = self.step_allowed(output_tokens);
            let allowed = step_ids(&self.guide, &self.allowed, &self.guided);
            let pen = &mut self.penalty;
            pen.logits.clear();
            if !restricted {
                pen.logits.extend_from_slice(logits);
            } else {
                pen.logits.resize(logits.len(), f32::NEG_INFINITY);
                for &id in allowed {
                    if let Some(&l) = logits.get(id as usize) {
                        pen.logits[id as usize] = l;
                    }
                }
            }
            for &(id, bias) in &self.logit_bias {
                if let Some(l) = pen.logits.get_mut(id as usize) {
                    *l += bias;
                }
            }
            mask_bad_words(&mut pen.logits, &self.bad_words, output_tokens);
            if active.suppress {
                for &id in &self.suppress {
                    if let Some(l) = pen.logits.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            if active.repetition {
                apply_repetition_penalty(
                    &mut pen.logits,
                    &mut pen.seen,
                    &mut pen.stamp,
                    self.repetition_penalty,
                    prompt_tokens,
                    output_tokens,
                );
            }
            if active.additive {
                apply_output_penalties(
                    &mut pen.logits,
                    &mut pen.counts,
                    &mut pen.counted,
                    self.frequency_penalty,
                    self.presence_penalty,
                    output_tokens,
                );
            }
            &pen.logits
        } else {
            logits
        };
        if self.greedy {
            return argmax(work).0;
        }

        let (max_id, lmax) = argmax(work);
        if !(lmax > f32::NEG_INFINITY && lmax < f32::INFINITY) {
            // Degenerate row: all -inf / NaN, or an infinite logit dominating.
            return max_id;
        }
        // min-p keeps p >= min_p * p_max  <=>  (l - lmax) / t >= ln(min_p).
        let threshold = if self.min_p > 0.0 {
            lmax + self.temperature * self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        let w = Weights {
            lmax,
            inv_t: 1.0 / self.temperature,
            threshold,
        };
        // See `seek_draw` (a field borrow here: `work` may borrow the penalty buffers).
        self.rng.set_word_pos(2 * output_tokens.len() as u128);
        let rng = &mut self.rng;
        let k = self.top_k as usize;

        if k > 0 && k <= SMALL_TOP_K {
            // At most k candidates, already sorted: everything after this is tiny.
            let cand = &mut self.bufs.candidates;
            top_k_sorted(work, k, threshold, cand);
            if self.top_p < 1.0 {
                top_p_sorted(work, cand, self.top_p, w);
            }
            return draw_candidates(work, cand, w, rng.random::<f64>()).unwrap_or(max_id);
        }
        match dense_weights(work, w, k, self.top_p, &mut self.bufs) {
            Survivors::Dense => draw_weights(&self.bufs.dense, rng.random::<f64>()),
            Survivors::Candidates => {
                draw_candidates(work, &self.bufs.candidates, w, rng.random::<f64>())
            }
        }
        .unwrap_or(max_id)
    }
}

/// The ids a step may choose among once [`Sampler::step_allowed`] said there is a subset:
/// the guide's, narrowed to `allowed` (`guided`) when there are both, else whichever there
/// is. A function of the fields, not a method, so the caller may write other fields while
/// it reads the list.
fn step_ids<'a>(guide: &'a Option<GuideState>, allowed: &'a [u32], guided: &'a [u32]) -> &'a [u32] {
    match guide {
        Some(g) if allowed.is_empty() => g.ids(),
        Some(_) => guided,
        None => allowed,
    }
}

/// How many of `ids` (each once) are real tokens, below `vocab_limit`.
fn allowed_within(ids: &[u32], vocab_limit: usize) -> usize {
    ids.iter()
        .filter(|&&id| (id as usize) < vocab_limit)
        .count()
}

/// The logits processors that act on one step.
struct Active {
    /// The repetition penalty (prompt and output ids).
    repetition: bool,
    /// The presence and frequency penalties (output ids).
    additive: bool,
    /// The `min_tokens` mask on EOS and the stop token ids.
    suppress: bool,
    /// Allowed ids, logit bias or bad words.
    reshaped: bool,
}

impl Active {
    fn any(&self) -> bool {
        self.repetition || self.additive || self.suppress || self.reshaped
    }
}

/// The `k` best ids by raw logit (descending, ties by lower id) with their logprobs.
pub(super) fn top_logprobs(logits: &[f32], k: u32, lse: f64) -> Vec<TokenLogprob> {
    let mut ids = Vec::with_capacity((k as usize).min(logits.len()));
    top_k_sorted(logits, k as usize, f32::NEG_INFINITY, &mut ids);
    ids.into_iter()
        .map(|id| TokenLogprob {
            token_id: id,
            logprob: raw_logprob(logits[id as usize], lse),
        })
        .collect()
}

#[cfg(test)]
mod tests;
