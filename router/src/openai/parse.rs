//! A chat answer's structure, read out of its text as it streams: Qwen3's reasoning (a
//! `<think>` … `</think>` block at the very start: `--reasoning-parser qwen3`) and
//! Hermes-style tool calls (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`, any
//! number: `--tool-call-parser hermes`) or Qwen3-Coder's (`<tool_call><function=NAME>
//! <parameter=NAME>…</parameter></function></tool_call>`: `--tool-call-parser qwen3_coder`,
//! [`coder`]), as vLLM's parsers of those names read them.
//!
//! Text that may be the start of a tag is held back until the next piece decides it, so a tag
//! split across chunks is still found; a whole answer parsed at once gives the same result as
//! the same answer streamed in any pieces. A tool call written as Qwen3's template teaches
//! (`{"name": "…", "arguments": {…}}`) streams: its name once the head is in, then its
//! arguments' text as it arrives (`call`), as OpenAI streams them; the call ends with its
//! arguments object, the rest of its object and the closing tag are dropped, and anything
//! else after it (a next call of a model that left the tag out, prose) is read on. A block of any
//! other shape is read whole at its closing tag (or the end of the answer): a call if its JSON
//! is one, else content as written. Newlines just inside the think block and after it are
//! dropped (the template writes them), and so is white space next to tool calls.
//!
//! A Qwen3-Coder block is read by its whole tags, held until they are in: its call's name and
//! `{` once `<function=NAME>` is, then each parameter as `"name": value` once it ends, then
//! `}`; the pieces join to the arguments the whole answer gives. A block with no function is
//! content as written.

mod call;
pub mod coder;
#[cfg(test)]
mod fuzz;

use std::sync::Arc;

use serde::Deserialize;
use serde_json::value::RawValue;

use call::{Arguments, Head};
use coder::{FUNCTION_END, FUNCTION_START, PARAMETER_END, PARAMETER_START, Schemas};

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL_START: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

/// `--reasoning-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    /// A `<think>` block at the start is `reasoning_content`.
    Qwen3,
}

/// `--tool-call-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolCallParser {
    /// `<tool_call>` blocks of JSON `{"name", "arguments"}` are `tool_calls`.
    Hermes,
    /// Qwen3-Coder's `<tool_call>` blocks of `<function=NAME>` and `<parameter=NAME>` pieces
    /// are `tool_calls`, the values typed by the request's tool schemas.
    #[value(name = "qwen3_coder")]
    Qwen3Coder,
}

/// A call the model made, or the part of it a piece of the answer added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// Which call of the answer, from 0.
    pub index: usize,
    /// The function's name: on a call's first part, never on the parts after it.
    pub name: Option<String>,
    /// The arguments' JSON text as the model wrote it (this part's share of it).
    pub arguments: String,
}

/// What a piece of the answer added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub reasoning: String,
    pub content: String,
    /// Parts of calls; parts of one call that came in one piece are joined.
    pub calls: Vec<ToolCall>,
}

impl Parsed {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }

    /// Adds what a later piece added.
    pub fn append(&mut self, other: Parsed) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        for part in other.calls {
            self.add_call(part);
        }
    }

    fn add_call(&mut self, part: ToolCall) {
        match self.calls.last_mut() {
            Some(last) if last.index == part.index => {
                last.arguments.push_str(&part.arguments);
                if last.name.is_none() {
                    last.name = part.name;
                }
            }
            _ => self.calls.push(part),
        }
    }

    fn add_arguments(&mut self, index: usize, text: &str) {
        if !text.is_empty() {
            self.add_call(ToolCall {
                index,
                name: None,
                arguments: text.to_string(),
            });
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing decided yet: the answer may open with `<think>`.
    Start,
    Reasoning,
    Content,
    Call(CallPart),
    /// Inside a Qwen3-Coder `<tool_call>` block.
    Coder(CoderPart),
}

/// Where in a Qwen3-Coder `<tool_call>` block the answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CoderPart {
    /// Before a `<function=NAME>` (the block's first, or a next one after `</function>`);
    /// `called`: the block made a call already. The block's text is held: one without a call
    /// is content as written. `scanned`: where the search for the next tag goes on (the held
    /// text before it has none).
    Block { called: bool, scanned: usize },
    /// Inside call `calls - 1`'s function, `params` parameters given out. `scanned`: where in
    /// the held text (which then starts with `<parameter=`) the search for the value's end
    /// goes on, so a long value streamed in small pieces is read once, not once per piece.
    Function { params: usize, scanned: usize },
}

