//! Structured outputs (vLLM's `structured_outputs` / guided decoding): a request may ask that
//! its text match a regular expression, be one of a list of choices, be JSON that a schema
//! accepts, be any JSON object, or match a grammar (GBNF: `grammar`, read by a stack
//! recognizer with masks from the same trie). The first three become a regular expression
//! ([`StructuredOutput::regex`]; JSON schemas through outlines-core's converter), compiled
//! once into an index over the tokenizer's vocabulary ([`Guide`]: for every state of the
//! expression's automaton, the tokens that keep the text a prefix of a match and the state
//! each leads to). Any JSON object is no regular language; it is a pushdown recognizer
//! (`json`), entered from a regex's automaton wherever a schema (or `json_object`, alone)
//! leaves JSON free (`free`), with masks read from a vocabulary trie when a state is first
//! met (`trie`).
//! The sampler then allows only those tokens each step, and EOS only where the text is a
//! whole match (`GuideState`).
//!
//! Owns the specification, its compilation and the per-request walk; not the masking itself
//! (the sampler applies the allowed ids as it applies `allowed_token_ids`, on the host or as
//! per-id edits on a backend). Compiling takes from milliseconds (a short regex) to seconds
//! (a large schema over Qwen3's 151k tokens), so nodes compile off their async threads and
//! keep compiled guides in a [`GuideCache`].

mod anchors;
mod cache;
mod free;
mod grammar;
mod json;
mod pattern;
mod states;
mod trie;
mod vocabulary;

use std::sync::Arc;

use outlines_core::index::Index;
use serde::{Deserialize, Serialize};

pub use cache::GuideCache;
use free::{FreeJson, FreeState};
use grammar::{Grammar, GrammarGuide, GrammarState};
pub use grammar::{MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_ELEMENTS, MAX_GRAMMAR_STACKS, MAX_WALK_WORK};
pub use json::{MAX_DEPTH as MAX_JSON_DEPTH, MAX_WHITESPACE_RUN as MAX_JSON_WHITESPACE_RUN};
use states::check_states;
use trie::Masks;
pub use vocabulary::GuideVocabulary;

/// Longest regex, JSON schema or grammar a request may carry (bytes).
pub const MAX_STRUCTURED_SPEC_BYTES: usize = 16 * 1024;
/// Most choices a request may list.
pub const MAX_CHOICES: usize = 256;
/// Most states a guide's automaton may have. Compiling walks the whole vocabulary from each
/// state (about 6 ms per state for Qwen3's 151k tokens on a 2-core build machine), and a
/// bounded repetition of an alternation multiplies states (`[ab]*a[ab]{10}` has 4,097): the
/// cap keeps one request from holding a node's compile thread for minutes.
pub const MAX_GUIDE_STATES: usize = 1024;

/// What the output must look like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StructuredOutput {
    /// The whole output text matches this regular expression (Rust `regex` syntax, anchored
    /// at both ends).
    Regex(String),
    /// The output text is exactly one of these strings.
    Choice(Vec<String>),
    /// The output text is JSON accepted by this JSON schema (the subset outlines supports:
    /// types, properties, required, enum, const, arrays, nesting, `$ref` within the schema,
    /// string `pattern`s matched against the whole value).
    JsonSchema(String),
    /// The output text is one JSON object, any (OpenAI's `json_object`): nothing before its
    /// `{` or after its `}`, whitespace runs of at most [`MAX_JSON_WHITESPACE_RUN`] bytes,
    /// at most [`MAX_JSON_DEPTH`] levels of nesting.
    JsonObject,
    /// The whole output text matches this GBNF grammar (llama.cpp's format, from its `root`
    /// rule), nesting at most [`MAX_GRAMMAR_DEPTH`] rules deep.
    Grammar(String),
}

