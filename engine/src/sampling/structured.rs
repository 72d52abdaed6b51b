//! Structured outputs (vLLM's `structured_outputs` / guided decoding): a request may ask that
//! its text match a regular expression, be one of a list of choices, or be JSON that a schema
//! accepts. Each becomes a regular expression ([`StructuredOutput::regex`]; JSON schemas
//! through outlines-core's converter), compiled once into an index over the tokenizer's
//! vocabulary ([`Guide`]: for every state of the expression's automaton, the tokens that keep
//! the text a prefix of a match and the state each leads to). The sampler then allows only
//! those tokens each step, and EOS only where the text is a whole match
//! (`GuideState`).
//!
//! Owns the specification, its compilation and the per-request walk; not the masking itself
//! (the sampler applies the allowed ids as it applies `allowed_token_ids`, on the host or as
//! per-id edits on a backend). Compiling takes from milliseconds (a short regex) to seconds
//! (a large schema over Qwen3's 151k tokens), so nodes compile off their async threads and
//! keep compiled guides in a [`GuideCache`].

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use outlines_core::index::Index;
use outlines_core::vocabulary::Vocabulary;
use serde::{Deserialize, Serialize};

/// Longest regex or JSON schema a request may carry (bytes).
pub const MAX_STRUCTURED_SPEC_BYTES: usize = 16 * 1024;
/// Most choices a request may list.
pub const MAX_CHOICES: usize = 256;
/// Compiled guides a [`GuideCache`] keeps (the least recently used goes first)...
const GUIDE_CACHE_ENTRIES: usize = 64;
/// ...and the (state, token) transitions they may hold together, about 16 bytes each: a state
/// inside a JSON string allows nearly every token, 151k transitions for Qwen3. The newest
/// guide stays whatever its size.
const GUIDE_CACHE_TRANSITIONS: usize = 16 << 20;
/// Most states a guide's automaton may have. Compiling walks the whole vocabulary from each
/// state (about 6 ms per state for Qwen3's 151k tokens on a 2-core build machine), and a
/// bounded repetition of an alternation multiplies states (`[ab]*a[ab]{10}` has 4,097): the
/// cap keeps one request from holding a node's compile thread for minutes.
pub const MAX_GUIDE_STATES: usize = 1024;
/// Memory the regex's determinization may use before it is refused (its own cap, before the
/// states are counted).
const DFA_BUILD_LIMIT: usize = 32 << 20;

/// What the output must look like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StructuredOutput {
    /// The whole output text matches this regular expression (Rust `regex` syntax, anchored
    /// at both ends).
    Regex(String),
    /// The output text is exactly one of these strings.
    Choice(Vec<String>),
    /// The output text is JSON accepted by this JSON schema (the subset outlines supports:
    /// types, properties, required, enum, const, arrays, nesting, `$ref` within the schema).
    JsonSchema(String),
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
    /// The expression cannot be compiled over this vocabulary (for example a character no
    /// token can spell).
    #[error("structured output: cannot be generated with this model's vocabulary: {0}")]
    Vocabulary(String),
}

impl StructuredOutput {
    /// The regular expression the output must match. Checks sizes and syntax (cheap: what
    /// the router checks before routing); compiling over a vocabulary is [`Guide::compile`].
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
                outlines_core::json_schema::regex_from_str(schema, None, None)
                    .map_err(|e| StructuredError::Schema(e.to_string()))?
            }
        };
        regex_syntax::Parser::new()
            .parse(&regex)
            .map_err(|e| StructuredError::Regex(regex_error(&e)))?;
        Ok(regex)
    }
}

