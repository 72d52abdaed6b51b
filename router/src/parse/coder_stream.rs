//! The part of [`AnswerParser`] that moves through a Qwen3-Coder `<tool_call>` block
//! (`--tool-call-parser qwen3_coder`): finding its function and parameters in the held text as
//! it streams. Not here: the values' conversion ([`super::coder`]) and the rest of the answer.

use super::coder::{self, FUNCTION_END, FUNCTION_START, PARAMETER_END, PARAMETER_START};
use super::{AnswerParser, CALL_END, CoderPart, Mode, Parsed, ToolCall, first_tag, tail_start};

/// The longest of the tags a Qwen3-Coder block is read by.
const CODER_TAG_MAX: usize = CALL_END.len();

impl AnswerParser {
    /// Moves as far as the pending text allows inside a Qwen3-Coder `<tool_call>` block.
    /// Everything is decided by whole tags found in the held text, so nothing waits on a
    /// tag's start.
    pub(super) fn step_coder(&mut self, part: CoderPart, out: &mut Parsed) {
        let find = |tag: &str, from: usize| self.pending[from..].find(tag).map(|at| at + from);
        match part {
            CoderPart::Block {
                called,
                scanned,
                head,
            } => {
                // Where the function's head starts (or the block's end is), and where the
                // search for what ends the head goes on.
                let (f, from) = match head {
                    Some(f) => (f, scanned),
                    None => {
                        let tags = [FUNCTION_START, CALL_END];
                        let Some((f, tag)) = first_tag(&self.pending, scanned, &tags) else {
                            let scanned = tail_start(&self.pending, scanned, CODER_TAG_MAX);
                            self.mode = Mode::Coder(CoderPart::Block {
                                called,
                                scanned,
                                head: None,
                            });
                            return;
                        };
                        let from = if tag == FUNCTION_START {
                            f + FUNCTION_START.len()
                        } else {
                            f
                        };
                        (f, from)
                    }
                };
                let end = find(CALL_END, from);
                let gt = self.pending[f..]
                    .starts_with(FUNCTION_START)
                    .then(|| find(">", from))
                    .flatten()
                    .filter(|&gt| end.is_none_or(|e| gt < e));
                match (gt, end) {
                    // `<function=NAME>` inside the block: a call.
                    (Some(gt), _) => {
                        let name = self.pending[f + FUNCTION_START.len()..gt].to_string();
                        out.add_call(ToolCall {
                            index: self.calls,
                            name: Some(name.clone()),
                            arguments: "{".into(),
                        });
                        self.calls += 1;
                        self.function = name;
                        self.gap.clear();
                        self.pending.drain(..=gt);
                        self.mode = Mode::Coder(CoderPart::Function {
                            params: 0,
                            scanned: 0,
                        });
                    }
                    // The block ends without a (whole) function head.
                    (None, Some(e)) => {
                        if called {
                            self.pending.drain(..e + CALL_END.len());
                            self.end_call();
                        } else {
                            let body = self.pending[..e].to_string();
                            self.pending.drain(..e + CALL_END.len());
                            self.give_back(&body, CALL_END, out);
                        }
                    }
                    // A function's head not in yet.
                    (None, None) => {
                        let scanned = tail_start(&self.pending, from, CODER_TAG_MAX);
                        self.mode = Mode::Coder(CoderPart::Block {
                            called,
                            scanned,
                            head: Some(f),
                        });
                    }
                }
            }
            CoderPart::Function { params, scanned } => {
                let Some((at, tag)) =
                    first_tag(&self.pending, 0, &[PARAMETER_START, FUNCTION_END, CALL_END])
                else {
                    // Text between parameters is dropped: keep only what may be a tag's start.
                    let keep = tail_start(&self.pending, 0, CODER_TAG_MAX);
                    self.pending.drain(..keep);
                    return;
                };
                if tag != PARAMETER_START {
                    out.add_arguments(self.calls - 1, "}");
                    self.pending.drain(..at + tag.len());
                    if tag == CALL_END {
                        self.end_call();
                    } else {
                        self.mode = Mode::Coder(CoderPart::Block {
                            called: true,
                            scanned: 0,
                            head: None,
                        });
                    }
                    return;
                }
                // The held text starts at the parameter from here on (what was before it is
                // dropped), which keeps `scanned` meaningful.
                let scanned = if at > 0 {
                    self.pending.drain(..at);
                    0
                } else {
                    scanned
                };
                let from = PARAMETER_START.len();
                let ends = [PARAMETER_END, PARAMETER_START, FUNCTION_END, CALL_END];
                let Some((end, tag)) = first_tag(&self.pending, scanned.max(from), &ends) else {
                    let scanned = tail_start(&self.pending, from, CODER_TAG_MAX);
                    self.mode = Mode::Coder(CoderPart::Function { params, scanned });
                    return;
                };
                // vLLM's `$` drops one more newline where the function's text ends.
                let extra = usize::from(matches!(tag, FUNCTION_END | CALL_END));
                let params = params + self.parameter(params, from..end, extra, out);
                let drop = if tag == PARAMETER_END {
                    end + PARAMETER_END.len()
                } else {
                    end
                };
                self.pending.drain(..drop);
                self.mode = Mode::Coder(CoderPart::Function { params, scanned: 0 });
            }
        }
    }

    /// Gives out a parameter of the current function whose text (after `<parameter=`) is
    /// `region` of the pending text; returns how many it gave out (0 or 1).
    pub(super) fn parameter(
        &self,
        params: usize,
        region: std::ops::Range<usize>,
        extra: usize,
        out: &mut Parsed,
    ) -> usize {
        let schemas = self.coder.as_deref().expect("a Qwen3-Coder parser");
        match coder::parameter(
            schemas,
            &self.function,
            params == 0,
            &self.pending[region],
            extra,
        ) {
            Some(piece) => {
                out.add_arguments(self.calls - 1, &piece);
                1
            }
            None => 0,
        }
    }
}
