//! Stop conditions and stop-string hold-back for streamed output text.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::params::SamplingParams;

/// Why a request finished (the OpenAI / vLLM `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` (or the model's context length) reached.
    Length,
    /// Cancelled by the client or the engine.
    Abort,
}

impl FinishReason {
    /// `"stop"`, `"length"` or `"abort"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What exactly triggered [`FinishReason::Stop`] (vLLM's `stop_reason`). EOS has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// One of the request's `stop_token_ids`.
    TokenId(u32),
    /// One of the request's `stop` strings.
    Text(String),
}

/// The outcome of feeding one token to a [`StopChecker`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopDecision {
    /// Text that may be streamed to the client now (possibly empty).
    pub text: String,
    /// `Some` once the request is finished; every later call repeats it.
    pub finished: Option<FinishReason>,
    /// Set with `finished == Some(Stop)` for a stop token id or a stop string.
    pub stop_reason: Option<StopReason>,
}

/// Decides when a request stops and which part of its text can be streamed.
///
/// Feed every generated token with the text the incremental detokenizer produced for it.
/// Rules (vLLM v1):
/// - EOS (any of `eos_token_ids`, unless `ignore_eos`) or a `stop_token_ids` entry →
///   [`FinishReason::Stop`]. The token stays in the output ids but its text is dropped,
///   unless `include_stop_str_in_output` (vLLM renders it then).
/// - A stop string appearing in the text → [`FinishReason::Stop`]; the output is cut just
///   before it (or just after it with `include_stop_str_in_output`) and nothing after it
///   is ever emitted. When several stop strings match, the one starting first wins (then
///   the shortest), so the emitted text never contains a stop string.
/// - Otherwise, the `max_tokens`-th token → [`FinishReason::Length`]. A stop token or
///   stop string on that same token still reports `Stop`.
/// - The first `min_tokens` tokens never stop the request: a stop token among them (the
///   sampler masks them, so only a token chosen elsewhere can be one) is kept as text, and
///   stop strings are looked for only from the token after them on (one that begins
///   earlier and ends there still counts), as vLLM does.
///
/// While running, the longest suffix of the text that is a proper prefix of a stop string
/// is held back (not when `include_stop_str_in_output`, where no cut can remove already
/// streamed text). On finish, held-back text that is not part of a stop string is flushed.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    eos_token_ids: Vec<u32>,
    ignore_eos: bool,
    include_stop_str: bool,
    max_tokens: u32,
    min_tokens: u32,
    num_tokens: u32,
    /// All accepted output text (cut at the stop string once one matched).
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    finished: Option<FinishReason>,
    stop_reason: Option<StopReason>,
}

impl StopChecker {
    /// A checker for one request. `eos_token_ids` are the model's end-of-sequence ids
    /// (Qwen3: `<|im_end|>` and `<|endoftext|>`). Empty stop strings are ignored.
    pub fn new(params: &SamplingParams, eos_token_ids: Vec<u32>) -> Self {
        Self {
            stop: params
                .stop
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            stop_token_ids: params.stop_token_ids.clone(),
            eos_token_ids,
            ignore_eos: params.ignore_eos,
            include_stop_str: params.include_stop_str_in_output,
            max_tokens: params.max_tokens,
            min_tokens: params.min_tokens,
            num_tokens: 0,
            text: String::new(),
            emitted: 0,
            finished: None,
            stop_reason: None,
        }
    }

    /// Feeds one generated token and the text it added. After the request finished, returns
    /// no text and the same finish reason again.
    pub fn on_token(&mut self, token_id: u32, new_text: &str) -> StopDecision {
        if self.finished.is_some() {
            return self.decision(String::new());
        }
        self.num_tokens = self.num_tokens.saturating_add(1);
        let may_stop = self.num_tokens > self.min_tokens;

        let token_stop = if !may_stop {
            None
        } else if !self.ignore_eos && self.eos_token_ids.contains(&token_id) {
            Some(None)
        } else if self.stop_token_ids.contains(&token_id) {
            Some(Some(StopReason::TokenId(token_id)))
        } else {
            None
        };

        if token_stop.is_none() || self.include_stop_str {
            let before = self.text.len();
            self.text.push_str(new_text);
            if let Some((start, end, index)) = self.find_stop_string(before).filter(|_| may_stop) {
                let cut = if self.include_stop_str { end } else { start };
                // Text already handed out (only possible after `flush`) cannot be taken back.
                self.text.truncate(cut.max(self.emitted));
                let reason = StopReason::Text(self.stop[index].clone());
                return self.finish(FinishReason::Stop, Some(reason));
            }
        }
        if let Some(reason) = token_stop {
            return self.finish(FinishReason::Stop, reason);
        }
        if self.num_tokens >= self.max_tokens {
            return self.finish(FinishReason::Length, None);
        }

        let upto = self.text.len() - self.hold_back_len();
        let text = self.text[self.emitted..upto].to_owned();
        self.emitted = upto;
        self.decision(text)
    }