/// Where in a `<tool_call>` block the answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallPart {
    /// Its head is not in yet: it may still stream.
    Head,
    /// It does not stream: read whole at its closing tag, searched for from `scanned` on
    /// (the held text before it has none), so a long block is read once.
    Whole { scanned: usize },
    /// Streaming call `calls - 1`'s arguments.
    Arguments(Arguments),
    /// The arguments ended; the rest of the call's object is dropped.
    Tail(Arguments),
    /// The call's object ended: white space and the closing tag are dropped; anything else
    /// (a next `<tool_call>` without this one's closing tag, prose) is content again.
    After,
}

/// One answer's parser.
#[derive(Debug, Clone)]
pub struct AnswerParser {
    tools: bool,
    mode: Mode,
    /// Text not yet given out: a possible tag's start, held white space, an open call.
    pending: String,
    calls: usize,
    /// A call ended and no content followed yet: white space here is dropped.
    after_call: bool,
    /// Just inside or after the think block: newlines here are dropped.
    skip_newlines: bool,
    /// The white space before the open `<tool_call>`: dropped if it is a call, given back
    /// with the block if it is not.
    gap: String,
    /// `--tool-call-parser qwen3_coder`: the request's tools' parameter types.
    coder: Option<Arc<Schemas>>,
    /// The name of the Qwen3-Coder function being read.
    function: String,
}

/// The call inside a `<tool_call>` block.
#[derive(Deserialize)]
struct CallJson<'a> {
    name: String,
    #[serde(borrow)]
    arguments: Option<&'a RawValue>,
}

/// Length of the longest end of `text` that begins `tag` (and is not all of it).
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

fn parse_call(index: usize, body: &str) -> Option<ToolCall> {
    let call: CallJson<'_> = serde_json::from_str(body.trim()).ok()?;
    Some(ToolCall {
        index,
        name: Some(call.name),
        arguments: call
            .arguments
            .map_or_else(|| "{}".to_string(), |a| a.get().to_string()),
    })
}

impl AnswerParser {
    /// A parser reading reasoning when `reasoning`, tool calls when `tools`.
    pub fn new(reasoning: bool, tools: bool) -> Self {
        Self {
            tools,
            mode: if reasoning {
                Mode::Start
            } else {
                Mode::Content
            },
            pending: String::new(),
            calls: 0,
            after_call: false,
            skip_newlines: false,
            gap: String::new(),
            coder: None,
            function: String::new(),
        }
    }

