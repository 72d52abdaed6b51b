//! Per-request sampling parameters and their validation.

use serde::{Deserialize, Serialize};

/// At most this many stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

/// Upper bound for `logprobs` and `prompt_logprobs` (top-K alternatives per position).
pub const MAX_LOGPROBS: u32 = 20;

/// At most this many `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Largest magnitude of a `logit_bias` value (OpenAI's range).
pub const MAX_ABS_LOGIT_BIAS: f32 = 100.0;

/// Largest magnitude of `presence_penalty` and `frequency_penalty` (OpenAI's and vLLM's
/// range).
pub const MAX_ABS_PENALTY: f32 = 2.0;

/// Whether a presence or frequency penalty is within `[-2, 2]` (NaN is not).
pub(crate) fn additive_penalty_in_range(p: f32) -> bool {
    (-MAX_ABS_PENALTY..=MAX_ABS_PENALTY).contains(&p)
}

/// Temperatures below this are treated as greedy decoding (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

/// How one request wants its tokens chosen and when it wants to stop.
///
/// Field semantics follow vLLM's `SamplingParams`. Missing fields deserialize to the
/// [`Default`] values (greedy, 16 tokens, no stop conditions besides EOS).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature. `0` (or anything below [`GREEDY_TEMPERATURE_EPS`]) means greedy.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches
    /// `top_p`. In `(0, 1]`; `1` disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens. `0` disables it.
    pub top_k: u32,
    /// Drop tokens whose probability is below `min_p` × the most likely token's
    /// probability. In `[0, 1]`; `0` disables it.
    pub min_p: f32,
    /// Penalty for tokens already present in the prompt or the output: positive logits
    /// are divided by it, negative ones multiplied. `> 0`; `1` disables it.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already in the output (not the
    /// prompt): positive values favour new tokens. In `[-2, 2]`; `0` disables it.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token in the output as many times as it occurs
    /// there: positive values discourage repeats. In `[-2, 2]`; `0` disables it.
    pub frequency_penalty: f32,
    /// Added to the logits of these ids before penalties and sampling (OpenAI's
    /// `logit_bias`): ids in the vocabulary, values in `[-100, 100]`, at most
    /// [`MAX_LOGIT_BIAS`] entries (an id listed twice gets the sum, added once).
    pub logit_bias: Vec<(u32, f32)>,
    /// Sample only among these ids (vLLM's `allowed_token_ids`); empty allows every id.
    pub allowed_token_ids: Vec<u32>,
    /// vLLM's `bad_words` as token sequences ([`super::bad_words_token_ids`]): the last token
    /// of each is never sampled right after the rest of it (a single token never). At most
    /// [`super::MAX_BAD_WORDS`], each 1 to [`super::MAX_BAD_WORD_TOKENS`] ids of the
    /// vocabulary.
    pub bad_words_token_ids: Vec<Vec<u32>>,
    /// Per-request RNG seed. `None`: the engine derives one (see
    /// [`SamplingParams::effective_seed`]).
    pub seed: Option<u64>,
    /// Maximum number of generated tokens (stop tokens included). `>= 1`.
    pub max_tokens: u32,
    /// Generate at least this many tokens before EOS, a stop token id or a stop string may
    /// end the request: until then those ids are never sampled and stop strings are not
    /// looked for. `<= max_tokens`; `0` disables it.
    pub min_tokens: u32,
    /// Stop strings: generation stops when one appears in the output text.
    pub stop: Vec<String>,
    /// Token ids that stop generation (the token is kept in the output ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS token(s).
    pub ignore_eos: bool,
    /// Return this many top alternatives (raw log-probabilities) per generated token.
    pub logprobs: Option<u32>,
    /// Return this many top alternatives per prompt position.
    pub prompt_logprobs: Option<u32>,
    /// Keep the matched stop string (or the stop token's text) in the output text.
    pub include_stop_str_in_output: bool,
    /// Leave special tokens (`<|im_end|>`, `<|im_start|>`, …) out of the output text, as vLLM
    /// does by default; their ids are in the output ids either way. False writes them into
    /// the text, except the stop token that ends it (as `include_stop_str_in_output` says).
    pub skip_special_tokens: bool,
    /// The output must match a regex, be one of a list of strings, or be JSON a schema
    /// accepts (vLLM's `structured_outputs`); EOS is then allowed exactly where the text is
    /// a whole match. Cannot be combined with `ignore_eos` or `min_tokens`.
    pub structured_output: Option<super::StructuredOutput>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            allowed_token_ids: Vec::new(),
            bad_words_token_ids: Vec::new(),
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            structured_output: None,
        }
    }
}

