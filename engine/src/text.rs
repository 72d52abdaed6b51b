//! The text side of a request's token stream: incremental detokenization and stop strings.
//! Nodes see token ids only; whoever owns text (the router, `pdctl run`) runs this over the
//! engine's tokens, and aborts the engine request when a stop string ends it early.

use crate::sampling::{SamplingParams, StopChecker, StopDecision, StopReason};
use crate::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};

pub struct TextStream<'t> {
    decoder: IncrementalDecoder<'t>,
    stop: StopChecker,
}

impl std::fmt::Debug for TextStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextStream").finish_non_exhaustive()
    }
}

impl<'t> TextStream<'t> {
    /// `eos_token_ids` as the engine applies them, so both sides agree on where text ends.
    pub fn new(tokenizer: &'t Tokenizer, params: &SamplingParams, eos_token_ids: Vec<u32>) -> Self {
        Self {
            decoder: tokenizer.incremental_decoder(params.skip_special_tokens),
            stop: StopChecker::new(params, eos_token_ids),
        }
    }

    /// Feed the next generated token; the decision says what text to emit now and whether
    /// the request is finished (a stop string may end it before the engine would).
    pub fn push(&mut self, token: u32) -> Result<StopDecision, TokenizerError> {
        let piece = self.decoder.push(token)?;
        Ok(self.stop.on_token(token, &piece))
    }

    /// Text held back (a possible stop-string prefix) when the stream ends otherwise.
    pub fn flush(&mut self) -> String {
        self.stop.flush()
    }

    /// The whole text emitted so far.
    pub fn text(&self) -> &str {
        self.stop.output_text()
    }

    /// Which stop token id or stop string ended the stream, once one did.
    pub fn stop_reason(&self) -> Option<&StopReason> {
        self.stop.stop_reason()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of `ids` as a stream with these options writes it.
    fn text(ids: &[u32], skip_special_tokens: bool, include_stop_str_in_output: bool) -> String {
        let tokenizer = Tokenizer::qwen3().unwrap();
        let eos = tokenizer.eos_token_id().unwrap();
        let params = SamplingParams {
            skip_special_tokens,
            include_stop_str_in_output,
            ..SamplingParams::default()
        };
        let mut stream = TextStream::new(&tokenizer, &params, vec![eos]);
        for &id in ids {
            stream.push(id).unwrap();
        }
        stream.flush();
        stream.text().to_string()
    }

    #[test]
    fn special_tokens_are_written_only_when_asked_and_never_the_stop_token() {
        let tokenizer = Tokenizer::qwen3().unwrap();
        let mut ids = tokenizer.encode("Hi<|im_start|>there").unwrap();
        let start = tokenizer.token_id("<|im_start|>").unwrap();
        assert!(ids.contains(&start), "{ids:?}");
        ids.push(tokenizer.eos_token_id().unwrap());
        assert_eq!(text(&ids, true, false), "Hithere");
        assert_eq!(text(&ids, false, false), "Hi<|im_start|>there");
        // The stop token's own text only with include_stop_str_in_output, as vLLM writes it.
        assert_eq!(text(&ids, false, true), "Hi<|im_start|>there<|im_end|>");
        assert_eq!(text(&ids, true, true), "Hithere");
    }
}