    /// Hands out the held-back text (for a request that ends for another reason, e.g. an
    /// abort or the context length). Does not change the finish state.
    pub fn flush(&mut self) -> String {
        let text = self.text[self.emitted..].to_owned();
        self.emitted = self.text.len();
        text
    }

    /// Ends the request for a reason decided outside the checker (an abort, the model's
    /// context length): flushes and records `reason`. No-op if already finished.
    pub fn force_finish(&mut self, reason: FinishReason) -> StopDecision {
        if self.finished.is_some() {
            return self.decision(String::new());
        }
        self.finish(reason, None)
    }

    /// The finish reason, once finished.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finished
    }

    /// What triggered [`FinishReason::Stop`], when it was a stop token id or string.
    pub fn stop_reason(&self) -> Option<&StopReason> {
        self.stop_reason.as_ref()
    }

    /// Tokens fed so far (stop tokens included).
    pub fn num_tokens(&self) -> u32 {
        self.num_tokens
    }

    /// All text handed out so far; the final output text once finished.
    pub fn output_text(&self) -> &str {
        &self.text[..self.emitted]
    }

    /// Text currently held back because it may start a stop string.
    pub fn held_back(&self) -> &str {
        &self.text[self.emitted..]
    }

    fn finish(&mut self, reason: FinishReason, stop_reason: Option<StopReason>) -> StopDecision {
        self.finished = Some(reason);
        self.stop_reason = stop_reason;
        let text = self.flush();
        self.decision(text)
    }

    fn decision(&self, text: String) -> StopDecision {
        StopDecision {
            text,
            finished: self.finished,
            stop_reason: self.stop_reason.clone(),
        }
    }

    /// The earliest stop-string occurrence that ends after byte `before` (the text before it
    /// was already checked): `(start, end, index into stop)`. Ties go to the shorter string.
    fn find_stop_string(&self, before: usize) -> Option<(usize, usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None;
        for (index, s) in self.stop.iter().enumerate() {
            let mut from = before.saturating_sub(s.len() - 1);
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            if let Some(pos) = self.text[from..].find(s.as_str()) {
                let (start, end) = (from + pos, from + pos + s.len());
                if best.is_none_or(|(bs, be, _)| start < bs || (start == bs && end < be)) {
                    best = Some((start, end, index));
                }
            }
        }
        best
    }

    /// Length in bytes of the longest suffix of the unemitted text that is a proper prefix
    /// of some stop string. Always lands on a char boundary: a stop string starts with one.
    fn hold_back_len(&self) -> usize {
        if self.include_stop_str {
            return 0;
        }
        let pending = &self.text.as_bytes()[self.emitted..];
        let mut hold = 0;
        for s in &self.stop {
            let s = s.as_bytes();
            let longest = (s.len() - 1).min(pending.len());
            if let Some(k) = (hold + 1..=longest)
                .rev()
                .find(|&k| pending.ends_with(&s[..k]))
            {
                hold = k;
            }
        }
        hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(stop: &[&str]) -> StopChecker {
        let params = SamplingParams {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            max_tokens: 100,
            ..Default::default()
        };
        StopChecker::new(&params, vec![0])
    }

    #[test]
    fn finish_reason_strings() {
        assert_eq!(FinishReason::Stop.to_string(), "stop");
        assert_eq!(FinishReason::Length.as_str(), "length");
        assert_eq!(FinishReason::Abort.to_string(), "abort");
    }

    #[test]
    fn hold_back_is_longest_partial_prefix() {
        let mut c = checker(&["abc", "bcd"]);
        assert_eq!(c.on_token(1, "xxab").text, "xx");
        assert_eq!(c.held_back(), "ab");
        assert_eq!(c.on_token(1, "x").text, "abx");
        assert_eq!(c.on_token(1, "bc").text, "");
        assert_eq!(c.held_back(), "bc");
    }

    #[test]
    fn multibyte_hold_back_stays_on_char_boundaries() {
        let mut c = checker(&["日本語"]);
        assert_eq!(c.on_token(1, "é日").text, "é");
        assert_eq!(c.on_token(1, "本").text, "");
        let d = c.on_token(1, "語!");
        assert_eq!(d.text, "");
        assert_eq!(c.output_text(), "é");
        assert_eq!(d.finished, Some(FinishReason::Stop));
    }

    #[test]
    fn earliest_stop_string_wins() {
        let mut c = checker(&["b", "a"]);
        let d = c.on_token(1, "xab");
        assert_eq!(d.text, "x");
        assert_eq!(d.stop_reason, Some(StopReason::Text("a".into())));
    }

    #[test]
    fn force_finish_flushes() {
        let mut c = checker(&["abc"]);
        assert_eq!(c.on_token(1, "xa").text, "x");
        let d = c.force_finish(FinishReason::Abort);
        assert_eq!(d.text, "a");
        assert_eq!(d.finished, Some(FinishReason::Abort));
        assert_eq!(c.on_token(1, "bc").finished, Some(FinishReason::Abort));
        assert_eq!(c.output_text(), "xa");
    }
}