/// Why a [`SamplingParams`] was rejected. One variant per rule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `temperature` is negative, NaN or infinite.
    #[error("temperature must be a finite number >= 0, got {0}")]
    InvalidTemperature(f32),
    /// `top_p` is outside `(0, 1]` or NaN.
    #[error("top_p must be in (0, 1], got {0}")]
    InvalidTopP(f32),
    /// `min_p` is outside `[0, 1]` or NaN.
    #[error("min_p must be in [0, 1], got {0}")]
    InvalidMinP(f32),
    /// `repetition_penalty` is not a finite number `> 0`.
    #[error("repetition_penalty must be a finite number > 0 (1 disables it), got {0}")]
    InvalidRepetitionPenalty(f32),
    /// `presence_penalty` is outside `[-2, 2]` or NaN.
    #[error("presence_penalty must be in [-2, 2] (0 disables it), got {0}")]
    InvalidPresencePenalty(f32),
    /// `frequency_penalty` is outside `[-2, 2]` or NaN.
    #[error("frequency_penalty must be in [-2, 2] (0 disables it), got {0}")]
    InvalidFrequencyPenalty(f32),
    /// `min_tokens` is larger than `max_tokens`.
    #[error("min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")]
    MinTokensAboveMaxTokens {
        /// The requested minimum.
        min_tokens: u32,
        /// The request's `max_tokens`.
        max_tokens: u32,
    },
    /// `max_tokens` is zero.
    #[error("max_tokens must be >= 1, got 0")]
    ZeroMaxTokens,
    /// `max_tokens` exceeds the engine's cap.
    #[error("max_tokens must be <= {cap}, got {max_tokens}")]
    MaxTokensTooLarge {
        /// The requested value.
        max_tokens: u32,
        /// The engine's limit.
        cap: u32,
    },
    /// More than [`MAX_STOP_STRINGS`] stop strings.
    #[error("at most {max} stop strings are allowed, got {0}", max = MAX_STOP_STRINGS)]
    TooManyStopStrings(usize),
    /// A stop string is empty.
    #[error("stop strings must be non-empty, but stop[{index}] is \"\"")]
    EmptyStopString {
        /// Position in `stop`.
        index: usize,
    },
    /// A stop token id is not in the vocabulary.
    #[error(
        "stop_token_ids[{index}] = {token_id} is out of range: the vocabulary has \
         {vocab_size} tokens (ids 0..{vocab_size})"
    )]
    StopTokenIdOutOfRange {
        /// Position in `stop_token_ids`.
        index: usize,
        /// The offending id.
        token_id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// `logprobs` above [`MAX_LOGPROBS`].
    #[error("logprobs must be <= {max}, got {0}", max = MAX_LOGPROBS)]
    TooManyLogprobs(u32),
    /// `prompt_logprobs` above [`MAX_LOGPROBS`].
    #[error("prompt_logprobs must be <= {max}, got {0}", max = MAX_LOGPROBS)]
    TooManyPromptLogprobs(u32),
    /// More than [`MAX_LOGIT_BIAS`] `logit_bias` entries.
    #[error("logit_bias may hold at most {max} entries, got {0}", max = MAX_LOGIT_BIAS)]
    TooManyLogitBiases(usize),
    /// A `logit_bias` id outside the vocabulary.
    #[error(
        "logit_bias names token {token_id}, out of range: the vocabulary has {vocab_size} \
         tokens (ids 0..{vocab_size})"
    )]
    LogitBiasIdOutOfRange {
        /// The offending id.
        token_id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A `logit_bias` value outside `[-100, 100]` or NaN.
    #[error("logit_bias[{token_id}] must be in [-100, 100], got {value}")]
    InvalidLogitBias {
        /// The id it is for.
        token_id: u32,
        /// The offending value.
        value: f32,
    },
    /// More than [`super::MAX_BAD_WORDS`] bad words.
    #[error("at most {max} bad words are allowed, got {0}", max = super::MAX_BAD_WORDS)]
    TooManyBadWords(usize),
    /// A bad word's token sequence is empty, too long or outside the vocabulary.
    #[error(
        "bad word {index} must be 1 to {max} token ids of the vocabulary (ids 0..{vocab_size}), \
         got {ids:?}",
        max = super::MAX_BAD_WORD_TOKENS
    )]
    InvalidBadWord {
        /// Position in `bad_words_token_ids`.
        index: usize,
        /// Its ids (cut to the first few).
        ids: Vec<u32>,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// An `allowed_token_ids` entry outside the vocabulary.
    #[error(
        "allowed_token_ids[{index}] = {token_id} is out of range: the vocabulary has \
         {vocab_size} tokens (ids 0..{vocab_size})"
    )]
    AllowedTokenIdOutOfRange {
        /// Position in `allowed_token_ids`.
        index: usize,
        /// The offending id.
        token_id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// The structured output cannot be used (see [`super::StructuredError`]).
    #[error(transparent)]
    Structured(#[from] super::StructuredError),
    /// A structured output with `ignore_eos` or `min_tokens`, which would move where it
    /// ends.
    #[error("a structured output decides where the output ends: it cannot be combined with {0}")]
    StructuredWith(&'static str),
}

impl SamplingParams {
    /// Whether this request decodes greedily (argmax after the penalties).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE_EPS
    }

    /// The seed to construct the request's [`Sampler`](super::Sampler) with: the request's
    /// own `seed`, else `fallback` (which the engine should derive from its own seed and
    /// something stable per request, so unseeded requests are reproducible per engine seed).
    pub fn effective_seed(&self, fallback: u64) -> u64 {
        self.seed.unwrap_or(fallback)
    }

    /// Checks every rule; the first violation is returned. NaN fails every float rule.
    pub fn validate(&self, vocab_size: usize, max_tokens_cap: u32) -> Result<(), SamplingError> {
        // Written as `!(ok)` so that NaN (for which every comparison is false) fails.
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SamplingError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplingError::InvalidMinP(self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(SamplingError::InvalidRepetitionPenalty(
                self.repetition_penalty,
            ));
        }
        if !additive_penalty_in_range(self.presence_penalty) {
            return Err(SamplingError::InvalidPresencePenalty(self.presence_penalty));
        }
        if !additive_penalty_in_range(self.frequency_penalty) {
            return Err(SamplingError::InvalidFrequencyPenalty(
                self.frequency_penalty,
            ));
        }
        if self.max_tokens == 0 {
            return Err(SamplingError::ZeroMaxTokens);
        }
        if self.max_tokens > max_tokens_cap {
            return Err(SamplingError::MaxTokensTooLarge {
                max_tokens: self.max_tokens,
                cap: max_tokens_cap,
            });
        }
        if self.min_tokens > self.max_tokens {
            return Err(SamplingError::MinTokensAboveMaxTokens {
                min_tokens: self.min_tokens,
                max_tokens: self.max_tokens,
            });
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(SamplingError::TooManyStopStrings(self.stop.len()));
        }
        if let Some(index) = self.stop.iter().position(String::is_empty) {
            return Err(SamplingError::EmptyStopString { index });
        }
        if let Some((index, &token_id)) = self
            .stop_token_ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab_size)
        {
            return Err(SamplingError::StopTokenIdOutOfRange {
                index,
                token_id,
                vocab_size,
            });
        }
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_LOGPROBS) {
            return Err(SamplingError::TooManyLogprobs(k));
        }
        if let Some(k) = self.prompt_logprobs.filter(|&k| k > MAX_LOGPROBS) {
            return Err(SamplingError::TooManyPromptLogprobs(k));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(SamplingError::TooManyLogitBiases(self.logit_bias.len()));
        }
        for &(token_id, value) in &self.logit_bias {
            if token_id as usize >= vocab_size {
                return Err(SamplingError::LogitBiasIdOutOfRange {
                    token_id,
                    vocab_size,
                });
            }
            if !(-MAX_ABS_LOGIT_BIAS..=MAX_ABS_LOGIT_BIAS).contains(&value) {
                return Err(SamplingError::InvalidLogitBias { token_id, value });
            }
        }
        if self.bad_words_token_ids.len() > super::MAX_BAD_WORDS {
            return Err(SamplingError::TooManyBadWords(
                self.bad_words_token_ids.len(),
            ));
        }
        if let Some((index, ids)) = self
            .bad_words_token_ids
            .iter()
            .enumerate()
            .find(|(_, ids)| {
                ids.is_empty()
                    || ids.len() > super::MAX_BAD_WORD_TOKENS
                    || ids.iter().any(|&id| id as usize >= vocab_size)
            })
        {
            return Err(SamplingError::InvalidBadWord {
                index,
                ids: ids.iter().copied().take(8).collect(),
                vocab_size,
            });
        }
        if let Some((index, &token_id)) = self
            .allowed_token_ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab_size)
        {
            return Err(SamplingError::AllowedTokenIdOutOfRange {
                index,
                token_id,
                vocab_size,
            });
        }
        if let Some(spec) = &self.structured_output {
            if self.ignore_eos {
                return Err(SamplingError::StructuredWith("ignore_eos"));
            }
            if self.min_tokens > 0 {
                return Err(SamplingError::StructuredWith("min_tokens"));
            }
            spec.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_greedy() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert_eq!(p.max_tokens, 16);
        assert_eq!(p.validate(10, 100), Ok(()));
    }

    #[test]
    fn messages_are_actionable() {
        let p = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert_eq!(
            p.validate(10, 100).unwrap_err().to_string(),
            "temperature must be a finite number >= 0, got -1"
        );
        let p = SamplingParams {
            stop_token_ids: vec![3, 10],
            ..Default::default()
        };
        assert_eq!(
            p.validate(10, 100).unwrap_err().to_string(),
            "stop_token_ids[1] = 10 is out of range: the vocabulary has 10 tokens (ids 0..10)"
        );
        let p = SamplingParams {
            stop: vec![String::new(); 17],
            ..Default::default()
        };
        assert_eq!(
            p.validate(10, 100).unwrap_err().to_string(),
            "at most 16 stop strings are allowed, got 17"
        );
    }

    #[test]
    fn effective_seed_prefers_request_seed() {
        let mut p = SamplingParams::default();
        assert_eq!(p.effective_seed(7), 7);
        p.seed = Some(3);
        assert_eq!(p.effective_seed(7), 3);
    }
}