/// Why a structured output cannot be used.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StructuredError {
    /// Empty regex or schema, or no choices.
    #[error("structured output: the {0} is empty")]
    Empty(&'static str),
    /// Longer than [`MAX_STRUCTURED_SPEC_BYTES`].
    #[error("structured output: the {what} is {len} bytes, more than the {max} allowed", max = MAX_STRUCTURED_SPEC_BYTES)]
    TooLong {
        /// Which specification.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// More than [`MAX_CHOICES`] choices, or an empty one.
    #[error("structured output: {0}")]
    BadChoices(String),
    /// The JSON schema is not JSON, or not one outlines can turn into a regex.
    #[error("structured output: invalid JSON schema: {0}")]
    Schema(String),
    /// The regex does not parse.
    #[error("structured output: invalid regex: {0}")]
    Regex(String),
    /// The expression's automaton is larger than [`MAX_GUIDE_STATES`] allows.
    #[error("structured output: {0}")]
    TooComplex(String),
    /// Any JSON object or a grammar is no regular expression (asked of
    /// [`StructuredOutput::regex`]).
    #[error("structured output: {0} is not a regular expression")]
    NotRegular(&'static str),
    /// The grammar does not parse, or cannot be used (an undefined rule, no `root`, left
    /// recursion, too large).
    #[error("structured output: invalid grammar: {0}")]
    Grammar(String),
    /// The expression cannot be compiled over this vocabulary (for example a character no
    /// token can spell).
    #[error("structured output: cannot be generated with this model's vocabulary: {0}")]
    Vocabulary(String),
}

impl StructuredOutput {
    /// Checks sizes and syntax (cheap: what the router checks before routing); compiling
    /// over a vocabulary is [`Guide::compile`].
    pub fn validate(&self) -> Result<(), StructuredError> {
        match self {
            Self::JsonSchema(schema) if schema.len() > MAX_STRUCTURED_SPEC_BYTES => {
                Err(StructuredError::TooLong {
                    what: "JSON schema",
                    len: schema.len(),
                })
            }
            _ if self.is_any_json_object() => Ok(()),
            Self::Grammar(text) => grammar(text).map(drop),
            _ => self.regex().map(drop),
        }
    }

    /// Any JSON object is accepted: [`StructuredOutput::JsonObject`], or a JSON schema that
    /// asks for an object and nothing of it (`{"type": "object"}`, with no properties or
    /// none required and additional ones allowed; titles and descriptions aside). Such a
    /// schema is guided by the JSON grammar: as a regex it would nest without bound.
    pub fn is_any_json_object(&self) -> bool {
        match self {
            Self::JsonObject => true,
            Self::JsonSchema(schema) => any_object_schema(schema),
            _ => false,
        }
    }

    /// The regex of JSON that `schema` accepts, to be part of a larger regex (a forced tool
    /// call's, between its tags). Its free-form parts (any value, any object) are written
    /// as marks that the guide of that regex reads with the JSON grammar, as it reads a
    /// schema's own (`free`); as plain regexes they would nest past the state cap.
    pub fn json_schema_regex(schema: &str) -> Result<String, StructuredError> {
        Self::JsonSchema(schema.to_string()).regex()
    }

    /// The regular expression the output must match, checked as [`StructuredOutput::validate`]
    /// checks it; [`StructuredError::NotRegular`] for any JSON object or a grammar.
    pub fn regex(&self) -> Result<String, StructuredError> {
        let check_len = |what, len| {
            if len == 0 {
                Err(StructuredError::Empty(what))
            } else if len > MAX_STRUCTURED_SPEC_BYTES {
                Err(StructuredError::TooLong { what, len })
            } else {
                Ok(())
            }
        };
        let regex = match self {
            Self::Regex(r) => {
                check_len("regex", r.len())?;
                r.clone()
            }
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err(StructuredError::Empty("choice list"));
                }
                if choices.len() > MAX_CHOICES {
                    return Err(StructuredError::BadChoices(format!(
                        "at most {MAX_CHOICES} choices are allowed, got {}",
                        choices.len()
                    )));
                }
                if choices.iter().any(String::is_empty) {
                    return Err(StructuredError::BadChoices(
                        "a choice is the empty string".into(),
                    ));
                }
                check_len("choice list", choices.iter().map(String::len).sum())?;
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                format!("({})", alternatives.join("|"))
            }
            Self::JsonSchema(schema) => {
                check_len("JSON schema", schema.len())?;
                // Patterns rewritten to speak of the string's JSON text (`pattern`).
                let rewritten = pattern::rewrite(schema)?;
                let schema = rewritten.as_deref().unwrap_or(schema);
                // Free-form parts marked (`free`): the guide reads them with the JSON grammar.
                let marked = free::mark(schema);
                outlines_core::json_schema::regex_from_str(
                    marked.as_deref().unwrap_or(schema),
                    None,
                    None,
                )
                .map_err(|e| StructuredError::Schema(e.to_string()))?
            }
            Self::JsonObject => return Err(StructuredError::NotRegular("any JSON object")),
            Self::Grammar(_) => return Err(StructuredError::NotRegular("a grammar")),
        };
        if free::has_marks(&regex) {
            free::bytes_regex(&regex)?;
        }
        let hir = regex_syntax::Parser::new()
            .parse(&regex)
            .map_err(|e| StructuredError::Regex(regex_error(&e)))?;
        if let Some(why) = anchors::inner_anchor(&hir) {
            return Err(StructuredError::Regex(format!("the expression {why}")));
        }
        // Anchors at the ends say what the guide does anyway, and its automaton (a start that
        // looks behind) could not be built with them: they are left out.
        let stripped = anchors::strip_ends(&hir);
        if stripped != hir {
            return Ok(stripped.to_string());
        }
        Ok(regex)
    }
}