    /// A parser reading reasoning when `reasoning`, and Qwen3-Coder's tool calls, typed by
    /// `schemas`.
    pub fn qwen3_coder(reasoning: bool, schemas: Arc<Schemas>) -> Self {
        Self {
            coder: Some(schemas),
            ..Self::new(reasoning, true)
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds the next piece of text; returns what it decided.
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut out = Parsed::default();
        loop {
            let before = (self.mode, self.pending.len());
            self.step(&mut out);
            if (self.mode, self.pending.len()) == before {
                return out;
            }
        }
    }

    /// The end of the answer: gives out everything held.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::Start | Mode::Content => {
                if self.calls == 0 {
                    out.content = rest;
                } else if !rest.trim().is_empty() {
                    out.content = if self.after_call {
                        rest.trim_start().to_string()
                    } else {
                        rest
                    };
                }
            }
            Mode::Reasoning => out.reasoning = rest.trim_end_matches('\n').to_string(),
            // An unclosed block at the end: still a call if its JSON is whole.
            Mode::Call(CallPart::Head | CallPart::Whole { .. }) => {
                match parse_call(self.calls, &rest) {
                    Some(call) => {
                        self.calls += 1;
                        out.calls.push(call);
                    }
                    None => out.content = format!("{}{CALL_START}{rest}", self.gap),
                }
            }
            // Cut off inside its arguments: they end here, as OpenAI's do at `length`.
            Mode::Call(CallPart::Arguments(_)) => out.add_arguments(self.calls - 1, &rest),
            Mode::Call(CallPart::Tail(_) | CallPart::After) => {}
            // An unclosed block without a call is content; after one, the rest is dropped.
            Mode::Coder(CoderPart::Block { called, .. }) => {
                if !called {
                    out.content = format!("{}{CALL_START}{rest}", self.gap);
                }
            }
            // Cut off inside a function: its last parameter runs to the end (vLLM's two `$`
            // drop up to two newlines more there), and the arguments close.
            Mode::Coder(CoderPart::Function { params, .. }) => {
                self.pending = rest;
                if let Some(at) = self.pending.find(PARAMETER_START) {
                    let from = at + PARAMETER_START.len();
                    self.parameter(params, from..self.pending.len(), 2, &mut out);
                }
                self.pending.clear();
                out.add_arguments(self.calls - 1, "}");
            }
        }
        self.mode = Mode::Content;
        out
    }

    /// Moves as far as the pending text allows in the current mode.
    fn step(&mut self, out: &mut Parsed) {
        if self.skip_newlines && matches!(self.mode, Mode::Reasoning | Mode::Content) {
            let cut = self.pending.len() - self.pending.trim_start_matches('\n').len();
            self.pending.drain(..cut);
            self.skip_newlines = self.pending.is_empty();
        }
        match self.mode {
            Mode::Start => {
                if let Some(rest) = self.pending.strip_prefix(THINK_START) {
                    self.pending = rest.to_string();
                    self.mode = Mode::Reasoning;
                    self.skip_newlines = true;
                } else if !THINK_START.starts_with(self.pending.as_str()) {
                    self.mode = Mode::Content;
                }
            }
            Mode::Reasoning => {
                if let Some(at) = self.pending.find(THINK_END) {
                    out.reasoning
                        .push_str(self.pending[..at].trim_end_matches('\n'));
                    self.pending.drain(..at + THINK_END.len());
                    self.mode = Mode::Content;
                    self.skip_newlines = true;
                } else {
                    // Hold a possible `</think>` start and the newlines before it.
                    let held = partial_tag(&self.pending, THINK_END);
                    let keep = self.pending[..self.pending.len() - held]
                        .trim_end_matches('\n')
                        .len();
                    out.reasoning.push_str(&self.pending[..keep]);
                    self.pending.drain(..keep);
                }
            }
            Mode::Content if !self.tools => {
                out.content.push_str(&self.pending);
                self.pending.clear();
            }
            Mode::Content => {
                if let Some(at) = self.pending.find(CALL_START) {
                    let text = &self.pending[..at];
                    let kept = text.trim_end();
                    let before = if self.after_call {
                        kept.trim_start()
                    } else {
                        kept
                    };
                    out.content.push_str(before);
                    self.gap = if self.after_call && before.is_empty() {
                        String::new()
                    } else {
                        text[kept.len()..].to_string()
                    };
                    self.pending.drain(..at + CALL_START.len());
                    self.mode = if self.coder.is_some() {
                        Mode::Coder(CoderPart::Block {
                            called: false,
                            scanned: 0,
                        })
                    } else {
                        Mode::Call(CallPart::Head)
                    };
                } else {
                    // Hold a possible `<tool_call>` start and the white space before it: it
                    // is dropped if a call follows.
                    let held = partial_tag(&self.pending, CALL_START);
                    let keep = self.pending[..self.pending.len() - held].trim_end().len();
                    if keep > 0 {
                        let piece = &self.pending[..keep];
                        out.content.push_str(if self.after_call {
                            piece.trim_start()
                        } else {
                            piece
                        });
                        self.after_call = false;
                        self.pending.drain(..keep);
                    }
                }
            }
            Mode::Call(part) => self.step_call(part, out),
            Mode::Coder(part) => self.step_coder(part, out),
        }
    }

    /// Moves as far as the pending text allows inside a Qwen3-Coder `<tool_call>` block.
    /// Everything is decided by whole tags found in the held text, so nothing waits on a
    /// tag's start.
    fn step_coder(&mut self, part: CoderPart, out: &mut Parsed) {
        let find = |tag: &str, from: usize| self.pending[from..].find(tag).map(|at| at + from);
        match part {
            CoderPart::Block { called, scanned } => {
                let Some((f, tag)) = first_tag(&self.pending, scanned, &[FUNCTION_START, CALL_END])
                else {
                    let scanned = tail_start(&self.pending, scanned, CODER_TAG_MAX);
                    self.mode = Mode::Coder(CoderPart::Block { called, scanned });
                    return;
                };
                let end = find(CALL_END, f);
                let gt = (tag == FUNCTION_START)
                    .then(|| find(">", f + FUNCTION_START.len()))
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
                        self.mode = Mode::Coder(CoderPart::Block { called, scanned: f });
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
    fn parameter(
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

    /// A `<tool_call>` block that was not a call: content as written, with the white space
    /// before it.
    fn give_back(&mut self, body: &str, end: &str, out: &mut Parsed) {
        self.mode = Mode::Content;
        self.after_call = false;
        let gap = std::mem::take(&mut self.gap);
        out.content
            .push_str(&format!("{gap}{CALL_START}{body}{end}"));
    }

    /// Moves as far as the pending text allows inside a `<tool_call>` block.
    fn step_call(&mut self, part: CallPart, out: &mut Parsed) {
        match part {
            CallPart::Head => {
                let end = self.pending.find(CALL_END);
                // The whole pending text: a closing tag inside the name's string is text.
                match call::head(&self.pending) {
                    Head::Call { name, args } => {
                        out.add_call(ToolCall {
                            index: self.calls,
                            name: Some(name),
                            arguments: String::new(),
                        });
                        self.calls += 1;
                        self.gap.clear();
                        self.pending.drain(..args);
                        self.mode = Mode::Call(CallPart::Arguments(Arguments::default()));
                    }
                    Head::No => match end {
                        Some(at) => self.close_whole(at, out),
                        None => self.mode = Mode::Call(CallPart::Whole { scanned: 0 }),
                    },
                    Head::More => {}
                }
            }
            CallPart::Whole { scanned } => match self.pending[scanned..].find(CALL_END) {
                Some(at) => self.close_whole(scanned + at, out),
                None => {
                    let scanned = tail_start(&self.pending, scanned, CALL_END.len());
                    self.mode = Mode::Call(CallPart::Whole { scanned });
                }
            },
            // Both read on with their lexer: the arguments, given out, then the rest of the
            // call's object, dropped.
            CallPart::Arguments(mut lexer) | CallPart::Tail(mut lexer) => {
                let arguments = matches!(part, CallPart::Arguments(_));
                let (given, ended) = self.scan(&mut lexer);
                if arguments {
                    out.add_arguments(self.calls - 1, &self.pending[..given]);
                }
                match ended {
                    // Cut off by a closing tag.
                    Some(end) if end > given => {
                        self.pending.drain(..end);
                        self.end_call();
                    }
                    Some(end) => {
                        self.pending.drain(..end);
                        self.mode = Mode::Call(if arguments {
                            CallPart::Tail(Arguments::inside_object())
                        } else {
                            CallPart::After
                        });
                    }
                    None => {
                        self.pending.drain(..given);
                        self.mode = Mode::Call(if arguments {
                            CallPart::Arguments(lexer)
                        } else {
                            CallPart::Tail(lexer)
                        });
                    }
                }
            }
            CallPart::After => {
                let white = self.pending.len() - self.pending.trim_start().len();
                self.pending.drain(..white);
                if self.pending.starts_with(CALL_END) {
                    self.pending.drain(..CALL_END.len());
                    self.end_call();
                } else if !self.pending.is_empty() && !CALL_END.starts_with(self.pending.as_str()) {
                    self.end_call();
                }
            }
        }
    }

    /// Reads the pending text of a call's object with `lexer`: up to where it can be given
    /// out, and where the call's part ends, if it does there: just past the object's closing
    /// brace, or past a closing tag outside any string (the part cut off), which lies past
    /// the first number. A possible closing tag waits for the next piece.
    fn scan(&self, lexer: &mut Arguments) -> (usize, Option<usize>) {
        for (i, c) in self.pending.char_indices() {
            if c == '<' && lexer.outside_strings() {
                let rest = &self.pending[i..];
                if rest.starts_with(CALL_END) {
                    return (i, Some(i + CALL_END.len()));
                }
                if CALL_END.starts_with(rest) {
                    return (i, None);
                }
            }
            if lexer.take(c) {
                let end = i + c.len_utf8();
                return (end, Some(end));
            }
        }
        (self.pending.len(), None)
    }

    /// The closing tag of a block read whole is at `at`: a call if its JSON is one, else
    /// content as written.
    fn close_whole(&mut self, at: usize, out: &mut Parsed) {
        let body = self.pending[..at].to_string();
        self.pending.drain(..at + CALL_END.len());
        match parse_call(self.calls, &body) {
            Some(call) => {
                self.calls += 1;
                out.calls.push(call);
                self.end_call();
            }
            None => self.give_back(&body, CALL_END, out),
        }
    }

    /// A call ended: back to content, where white space right after it is dropped.
    fn end_call(&mut self) {
        self.mode = Mode::Content;
        self.after_call = true;
        self.gap.clear();
    }

    /// Parses a whole answer.
    pub fn parse_all(reasoning: bool, tools: bool, text: &str) -> Parsed {
        Self::new(reasoning, tools).parse_whole(text)
    }

    /// Parses a whole answer with this (fresh) parser.
    pub fn parse_whole(mut self, text: &str) -> Parsed {
        let mut out = self.push(text);
        out.append(self.finish());
        out
    }
}

/// The first of `tags` in `text` at or after `from` (a char boundary), and where it is.
fn first_tag(text: &str, from: usize, tags: &[&'static str]) -> Option<(usize, &'static str)> {
    text[from..].match_indices('<').find_map(|(i, _)| {
        let at = from + i;
        let tag = tags.iter().find(|t| text[at..].starts_with(**t))?;
        Some((at, *tag))
    })
}

/// The longest of the tags a Qwen3-Coder block is read by.
const CODER_TAG_MAX: usize = CALL_END.len();

/// Where the part of `text` that may hold the unfinished start of a tag of up to `longest`
/// bytes begins: its last `longest - 1` bytes, from a char boundary, not before `from` (one).
fn tail_start(text: &str, from: usize, longest: usize) -> usize {
    let mut at = text.len().saturating_sub(longest - 1).max(from);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(index: usize, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            index,
            name: Some(name.into()),
            arguments: arguments.into(),
        }
    }

    /// The answer parsed whole, and streamed one character (and one byte-sized piece) at a
    /// time: all three agree.
    fn parse(reasoning: bool, tools: bool, text: &str) -> Parsed {
        let whole = AnswerParser::parse_all(reasoning, tools, text);
        let mut parser = AnswerParser::new(reasoning, tools);
        let mut streamed = Parsed::default();
        for c in text.chars() {
            streamed.append(parser.push(&c.to_string()));
        }
        streamed.append(parser.finish());
        assert_eq!(streamed, whole, "streamed by character: {text:?}");
        for size in [2, 3, 5, 7] {
            let mut parser = AnswerParser::new(reasoning, tools);
            let mut pieces = Parsed::default();
            let chars: Vec<char> = text.chars().collect();
            for chunk in chars.chunks(size) {
                pieces.append(parser.push(&chunk.iter().collect::<String>()));
            }
            pieces.append(parser.finish());
            assert_eq!(pieces, whole, "streamed in pieces of {size}: {text:?}");
        }
        whole
    }

    #[test]
    fn reasoning_is_the_opening_think_block() {
        let p = parse(
            true,
            false,
            "<think>\nLet me see.\n2+2=4.\n</think>\n\nIt is 4.",
        );
        assert_eq!(p.reasoning, "Let me see.\n2+2=4.");
        assert_eq!(p.content, "It is 4.");
        // Thinking off (the template wrote an empty block into the prompt): all content.
        let p = parse(true, false, "It is 4. <think> is a tag.");
        assert_eq!(
            (p.reasoning.as_str(), p.content.as_str()),
            ("", "It is 4. <think> is a tag.")
        );
        // Cut off while thinking: all reasoning so far.
        let p = parse(true, false, "<think>\nStill going\n");
        assert_eq!(
            (p.reasoning.as_str(), p.content.as_str()),
            ("Still going", "")
        );
        // Without the parser, the tags are text.
        let p = parse(false, false, "<think>x</think>y");
        assert_eq!(p.content, "<think>x</think>y");
        // A near-tag at the start is content once it stops matching.
        assert_eq!(parse(true, false, "<thin").content, "<thin");
        assert_eq!(parse(true, false, "<thinking>").content, "<thinking>");
    }

    #[test]
    fn tool_calls_are_read_whole_and_keep_their_arguments_text() {
        let text = "<think>\nNeed weather.\n</think>\n\nChecking both.\n<tool_call>\n\
                    {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\", \"n\": [1, 2]}}\n\
                    </tool_call>";
        let p = parse(true, true, text);
        assert_eq!(p.reasoning, "Need weather.");
        assert_eq!(p.content, "Checking both.");
        assert_eq!(
            p.calls,
            [
                call(0, "get_weather", r#"{"city": "Paris"}"#),
                call(1, "get_weather", r#"{"city": "Lyon", "n": [1, 2]}"#)
            ]
        );
        // Only calls: no content at all; an unclosed last call whose JSON is whole counts.
        let p = parse(
            false,
            true,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>{\"name\": \"g\"}",
        );
        assert_eq!(p.content, "");
        assert_eq!(p.calls, [call(0, "f", "{}"), call(1, "g", "{}")]);
    }

    #[test]
    fn blocks_that_are_not_calls_stay_text() {
        let p = parse(false, true, "a <tool_call>not json</tool_call> b");
        assert_eq!(p.content, "a <tool_call>not json</tool_call> b");
        assert!(p.calls.is_empty());
        let p = parse(false, true, "x <tool_call>{\"name\": \"f\"");
        assert_eq!(p.content, "x <tool_call>{\"name\": \"f\"");
        // Without tools in the request, a well-formed block is text too.
        let p = parse(false, false, "<tool_call>{\"name\": \"f\"}</tool_call>");
        assert_eq!(p.content, "<tool_call>{\"name\": \"f\"}</tool_call>");
        // White space is kept when no call follows.
        assert_eq!(parse(false, true, "a  \n").content, "a  \n");
        assert_eq!(parse(false, true, "<tool").content, "<tool");
    }

    #[test]
    fn held_text_waits_for_the_piece_that_decides_it() {
        let mut p = AnswerParser::new(true, true);
        assert!(p.push("<thi").is_empty());
        assert!(p.push("nk>Hm").reasoning == "Hm");
        assert!(p.push("</thi").is_empty());
        let out = p.push("nk>Yes <tool_");
        assert_eq!(out.content, "Yes");
        assert!(p.push("call>{\"name\": \"f\", \"argu").is_empty());
        let out = p.push("ments\": {} }");
        assert_eq!(out.calls, [call(0, "f", "{}")]);
        assert!(p.push("</tool_call>").is_empty());
        assert_eq!(p.calls(), 1);
        assert!(p.finish().is_empty());
    }

    #[test]
    fn a_call_streams_its_name_then_its_arguments_as_they_come() {
        let mut p = AnswerParser::new(false, true);
        assert!(p.push("<tool_call>\n{\"name\": \"get_").is_empty());
        let out = p.push("weather\", \"arguments\": {\"ci");
        assert_eq!(out.calls, [call(0, "get_weather", "{\"ci")]);
        let more = |text: &str| ToolCall {
            index: 0,
            name: None,
            arguments: text.into(),
        };
        assert_eq!(p.push("ty\": \"Par").calls, [more("ty\": \"Par")]);
        // A closing tag inside a string is text of the arguments; one that may start outside
        // a string waits.
        assert_eq!(p.push("</tool_call>\"").calls, [more("</tool_call>\"")]);
        assert_eq!(p.push(" </tool_").calls, [more(" ")]);
        assert_eq!(p.push("x}}\n").calls, [more("</tool_x}")]);
        // The call ended with its object: white space and the closing tag are dropped.
        assert!(p.push("</tool_call>\n\nDone.").content == "Done.");
        assert_eq!(p.calls(), 1);
    }

    #[test]
    fn streamed_calls_are_read_as_their_head_and_arguments_say() {
        // The rest of the call's object is dropped; text after it is content again (the
        // call was given out as it streamed, whole or streamed alike).
        let p = parse(
            false,
            true,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"x\": 2} junk</tool_call> ok",
        );
        assert_eq!(
            (p.calls, p.content.as_str()),
            (vec![call(0, "f", "{\"a\": 1}")], "junk</tool_call> ok")
        );
        // A call without its closing tag: a next call, or prose, still comes through.
        let p = parse(
            false,
            true,
            "<tool_call>{\"name\":\"f\",\"arguments\":{}}\n<tool_call>{\"name\":\"g\",\"arguments\":{}}</tool_call>",
        );
        assert_eq!(p.calls, [call(0, "f", "{}"), call(1, "g", "{}")]);
        let p = parse(
            false,
            true,
            "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":1}} The weather is nice.",
        );
        assert_eq!(p.calls, [call(0, "f", "{\"a\":1}")]);
        assert_eq!(p.content, "The weather is nice.");
        // A closing tag inside the name's string is part of the name.
        let p = parse(
            false,
            true,
            "<tool_call>{\"name\": \"a</tool_call>b\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(p.calls, [call(0, "a</tool_call>b", "{}")]);
        // Cut off inside the arguments (`length`): the call has what was written.
        let p = parse(
            true,
            true,
            "<think>t</think>Hi<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"x <",
        );
        assert_eq!(p.calls, [call(0, "f", "{\"a\": \"x <")]);
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("t", "Hi"));
        // A closing tag outside any string ends the call where it stands.
        let p = parse(
            false,
            true,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1</tool_call> b <tool_call>\
             {\"name\": \"g\", \"arguments\": {\"s\": \"}\"}}</tool_call>",
        );
        assert_eq!(
            p.calls,
            [call(0, "f", "{\"a\": 1"), call(1, "g", "{\"s\": \"}\"}")]
        );
        assert_eq!(p.content, "b");
        // Other shapes are read whole: the name after the arguments, no arguments.
        let p = parse(
            false,
            true,
            "<tool_call>{\"arguments\": {\"a\": [1]}, \"name\": \"f\"}</tool_call>\
             <tool_call>{\"name\": \"g\"}</tool_call><tool_call>{\"name\": \"h\", \"arguments\": 5}",
        );
        assert_eq!(
            p.calls,
            [
                call(0, "f", "{\"a\": [1]}"),
                call(1, "g", "{}"),
                call(2, "h", "5")
            ]
        );
    }
}

#[cfg(test)]
mod coder_tests {
    use super::*;
    use serde_json::{Value, json};

    fn tools() -> Arc<Schemas> {
        // vLLM's test tools, and one of every type.
        Arc::new(Schemas::new(&[
            json!({"type": "function", "function": {"name": "get_current_weather",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"}, "state": {"type": "string"},
                    "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}}}}}),
            json!({"type": "function", "function": {"name": "calculate_area",
                "parameters": {"type": "object", "properties": {
                    "shape": {"type": "string"}, "dimensions": {"type": "object"},
                    "precision": {"type": "integer"}}}}}),
            json!({"type": "function", "function": {"name": "test_types",
                "parameters": {"type": "object", "properties": {
                    "int_param": {"type": "integer"}, "float_param": {"type": "float"},
                    "num_param": {"type": "number"}, "bool_param": {"type": "boolean"},
                    "str_param": {"type": "string"}, "obj_param": {"type": "object"},
                    "arr_param": {"type": "array"}}}}}),
        ]))
    }

    /// Whole, and streamed by character and in pieces of 2, 3, 5, 7 characters: all agree.
    fn parse(reasoning: bool, text: &str) -> Parsed {
        let whole = AnswerParser::qwen3_coder(reasoning, tools()).parse_whole(text);
        let chars: Vec<char> = text.chars().collect();
        for size in [1, 2, 3, 5, 7] {
            let mut parser = AnswerParser::qwen3_coder(reasoning, tools());
            let mut pieces = Parsed::default();
            for chunk in chars.chunks(size) {
                pieces.append(parser.push(&chunk.iter().collect::<String>()));
            }
            pieces.append(parser.finish());
            assert_eq!(pieces, whole, "streamed in pieces of {size}: {text:?}");
        }
        whole
    }

    fn args(call: &ToolCall) -> Value {
        serde_json::from_str(&call.arguments).expect(&call.arguments)
    }

    const DALLAS: &str = "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n\
        </parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n\
        </parameter>\n</function>\n</tool_call>";

    #[test]
    fn vllms_cases_read_alike() {
        // Single call: the arguments as vLLM's json.dumps writes them.
        let p = parse(false, DALLAS);
        assert_eq!(p.content, "");
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].name.as_deref(), Some("get_current_weather"));
        assert_eq!(
            p.calls[0].arguments,
            r#"{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}"#
        );
        // Content before it.
        let p = parse(
            false,
            &format!("Sure! Let me check the weather for you.{DALLAS}"),
        );
        assert_eq!(p.content, "Sure! Let me check the weather for you.");
        assert_eq!(p.calls.len(), 1);
        // Parallel calls.
        let orlando = DALLAS.replace("Dallas", "Orlando").replace("TX", "FL");
        let p = parse(false, &format!("{DALLAS}\n{orlando}"));
        assert_eq!(p.content, "");
        assert_eq!(p.calls.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(args(&p.calls[1])["city"], "Orlando");
        assert_eq!(args(&p.calls[1])["state"], "FL");
        // A multi-line object value.
        let p = parse(
            false,
            "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n\
             <parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n\
             <parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(
            p.calls[0].arguments,
            r#"{"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2}"#
        );
        // Typed parameters.
        let p = parse(
            false,
            "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n\
             <parameter=float_param>\n2.75\n</parameter>\n<parameter=num_param>\n2.0\n\
             </parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\n\
             hello world\n</parameter>\n<parameter=obj_param>\n{\"key\": \"value\"}\n</parameter>\n\
             <parameter=arr_param>\n[1, \"a\"]\n</parameter>\n<parameter=extra>\n7\n</parameter>\n\
             <parameter=str_param2>\nnull\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(
            args(&p.calls[0]),
            json!({"int_param": 42, "float_param": 2.75, "num_param": 2, "bool_param": true,
                   "str_param": "hello world", "obj_param": {"key": "value"},
                   "arr_param": [1, "a"], "extra": "7", "str_param2": null})
        );
        // No calls: all content.
        let p = parse(false, "This is a test without tools");
        assert_eq!(p.content, "This is a test without tools");
        assert!(p.calls.is_empty());
    }

    #[test]
    fn values_keep_their_inner_newlines_and_fall_back_to_strings() {
        let p = parse(
            false,
            "<tool_call>\n<function=test_types>\n<parameter=str_param>\n\nline 1\n  line 2\n\n\
             </parameter>\n<parameter=int_param>\nmany\n</parameter>\n<parameter=obj_param>\n\
             {broken\n</parameter>\n<parameter=bool_param>\nyes\n</parameter>\n</function>\n\
             </tool_call>",
        );
        assert_eq!(
            args(&p.calls[0]),
            json!({"str_param": "\nline 1\n  line 2\n", "int_param": "many",
                   "obj_param": "{broken", "bool_param": false})
        );
        // A tool the request does not have: strings.
        let p = parse(
            false,
            "<tool_call><function=other><parameter=n>5</parameter></function></tool_call>",
        );
        assert_eq!(
            (p.calls[0].name.as_deref(), p.calls[0].arguments.as_str()),
            (Some("other"), r#"{"n": "5"}"#)
        );
    }

    #[test]
    fn reasoning_then_calls_and_text_around_them() {
        let p = parse(
            true,
            &format!("<think>\nWeather, then.\n</think>\n\nChecking.\n\n{DALLAS}\n\nDone."),
        );
        assert_eq!(p.reasoning, "Weather, then.");
        assert_eq!(p.content, "Checking.Done.");
        assert_eq!(p.calls.len(), 1);
        // A block without a function is content as written; so are Hermes blocks.
        let p = parse(false, "a <tool_call>{\"name\": \"f\"}</tool_call> b");
        assert_eq!(p.content, "a <tool_call>{\"name\": \"f\"}</tool_call> b");
        assert!(p.calls.is_empty());
        // Two functions in one block are two calls; text between them is dropped.
        let p = parse(
            false,
            "<tool_call><function=a></function> x <function=b><parameter=q>1</parameter>\
             </function></tool_call>",
        );
        assert_eq!(p.calls.len(), 2);
        assert_eq!(
            (p.calls[0].arguments.as_str(), p.calls[1].arguments.as_str()),
            ("{}", r#"{"q": "1"}"#)
        );
    }

    #[test]
    fn missing_closing_tags_end_where_vllm_ends_them() {
        // No `</parameter>`: the next `<parameter=` or `</function>` ends the value; vLLM's
        // `$` drops one more newline before `</function>`.
        let p = parse(
            false,
            "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nParis\n\
             <parameter=state>\nIDF\n\n</function>\n</tool_call>",
        );
        assert_eq!(p.calls[0].arguments, r#"{"city": "Paris", "state": "IDF"}"#);
        // No `</function>`: `</tool_call>` ends it.
        let p = parse(
            false,
            "<tool_call>\n<function=calculate_area>\n<parameter=precision>\n3\n</parameter>\n\
             </tool_call> after",
        );
        assert_eq!(p.calls[0].arguments, r#"{"precision": 3}"#);
        assert_eq!(p.content, "after");
        // No `</tool_call>`: the end of the answer ends the block; what follows a function
        // in it is dropped.
        let p = parse(
            false,
            "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nParis\n</parameter>\n\
             </function>\nThe weather is nice.",
        );
        assert_eq!(p.calls[0].arguments, r#"{"city": "Paris"}"#);
        assert_eq!(p.content, "");
        // Cut off inside a value: it runs to the end (two more newlines dropped there).
        let p = parse(
            false,
            "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nPar\n\n\n",
        );
        assert_eq!(p.calls[0].arguments, r#"{"city": "Par"}"#);
        // Cut off inside the function's name: the block is content.
        let p = parse(false, "Hi <tool_call>\n<function=get_cur");
        assert_eq!(p.content, "Hi <tool_call>\n<function=get_cur");
        assert!(p.calls.is_empty());
        // A parameter without a name's end is dropped.
        let p = parse(
            false,
            "<tool_call><function=f><parameter=x</function></tool_call>",
        );
        assert_eq!(p.calls[0].arguments, "{}");
    }

    #[test]
    fn a_call_streams_its_name_then_each_parameter() {
        let mut p = AnswerParser::qwen3_coder(false, tools());
        assert_eq!(p.push("Let me see.\n<tool_").content, "Let me see.");
        assert!(p.push("call>\n<function=calculate_ar").is_empty());
        let out = p.push("ea>\n<parameter=shape>\ncir");
        assert_eq!(out.calls[0].name.as_deref(), Some("calculate_area"));
        assert_eq!(out.calls[0].arguments, "{");
        assert!(p.push("cle\n</parameter>").calls[0].arguments == r#""shape": "circle""#);
        assert!(p.push("\n<parameter=precision>\n3\n</param").is_empty());
        assert_eq!(p.push("eter>\n").calls[0].arguments, r#", "precision": 3"#);
        assert_eq!(p.push("</function>\n").calls[0].arguments, "}");
        assert!(p.push("</tool_call>").is_empty());
        assert_eq!(p.calls(), 1);
        assert!(p.finish().is_empty());
    }
}
