//! Prompt log-probabilities (`prompt_logprobs = K`): how likely the model found each prompt
//! token given the tokens before it, with the `K` most likely alternatives. [`prompt_logprobs`]
//! is the definition; a backend computes the same where the logits are
//! ([`crate::backend::Backend::prompt_logprobs`], one [`PromptLogprobRow`] per position), so
//! a scored prompt chunk copies a few words per position to the host rather than a row of
//! vocabulary size. Which positions a request scores is the engine's business, not this
//! module's.

use super::sampler::{TokenLogprob, top_logprobs};
use super::truncation::{log_sum_exp, raw_logprob};

/// The log-probability of one prompt token given the prompt before it, see
/// [`prompt_logprobs`].
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    /// The actual next prompt token.
    pub token_id: u32,
    /// Its raw log-probability (`-inf` if the id is outside the scored columns).
    pub logprob: f32,
    /// The `K` most likely tokens, as in [`super::SampledToken::top`].
    pub top: Vec<TokenLogprob>,
}

/// One logits row a backend scores: the row computed at a prompt position, the prompt token
/// that follows it, and how many alternatives to list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLogprobRow {
    /// Row of the step's logits.
    pub row: usize,
    /// The prompt token at the next position.
    pub next_token: u32,
    /// Alternatives to list (`prompt_logprobs = K`; at most [`super::MAX_LOGPROBS`]).
    pub top: u32,
}

/// Log-probability of the actual next prompt token plus the `k` most likely alternatives,
/// from the logits row computed at the position before it (raw logits, no penalties or
/// temperature), every column a token: [`prompt_logprobs_within`] with the whole row.
pub fn prompt_logprobs(logits: &[f32], next_token: u32, k: u32) -> PromptLogprob {
    prompt_logprobs_within(logits, logits.len(), next_token, k)
}

/// [`prompt_logprobs`] of a row whose first `vocab_limit` columns are the tokenizer's ids:
/// normalized over the whole row (the model's `vocab_size` outputs), as transformers and
/// vLLM compute them and as [`super::Sampler::sample_within`] does for sampled tokens, with
/// alternatives listed among the real tokens only. The first prompt token has no logprob;
/// callers skip it.
pub fn prompt_logprobs_within(
    logits: &[f32],
    vocab_limit: usize,
    next_token: u32,
    k: u32,
) -> PromptLogprob {
    let candidates = &logits[..vocab_limit.min(logits.len())];
    let lse = log_sum_exp(logits);
    let logprob = candidates
        .get(next_token as usize)
        .map_or(f32::NEG_INFINITY, |&l| raw_logprob(l, lse));
    let top = if k > 0 {
        top_logprobs(candidates, k, lse)
    } else {
        Vec::new()
    };
    PromptLogprob {
        token_id: next_token,
        logprob,
        top,
    }
}