/// The grammar of GBNF `text`, checked for size, syntax and use.
fn grammar(text: &str) -> Result<Grammar, StructuredError> {
    if text.trim().is_empty() {
        return Err(StructuredError::Empty("grammar"));
    }
    if text.len() > MAX_STRUCTURED_SPEC_BYTES {
        return Err(StructuredError::TooLong {
            what: "grammar",
            len: text.len(),
        });
    }
    Grammar::parse(text)
}

/// `schema` is `{"type": "object"}` with nothing that narrows it (see
/// [`StructuredOutput::is_any_json_object`]).
fn any_object_schema(schema: &str) -> bool {
    serde_json::from_str(schema).is_ok_and(|schema| any_object_value(&schema))
}

/// [`any_object_schema`] of a parsed schema.
fn any_object_value(schema: &serde_json::Value) -> bool {
    use serde_json::Value;
    let Value::Object(fields) = schema else {
        return false;
    };
    fields.get("type") == Some(&Value::String("object".into()))
        && fields.iter().all(|(key, value)| match key.as_str() {
            "type" | "title" | "description" | "$schema" | "$id" | "$comment" | "examples"
            | "default" => true,
            "properties" => value.as_object().is_some_and(|p| p.is_empty()),
            "required" => value.as_array().is_some_and(|r| r.is_empty()),
            "additionalProperties" => {
                value == &Value::Bool(true) || value.as_object().is_some_and(|a| a.is_empty())
            }
            _ => false,
        })
}