/// Refuses a regex whose automaton has more than [`MAX_GUIDE_STATES`] states (counted over
/// bytes from the anchored start, as the index walks it), before the costly index is built.
fn check_states(regex: &str) -> Result<(), StructuredError> {
    use regex_automata::Anchored;
    use regex_automata::dfa::{Automaton, dense};
    let too_complex = || {
        StructuredError::TooComplex(format!(
            "the expression's automaton has more than {MAX_GUIDE_STATES} states (a bounded \
             repetition such as {{20}} of an alternation multiplies them); simplify it"
        ))
    };
    let dfa = dense::Builder::new()
        .configure(
            dense::Config::new()
                .determinize_size_limit(Some(DFA_BUILD_LIMIT))
                .dfa_size_limit(Some(DFA_BUILD_LIMIT)),
        )
        .build(regex)
        .map_err(|_| too_complex())?;
    let start = dfa
        .universal_start_state(Anchored::Yes)
        .ok_or_else(|| StructuredError::Regex("the expression has no single start".into()))?;
    let mut seen = std::collections::HashSet::from([start]);
    let mut todo = vec![start];
    while let Some(state) = todo.pop() {
        for byte in 0..=255u8 {
            let next = dfa.next_state(state, byte);
            if !dfa.is_dead_state(next) && !dfa.is_quit_state(next) && seen.insert(next) {
                if seen.len() > MAX_GUIDE_STATES {
                    return Err(too_complex());
                }
                todo.push(next);
            }
        }
    }
    Ok(())
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

/// A tokenizer's vocabulary as guides see it: every ordinary token's bytes (special tokens
/// are never part of a structured output), and the ids that end a sequence.
pub struct GuideVocabulary {
    vocabulary: Vocabulary,
    eos_token_ids: Vec<u32>,
}

impl GuideVocabulary {
    /// From `(id, bytes)` of each ordinary token and the model's EOS ids (at least one).
    pub fn new<'a>(
        tokens: impl IntoIterator<Item = (u32, &'a [u8])>,
        eos_token_ids: &[u32],
    ) -> Result<Self, StructuredError> {
        let &first_eos = eos_token_ids.first().ok_or_else(|| {
            StructuredError::Vocabulary("the model has no EOS token to end a match".into())
        })?;
        let mut vocabulary = Vocabulary::new(first_eos);
        for (id, bytes) in tokens {
            if !bytes.is_empty() && !eos_token_ids.contains(&id) {
                vocabulary
                    .try_insert(bytes.to_vec(), id)
                    .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
            }
        }
        // Each once, the index's own EOS id first (`Guide::allowed` relies on it).
        let mut unique = Vec::with_capacity(eos_token_ids.len());
        for &id in eos_token_ids {
            if !unique.contains(&id) {
                unique.push(id);
            }
        }
        let eos_token_ids = unique;
        Ok(Self {
            vocabulary,
            eos_token_ids,
        })
    }

    /// A tokenizer's ordinary tokens, ended by the model's EOS ids.
    pub fn from_tokenizer(
        tokenizer: &crate::tokenizer::Tokenizer,
        eos_token_ids: &[u32],
    ) -> Result<Self, StructuredError> {
        Self::new(tokenizer.ordinary_tokens(), eos_token_ids)
    }
}

/// A structured output compiled over a vocabulary.
pub struct Guide {
    index: Index,
    eos_token_ids: Vec<u32>,
    /// (state, token) pairs in the index: what it weighs.
    transitions: usize,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("states", &self.index.transitions().len())
            .field("transitions", &self.transitions)
            .finish_non_exhaustive()
    }
}

impl Guide {
    /// Compile `spec` over `vocabulary`.
    pub fn compile(
        spec: &StructuredOutput,
        vocabulary: &GuideVocabulary,
    ) -> Result<Self, StructuredError> {
        let regex = spec.regex()?;
        check_states(&regex)?;
        let index = Index::new(&regex, &vocabulary.vocabulary)
            .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
        let transitions = index.transitions().values().map(|m| m.len()).sum();
        Ok(Self {
            index,
            eos_token_ids: vocabulary.eos_token_ids.clone(),
            transitions,
        })
    }

    /// The ids allowed after `state`, each once, in the index's order (unsorted: inside a
    /// JSON string nearly the whole vocabulary is allowed, and sorting it every step would
    /// cost more than the mask): the tokens that keep the text a prefix of a match, and
    /// every EOS id where it is a whole match.
    fn allowed(&self, state: u32, out: &mut Vec<u32>) {
        out.clear();
        if let Some(tokens) = self.index.allowed_tokens_iter(&state) {
            out.extend(tokens.copied());
        }
        if self.index.is_final_state(&state) {
            // The index lists the first EOS id itself.
            out.extend(
                self.eos_token_ids
                    .iter()
                    .filter(|&&id| id != self.index_eos()),
            );
        }
    }

    fn index_eos(&self) -> u32 {
        self.eos_token_ids[0]
    }
}

