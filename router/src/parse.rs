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
mod coder_stream;
#[cfg(test)]
mod coder_tests;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use serde::Deserialize;
use serde_json::value::RawValue;

use call::{Arguments, Head};
use coder::{PARAMETER_START, Schemas};

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
    /// is content as written. `head`: where a `<function=` whose `>` is not in yet starts.
    /// `scanned`: where the search for the next tag (with `head`: for that `>` or the
    /// block's end) goes on; the held text before it has none.
    Block {
        called: bool,
        scanned: usize,
        head: Option<usize>,
    },
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

    /// A parser reading reasoning when `reasoning`, and tool calls when `tools`: Qwen3-Coder's,
    /// typed by `coder`'s schemas, when it is given, else Hermes's.
    pub fn reading(reasoning: bool, tools: bool, coder: Option<&Arc<Schemas>>) -> Self {
        match coder {
            Some(schemas) => Self::qwen3_coder(reasoning, schemas.clone()),
            None => Self::new(reasoning, tools),
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
                            head: None,
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

/// Where the part of `text` that may hold the unfinished start of a tag of up to `longest`
/// bytes begins: its last `longest - 1` bytes, from a char boundary, not before `from` (one).
fn tail_start(text: &str, from: usize, longest: usize) -> usize {
    let mut at = text.len().saturating_sub(longest - 1).max(from);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}