/// A regex error on one line (regex-syntax draws the pattern and a caret over several): what
/// is wrong and where.
fn regex_error(e: &regex_syntax::Error) -> String {
    match e {
        regex_syntax::Error::Parse(e) => format!("{} at byte {}", e.kind(), e.span().start.offset),
        regex_syntax::Error::Translate(e) => {
            format!("{} at byte {}", e.kind(), e.span().start.offset)
        }
        other => other
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// A structured output compiled over a vocabulary.
pub struct Guide {
    kind: GuideKind,
    eos_token_ids: Vec<u32>,
    /// What it weighs in a [`GuideCache`], in (state, token) transitions of about 16 bytes.
    transitions: usize,
}

enum GuideKind {
    /// A regular expression's index: every state's tokens listed ahead of time.
    Regex(Index),
    /// JSON with free-form parts (any JSON object is one such part alone): the regex's
    /// automaton, entering the JSON grammar at those parts; masks computed per state when
    /// first met.
    Free(Box<FreeJson>, Masks<FreeState>),
    /// A grammar's stack recognizer; masks computed per state when first met.
    Grammar(Box<GrammarGuide>, Masks<GrammarState>),
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Guide");
        match &self.kind {
            GuideKind::Regex(index) => d.field("states", &index.transitions().len()),
            GuideKind::Free(..) => d.field("grammar", &"JSON with free-form parts"),
            GuideKind::Grammar(g, _) => d.field("grammar", g),
        };
        d.field("transitions", &self.transitions)
            .finish_non_exhaustive()
    }
}

impl Guide {
    /// Compile `spec` over `vocabulary`.
    pub fn compile(
        spec: &StructuredOutput,
        vocabulary: &GuideVocabulary,
    ) -> Result<Self, StructuredError> {
        if let StructuredOutput::Grammar(text) = spec {
            let guide = GrammarGuide::new(grammar(text)?)?;
            let masks = Masks::new(vocabulary.trie.clone());
            let start = guide.start();
            let walker = std::cell::RefCell::new(guide.walker());
            if !walker.borrow().is_match(start)
                && masks
                    .allowed(start, |s, b| walker.borrow_mut().step(s, b), None)
                    .is_empty()
            {
                return Err(StructuredError::Vocabulary(
                    "no token starts the grammar's text".into(),
                ));
            }
            drop(walker);
            return Ok(Self {
                kind: GuideKind::Grammar(Box::new(guide), masks),
                eos_token_ids: vocabulary.eos_token_ids.clone(),
                transitions: trie::MASK_CACHE_IDS / 4,
            });
        }
        // Any JSON object is a regex of one free-form part; a schema's free-form parts are
        // marks in its regex (`free`), as are those of a regex holding a schema's.
        let regex = if spec.is_any_json_object() {
            spec.validate()?;
            free::any_object_regex()
        } else {
            spec.regex()?
        };
        let (kind, transitions) = if free::has_marks(&regex) {
            let free = FreeJson::new(&regex)?;
            let masks = Masks::new(vocabulary.trie.clone());
            if masks
                .allowed(free.start(), |s, b| free.step(s, b), None)
                .is_empty()
            {
                return Err(StructuredError::Vocabulary(
                    "no token starts the JSON".into(),
                ));
            }
            (
                GuideKind::Free(Box::new(free), masks),
                trie::MASK_CACHE_IDS / 4,
            )
        } else {
            check_states(&regex)?;
            let index = Index::new(&regex, &vocabulary.vocabulary)
                .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
            let transitions = index.transitions().values().map(|m| m.len()).sum();
            (GuideKind::Regex(index), transitions)
        };
        Ok(Self {
            kind,
            eos_token_ids: vocabulary.eos_token_ids.clone(),
            transitions,
        })
    }

    fn start(&self) -> Walk {
        match &self.kind {
            GuideKind::Regex(index) => Walk::Regex(Some(index.initial_state())),
            GuideKind::Free(free, _) => Walk::Free(Some(free.start())),
            GuideKind::Grammar(guide, _) => Walk::Grammar(Some(guide.start())),
        }
    }

    /// The walk after one more token (`None` inside once the token was not allowed).
    fn next(&self, walk: Walk, token: u32) -> Walk {
        match (&self.kind, walk) {
            (GuideKind::Regex(index), Walk::Regex(state)) => {
                Walk::Regex(state.and_then(|s| index.next_state(&s, &token)))
            }
            (GuideKind::Free(free, masks), Walk::Free(state)) => {
                let spelling = masks.trie().spelling(token);
                Walk::Free(
                    state
                        .filter(|_| !spelling.is_empty())
                        .and_then(|s| spelling.iter().try_fold(s, |s, &b| free.step(s, b))),
                )
            }
            (GuideKind::Grammar(guide, masks), Walk::Grammar(state)) => {
                let spelling = masks.trie().spelling(token);
                let mut walker = guide.walker();
                Walk::Grammar(
                    state
                        .filter(|_| !spelling.is_empty())
                        .and_then(|s| spelling.iter().try_fold(s, |s, &b| walker.step(s, b))),
                )
            }
            _ => unreachable!("a walk is started by its own guide"),
        }
    }

    /// The ids allowed after `walk`, each once (unsorted: inside a JSON string nearly the
    /// whole vocabulary is allowed, and sorting it every step would cost more than the
    /// mask): the tokens that keep the text a prefix of a match, and every EOS id where it
    /// is a whole match. Off the guide (`None`), or where nothing can follow (a vocabulary
    /// that cannot spell what the grammar needs next), only EOS. A kept mask is lent, not
    /// copied (up to the whole vocabulary, every step).
    fn allowed(&self, walk: Walk, out: &mut Vec<u32>) -> Option<Arc<[u32]>> {
        out.clear();
        match (&self.kind, walk) {
            (GuideKind::Regex(index), Walk::Regex(Some(state))) => {
                if let Some(tokens) = index.allowed_tokens_iter(&state) {
                    out.extend(tokens.copied());
                }
                if index.is_final_state(&state) {
                    // The index lists the first EOS id itself.
                    let first = self.eos_token_ids[0];
                    out.extend(self.eos_token_ids.iter().filter(|&&id| id != first));
                }
            }
            (GuideKind::Free(free, masks), Walk::Free(Some(state))) => {
                let in_string = state
                    .in_plain_string()
                    .then_some(json::stays_in_string as _);
                let mask = masks.allowed(state, |s, b| free.step(s, b), in_string);
                if !free.is_match(state) && !mask.is_empty() {
                    return Some(mask);
                }
                out.extend_from_slice(&mask);
                out.extend_from_slice(&self.eos_token_ids);
            }
            (GuideKind::Grammar(guide, masks), Walk::Grammar(Some(state))) => {
                let walker = std::cell::RefCell::new(guide.walker());
                let mask = masks.allowed(state, |s, b| walker.borrow_mut().step(s, b), None);
                if walker.borrow().exhausted() {
                    // Once per state: what the walk could not afford stays refused.
                    tracing::warn!(
                        budget = MAX_WALK_WORK,
                        "a grammar too ambiguous to follow within the walk budget: this \
                         state's tokens were cut short"
                    );
                }
                if !walker.borrow().is_match(state) && !mask.is_empty() {
                    return Some(mask);
                }
                out.extend_from_slice(&mask);
                out.extend_from_slice(&self.eos_token_ids);
            }
            _ => {}
        }
        if out.is_empty() {
            out.extend_from_slice(&self.eos_token_ids);
        }
        None
    }
}

/// Where a request's output stands in its guide: a regex index's state, the free-form JSON
/// recognizer's or a grammar's, `None` once the output left the guide (a token it did not allow: only
/// possible when other processors masked every allowed one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Walk {
    Regex(Option<u32>),
    Free(Option<FreeState>),
    Grammar(Option<GrammarState>),
}