/// One request's walk through its guide: the state after the output so far.
#[derive(Debug)]
pub(crate) struct GuideState {
    guide: Arc<Guide>,
    /// `None` once the output left the guide (a token it did not allow: only possible when
    /// other processors masked every allowed one). Then only EOS is allowed.
    state: Option<u32>,
    /// Output tokens walked so far.
    consumed: usize,
    /// The ids `state` allows, and the state they were listed for (`Some(state)`; `None`
    /// before the first listing): a step asks twice (the backend's plan, then the host's
    /// sampler when the plan is refused), and listing is a pass over up to the vocabulary.
    ids: Vec<u32>,
    ids_for: Option<Option<u32>>,
}

impl GuideState {
    pub(crate) fn new(guide: Arc<Guide>) -> Self {
        let state = Some(guide.index.initial_state());
        Self {
            guide,
            state,
            consumed: 0,
            ids: Vec::new(),
            ids_for: None,
        }
    }

    /// The ids the last [`GuideState::allowed`] listed.
    pub(crate) fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The ids allowed after `output_tokens`, each once (unsorted). Walks only the tokens
    /// not walked before; an output shorter than before (a request restarted from scratch)
    /// is walked again from the start.
    pub(crate) fn allowed(&mut self, output_tokens: &[u32]) -> &[u32] {
        if output_tokens.len() < self.consumed {
            self.state = Some(self.guide.index.initial_state());
            self.consumed = 0;
        }
        for &t in &output_tokens[self.consumed..] {
            self.state = self.state.and_then(|s| self.guide.index.next_state(&s, &t));
        }
        self.consumed = output_tokens.len();
        if self.ids_for != Some(self.state) {
            match self.state {
                Some(s) => self.guide.allowed(s, &mut self.ids),
                None => {
                    self.ids.clear();
                    self.ids.extend_from_slice(&self.guide.eos_token_ids);
                }
            }
            self.ids_for = Some(self.state);
        }
        &self.ids
    }
}

/// Compiled guides by specification, shared by a node's requests: the same schema sent
/// again is not compiled again. The vocabulary is built on first use (a request without a
/// structured output never pays for it).
pub struct GuideCache {
    vocabulary: OnceLock<Result<GuideVocabulary, StructuredError>>,
    make_vocabulary: Box<dyn Fn() -> Result<GuideVocabulary, StructuredError> + Send + Sync>,
    entries: Mutex<Vec<(StructuredOutput, Arc<Guide>)>>,
}

impl std::fmt::Debug for GuideCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuideCache").finish_non_exhaustive()
    }
}

impl GuideCache {
    /// Guides over `tokenizer`'s ordinary tokens, ended by `eos_token_ids`.
    pub fn new(tokenizer: crate::tokenizer::Tokenizer, eos_token_ids: Vec<u32>) -> Self {
        Self::with_vocabulary(move || GuideVocabulary::from_tokenizer(&tokenizer, &eos_token_ids))
    }

