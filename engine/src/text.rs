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
            decoder: tokenizer.incremental_decoder(true),
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