/// One request's walk through its guide: the state after the output so far (public so that
/// tests and fuzzing outside the crate can walk a guide as the sampler does).
#[derive(Debug)]
pub struct GuideState {
    guide: Arc<Guide>,
    /// Off the guide, only EOS is allowed.
    walk: Walk,
    /// Output tokens walked so far.
    consumed: usize,
    /// The ids `walk` allows (a kept mask when `lent`, else `ids`), and the walk they were
    /// listed for (`None` before the first listing): a step asks twice (the backend's plan,
    /// then the host's sampler when the plan is refused), and listing is a pass over up to
    /// the vocabulary.
    ids: Vec<u32>,
    lent: Option<Arc<[u32]>>,
    ids_for: Option<Walk>,
}

impl GuideState {
    /// A walk at the start of `guide`.
    pub fn new(guide: Arc<Guide>) -> Self {
        let walk = guide.start();
        Self {
            guide,
            walk,
            consumed: 0,
            ids: Vec::new(),
            lent: None,
            ids_for: None,
        }
    }

    /// The ids the last [`GuideState::allowed`] listed.
    pub(crate) fn ids(&self) -> &[u32] {
        self.lent.as_deref().unwrap_or(&self.ids)
    }

    /// The ids allowed after `output_tokens`, each once (unsorted). Walks only the tokens
    /// not walked before; an output shorter than before (a request restarted from scratch)
    /// is walked again from the start.
    pub fn allowed(&mut self, output_tokens: &[u32]) -> &[u32] {
        if output_tokens.len() < self.consumed {
            self.walk = self.guide.start();
            self.consumed = 0;
        }
        for &t in &output_tokens[self.consumed..] {
            self.walk = self.guide.next(self.walk, t);
        }
        self.consumed = output_tokens.len();
        if self.ids_for != Some(self.walk) {
            self.lent = self.guide.allowed(self.walk, &mut self.ids);
            self.ids_for = Some(self.walk);
        }
        self.ids()
    }
}

#[cfg(test)]
mod tests;