    /// Guides over the vocabulary `make` builds (when the first guide is compiled).
    pub fn with_vocabulary(
        make: impl Fn() -> Result<GuideVocabulary, StructuredError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            vocabulary: OnceLock::new(),
            make_vocabulary: Box::new(make),
            entries: Mutex::new(Vec::new()),
        }
    }

    /// The guide of `spec`, compiled now (blocking: up to seconds for a large schema) or
    /// found.
    pub fn get(&self, spec: &StructuredOutput) -> Result<Arc<Guide>, StructuredError> {
        {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = entries.iter().position(|(s, _)| s == spec) {
                // Most recently used last.
                let entry = entries.remove(i);
                let guide = entry.1.clone();
                entries.push(entry);
                return Ok(guide);
            }
        }
        let vocabulary = self
            .vocabulary
            .get_or_init(|| (self.make_vocabulary)())
            .as_ref()
            .map_err(Clone::clone)?;
        // Not under the lock: other specifications are served meanwhile; two requests
        // compiling the same one at once keep one result.
        let guide = Arc::new(Guide::compile(spec, vocabulary)?);
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if !entries.iter().any(|(s, _)| s == spec) {
            entries.push((spec.clone(), guide.clone()));
            let weight = |entries: &[(StructuredOutput, Arc<Guide>)]| {
                entries.iter().map(|(_, g)| g.transitions).sum::<usize>()
            };
            while entries.len() > 1
                && (entries.len() > GUIDE_CACHE_ENTRIES
                    || weight(&entries) > GUIDE_CACHE_TRANSITIONS)
            {
                entries.remove(0);
            }
        }
        Ok(guide)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 100;
    const EOS2: u32 = 101;

    fn vocabulary() -> GuideVocabulary {
        let tokens: Vec<(u32, &[u8])> = vec![
            (0, b"0"),
            (1, b"1"),
            (2, b"2"),
            (3, b"12"),
            (4, b"a"),
            (5, b"yes"),
            (6, b"no"),
            (7, b"y"),
            (8, b"es"),
            (9, b"{"),
            (10, b"}"),
            (11, b"\""),
            (12, b":"),
            (13, b" "),
            (14, b"n"),
            (15, b"x"),
            (16, b","),
            (17, b"+"),
            (18, b"o"),
        ];
        GuideVocabulary::new(tokens, &[EOS, EOS2]).unwrap()
    }

    fn walk(spec: StructuredOutput, output: &[u32]) -> Vec<u32> {
        let guide = Arc::new(Guide::compile(&spec, &vocabulary()).unwrap());
        let mut state = GuideState::new(guide);
        let mut out = state.allowed(output).to_vec();
        out.sort_unstable();
        out
    }

    #[test]
    fn a_regex_allows_the_tokens_that_continue_a_match_and_eos_only_at_a_whole_one() {
        let digits = || StructuredOutput::Regex("[0-9]{2}".into());
        assert_eq!(walk(digits(), &[]), vec![0, 1, 2, 3]);
        // One digit out: one more, and "12" would overshoot.
        assert_eq!(walk(digits(), &[1]), vec![0, 1, 2]);
        assert_eq!(walk(digits(), &[3]), vec![EOS, EOS2]);
        assert_eq!(walk(digits(), &[1, 2]), vec![EOS, EOS2]);
        // A token the guide did not allow (other processors masked the rest): only EOS.
        assert_eq!(walk(digits(), &[4]), vec![EOS, EOS2]);
    }

    #[test]
    fn choices_are_spelled_whole_in_any_tokenization_and_literally() {
        let spec = || StructuredOutput::Choice(vec!["yes".into(), "no".into(), "1+".into()]);
        assert_eq!(walk(spec(), &[]), vec![1, 5, 6, 7, 14]);
        assert_eq!(walk(spec(), &[7]), vec![8]);
        assert_eq!(walk(spec(), &[7, 8]), vec![EOS, EOS2]);
        assert_eq!(walk(spec(), &[5]), vec![EOS, EOS2]);
        // "1+" is the two characters, not "one or more 1".
        assert_eq!(walk(spec(), &[1]), vec![17]);
    }

    #[test]
    fn a_walk_resumes_where_it_stopped_and_restarts_on_a_shorter_output() {
        let guide = Arc::new(
            Guide::compile(&StructuredOutput::Regex("1+0".into()), &vocabulary()).unwrap(),
        );
        let mut state = GuideState::new(guide);
        let mut sorted = |output: &[u32]| {
            let mut ids = state.allowed(output).to_vec();
            ids.sort_unstable();
            ids
        };
        assert_eq!(sorted(&[1]), vec![0, 1]);
        assert_eq!(sorted(&[1, 1, 0]), vec![EOS, EOS2]);
        assert_eq!(sorted(&[]), vec![1]);
        // Asked again for the same output: the same list.
        assert_eq!(sorted(&[]), vec![1]);
    }

    #[test]
    fn a_json_schema_becomes_a_regex_the_guide_walks() {
        let schema =
            r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#;
        let spec = StructuredOutput::JsonSchema(schema.into());
        let regex = spec.regex().unwrap();
        let matcher = regex::Regex::new(&format!("^(?:{regex})$")).unwrap();
        assert!(matcher.is_match(r#"{"n":12}"#));
        assert!(!matcher.is_match(r#"{"m":12}"#));
        assert_eq!(walk(spec, &[]), vec![9]);
    }

    #[test]
    fn bad_specifications_are_refused_with_what_is_wrong() {
        let err = |s: StructuredOutput| s.regex().unwrap_err().to_string();
        assert!(err(StructuredOutput::Regex(String::new())).contains("regex is empty"));
        assert_eq!(
            err(StructuredOutput::Regex("ab[0-9".into())),
            "structured output: invalid regex: unclosed character class at byte 2"
        );
        assert!(
            err(StructuredOutput::Regex(
                "a".repeat(MAX_STRUCTURED_SPEC_BYTES + 1)
            ))
            .contains("more than")
        );
        assert!(err(StructuredOutput::Choice(vec![])).contains("choice list is empty"));
        assert!(err(StructuredOutput::Choice(vec!["".into()])).contains("empty string"));
        assert!(err(StructuredOutput::JsonSchema("{".into())).contains("invalid JSON schema"));
        assert!(
            err(StructuredOutput::JsonSchema(
                r#"{"type": "no-such-type"}"#.into()
            ))
            .contains("invalid JSON schema")
        );
        // A state explosion is refused before the vocabulary is walked.
        let e = Guide::compile(
            &StructuredOutput::Regex("[ab]*a[ab]{10}".into()),
            &vocabulary(),
        )
        .unwrap_err();
        assert!(matches!(e, StructuredError::TooComplex(_)), "{e}");
        assert!(e.to_string().contains("more than 1024 states"), "{e}");
        Guide::compile(
            &StructuredOutput::Regex("[ab]*a[ab]{7}".into()),
            &vocabulary(),
        )
        .unwrap();
        // Parses, but no token spells a "z".
        let e = Guide::compile(&StructuredOutput::Regex("z".into()), &vocabulary()).unwrap_err();
        assert!(matches!(e, StructuredError::Vocabulary(_)), "{e}");
    }

    #[test]
    fn the_sampler_chooses_only_what_the_guide_allows_on_the_host_and_on_a_backend() {
        use crate::sampling::device::{DeviceSampleRow, sample_row};
        use crate::sampling::{Sampler, SamplingParams};

        let guide = Arc::new(
            Guide::compile(&StructuredOutput::Regex("[0-9]{2}".into()), &vocabulary()).unwrap(),
        );
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        // What the model would rather say: "a", "yes" and EOS.
        let mut logits = vec![0.0f32; 102];
        for id in [4, 5, EOS] {
            logits[id as usize] = 12.0;
        }
        let mut lengths = [0usize; 3];
        for seed in 0..24 {
            let mut host = Sampler::new(&params, seed, &[EOS, EOS2]).with_guide(guide.clone());
            let mut dev = Sampler::new(&params, seed, &[EOS, EOS2]).with_guide(guide.clone());
            let mut output = Vec::new();
            loop {
                let token = host.sample(&logits, &[], &output).token_id;
                let plan = dev.device_plan(&[], &output, logits.len()).expect("a plan");
                let reshape = plan.reshape.as_ref().expect("the guide's edits");
                assert!(reshape.allowed_only);
                let sample = sample_row(&logits, &DeviceSampleRow::planned(0, &plan));
                assert_eq!(
                    dev.accept(sample).token_id,
                    token,
                    "seed {seed}: same token"
                );
                if token == EOS || token == EOS2 {
                    break;
                }
                assert!(
                    [0, 1, 2, 3].contains(&token),
                    "seed {seed}: {token} is no digit"
                );
                output.push(token);
            }
            // Two digits, spelt as "1" "2" or as "12": then EOS, never before.
            let digits: usize = output.iter().map(|&t| if t == 3 { 2 } else { 1 }).sum();
            assert_eq!(digits, 2, "seed {seed}: {output:?}");
            lengths[output.len()] += 1;
        }
        // Both spellings were drawn.
        assert!(lengths[1] > 0 && lengths[2] > 0, "{lengths:?}");
    }

    #[test]
    fn a_cache_compiles_each_specification_once() {
        let cache = GuideCache::with_vocabulary(|| Ok(vocabulary()));
        let a = cache.get(&StructuredOutput::Regex("1+".into())).unwrap();
        let b = cache.get(&StructuredOutput::Regex("1+".into())).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = cache.get(&StructuredOutput::Regex("0+".into())).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        // The least recently used goes once the cache is full; the one just used stays.
        for n in 0..GUIDE_CACHE_ENTRIES {
            cache
                .get(&StructuredOutput::Regex(format!("1{{{}}}", n + 1)))
                .unwrap();
            cache.get(&StructuredOutput::Regex("0+".into())).unwrap();
        }
        assert!(Arc::ptr_eq(
            &c,
            &cache.get(&StructuredOutput::Regex("0+".into())).unwrap()
        ));
        assert!(!Arc::ptr_eq(
            &a,
            &cache.get(&StructuredOutput::Regex("1+".into())).unwrap()
        ));
    }
}
