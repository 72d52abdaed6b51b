//! Token sampling and stop conditions, with vLLM semantics.
//!
//! - [`SamplingParams`]: what a request asks for; [`SamplingParams::validate`] rejects bad
//!   values with a [`SamplingError`] a person can act on.
//! - [`Sampler`]: one per request, owns a seeded ChaCha RNG and scratch buffers; turns a
//!   row of logits into a [`SampledToken`] (repetition penalty → greedy or temperature →
//!   min-p → top-k → top-p → draw), reporting raw log-probabilities.
//! - [`prompt`]: prompt log-probabilities ([`prompt_logprobs`], and the rows a backend
//!   scores where the logits are).
//! - [`device`]: the sampler as a backend runs it where the logits are (greedy, top-k then
//!   min-p / top-p, the dense path, top log-probabilities, with the penalties, bias and masks
//!   as per-id edits), with the same tokens for the same seeds ([`Sampler::device_plan`] /
//!   [`Sampler::accept`]).
//! - `processors`: the penalties', bias's and edits' arithmetic both of those paths share.
//! - [`StopChecker`]: one per request, fed each generated token and its text; decides
//!   [`FinishReason`] (EOS / stop token / stop string / `max_tokens`) and withholds text
//!   that may be the start of a stop string until it is disambiguated.
//!
//! Typical step for one request:
//!
//! ```ignore
//! let mut sampler = Sampler::new(&params, params.effective_seed(engine_seed ^ request_hash));
//! let mut stop = StopChecker::new(&params, eos_token_ids);
//! loop {
//!     let tok = sampler.sample(&logits, &prompt, &output);
//!     output.push(tok.token_id);
//!     let d = stop.on_token(tok.token_id, &detokenizer.step(tok.token_id));
//!     stream(d.text);
//!     if let Some(reason) = d.finished { break; }
//! }
//! ```

pub mod bad_words;
pub mod device;
pub mod params;
mod processors;
pub mod prompt;
pub mod sampler;
pub mod stop;
pub mod structured;
mod truncation;

pub use bad_words::{MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, bad_words_token_ids};
pub use device::{
    DeviceSample, DeviceSampleRow, DeviceSampling, MAX_DEVICE_TOP_K, Reshape, SamplePlan, TokenEdit,
};
pub use params::{
    GREEDY_TEMPERATURE_EPS, MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_LOGIT_BIAS, MAX_LOGPROBS,
    MAX_STOP_STRINGS, SamplingError, SamplingParams,
};
pub use prompt::{PromptLogprob, PromptLogprobRow, prompt_logprobs, prompt_logprobs_within};
pub use sampler::{SampledToken, Sampler, TokenLogprob};
pub use stop::{FinishReason, StopChecker, StopDecision, StopReason};
pub use structured::{Guide, GuideCache, GuideVocabulary, StructuredError, StructuredOutput};
