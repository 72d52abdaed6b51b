//! Free-form JSON (`json_object`): a recognizer that reads a text byte by byte and says, after
//! each byte, whether the text is still the start of a JSON object, and when it is a whole one.
//! Any JSON object nests without bound, which no regular expression (what the other guides
//! are) can hold; the recognizer keeps the open objects and arrays on a stack instead.
//!
//! Its state is small and `Copy` (the stack is a bit per level), so the vocabulary trie can
//! branch it per byte and masks can be cached by state (`super::trie`). Owns the grammar; not
//! the token masks.
//!
//! The language is RFC 8259's JSON with three limits a sampler needs and a reader never
//! misses: the text is one object with nothing before or after it, a run of whitespace is at
//! most [`MAX_WHITESPACE_RUN`] bytes (a model in JSON mode can otherwise loop on blank lines
//! forever), and nesting is at most [`MAX_DEPTH`] levels. Strings are valid UTF-8 and `\u`
//! escapes pair their surrogates, so the text always parses as Rust's and Python's JSON does.

/// Deepest nesting of objects and arrays (one bit each in `JsonState`; serde_json reads
/// at most 127).
pub const MAX_DEPTH: u8 = 127;
/// Longest run of whitespace between two tokens of the JSON text: room for indentation 30
/// levels deep, not for an endless run of blank lines.
pub const MAX_WHITESPACE_RUN: u8 = 64;

/// Where a text stands in the grammar. Two texts in the same state accept the same endings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct JsonState {
    /// Bit i: level i (0 the outermost) is an object, else an array. Bits at and past
    /// `depth` are 0, so equal states compare equal.
    containers: u128,
    /// Open objects and arrays.
    depth: u8,
    /// Whitespace bytes in the current run.
    whitespace: u8,
    lex: Lex,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Lex {
    /// Nothing yet: only `{`.
    Start,
    /// Nothing yet: any value, no whitespace before it ([`JsonState::VALUE`]).
    StartValue,
    /// Nothing yet: only `[` ([`JsonState::ARRAY`]).
    StartArray,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    ObjectKey,
    /// After a key: `:`.
    Colon,
    /// After `:`, or `,` in an array: a value.
    Value,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After a value: `,` or the innermost container's closer.
    AfterValue,
    /// Inside a string (a key or a value).
    String {
        key: bool,
        part: StringPart,
    },
    Number(Number),
    /// Inside `true`, `false` or `null` (index into [`LITERALS`]), `at` bytes read.
    Literal {
        word: u8,
        at: u8,
    },
    /// The object (or the value) is closed: only the end of the text.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum StringPart {
    /// Between characters.
    Plain,
    /// After `\`.
    Escape,
    /// Inside `\uXXXX` with `left` hex digits to go; `class` is what the digits read so far
    /// say about a surrogate; `low` when this escape must be a low surrogate (it follows a
    /// high one).
    Hex {
        left: u8,
        class: Surrogate,
        low: bool,
    },
    /// After a high surrogate's escape: `\` then `u` of its low half (`u` when `seen_backslash`).
    PairNext { seen_backslash: bool },
    /// Inside a UTF-8 sequence: `left` continuation bytes to go, the next in `lo..=hi`.
    Utf8 { left: u8, lo: u8, hi: u8 },
}

/// What the hex digits of a `\u` escape read so far say about the code unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Surrogate {
    /// Not a surrogate whatever follows.
    No,
    /// First digit `D`: the second decides.
    MaybeD,
    /// D800-DBFF.
    High,
    /// DC00-DFFF.
    Low,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Number {
    /// `-`: a digit must follow.
    Minus,
    /// A leading `0`: no more integer digits.
    Zero,
    Int,
    /// `.`: a digit must follow.
    Dot,
    Fraction,
    /// `e` / `E`: a sign or a digit must follow.
    Exponent,
    /// The exponent's sign: a digit must follow.
    ExponentSign,
    ExponentDigits,
}

const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

impl Number {
    fn next(self, b: u8) -> Option<Self> {
        use Number::*;
        let digit = b.is_ascii_digit();
        Some(match (self, b) {
            (Minus, b'0') => Zero,
            (Minus, _) if digit => Int,
            (Int, _) if digit => Int,
            (Zero | Int, b'.') => Dot,
            (Dot | Fraction, _) if digit => Fraction,
            (Zero | Int | Fraction, b'e' | b'E') => Exponent,
            (Exponent, b'+' | b'-') => ExponentSign,
            (Exponent | ExponentSign | ExponentDigits, _) if digit => ExponentDigits,
            _ => return None,
        })
    }

    /// A number may end here.
    fn whole(self) -> bool {
        matches!(
            self,
            Number::Zero | Number::Int | Number::Fraction | Number::ExponentDigits
        )
    }
}

impl JsonState {
    /// Before the first byte.
    pub(crate) const START: Self = Self {
        containers: 0,
        depth: 0,
        whitespace: 0,
        lex: Lex::Start,
    };

    /// Before the first byte of any JSON value (a free-form part of a schema), not only an
    /// object.
    pub(crate) const VALUE: Self = Self {
        containers: 0,
        depth: 0,
        whitespace: 0,
        lex: Lex::StartValue,
    };

    /// Before the first byte of any JSON array (a free-form array of a schema).
    pub(crate) const ARRAY: Self = Self {
        containers: 0,
        depth: 0,
        whitespace: 0,
        lex: Lex::StartArray,
    };

    /// Inside a string, between characters: what may follow depends on the surroundings
    /// only through a closing quote or an escape ([`stays_in_string`]).
    pub(crate) fn in_plain_string(&self) -> bool {
        matches!(
            self.lex,
            Lex::String {
                part: StringPart::Plain,
                ..
            }
        )
    }

    /// The text so far is one whole JSON object (or value), closed: nothing may follow.
    pub(crate) fn is_complete(&self) -> bool {
        self.lex == Lex::Done
    }

    /// The text so far is one whole value, though it may go on (a number at the top
    /// level: `1` may become `12`).
    pub(crate) fn can_end(&self) -> bool {
        match self.lex {
            Lex::Done => true,
            Lex::Number(n) => self.depth == 0 && n.whole(),
            _ => false,
        }
    }

    /// The state after `bytes`, or `None` if the text can no longer become a JSON object.
    pub(crate) fn walk(self, bytes: &[u8]) -> Option<Self> {
        bytes.iter().try_fold(self, |s, &b| s.step(b))
    }

    /// The state after one more byte, or `None` if the text can no longer become a JSON
    /// object.
    pub(crate) fn step(self, b: u8) -> Option<Self> {
        match self.lex {
            Lex::String { key, part } => self.string(key, part, b),
            Lex::Number(n) => match n.next(b) {
                Some(n) => Some(self.with(Lex::Number(n))),
                // The byte that ends a number belongs to what follows it.
                None if n.whole() => self.ended().structural(b),
                None => None,
            },
            Lex::Literal { word, at } => {
                let spelling = LITERALS[word as usize];
                (spelling[at as usize] == b).then(|| {
                    if at as usize + 1 == spelling.len() {
                        self.ended()
                    } else {
                        self.with(Lex::Literal { word, at: at + 1 })
                    }
                })
            }
            _ => self.structural(b),
        }
    }

    fn with(mut self, lex: Lex) -> Self {
        self.lex = lex;
        self
    }

    /// A value just ended: what follows it in its container, or nothing at the top level.
    fn ended(self) -> Self {
        self.with(if self.depth == 0 {
            Lex::Done
        } else {
            Lex::AfterValue
        })
    }

    fn top_is_object(&self) -> bool {
        self.depth > 0 && self.containers & (1 << (self.depth - 1)) != 0
    }

    /// A byte between tokens: whitespace, punctuation or the first byte of a value.
    fn structural(mut self, b: u8) -> Option<Self> {
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            if matches!(
                self.lex,
                Lex::Start | Lex::StartValue | Lex::StartArray | Lex::Done
            ) || self.whitespace >= MAX_WHITESPACE_RUN
            {
                return None;
            }
            self.whitespace += 1;
            return Some(self);
        }
        self.whitespace = 0;
        match (self.lex, b) {
            (Lex::Start, b'{') => self.push(true),
            (Lex::StartArray, b'[') => self.push(false),
            (Lex::ObjectFirst | Lex::AfterValue, b'}') => self.pop(true),
            (Lex::ArrayFirst | Lex::AfterValue, b']') => self.pop(false),
            (Lex::ObjectFirst | Lex::ObjectKey, b'"') => Some(self.with(Lex::String {
                key: true,
                part: StringPart::Plain,
            })),
            (Lex::Colon, b':') => Some(self.with(Lex::Value)),
            (Lex::AfterValue, b',') => Some(self.with(if self.top_is_object() {
                Lex::ObjectKey
            } else {
                Lex::Value
            })),
            (Lex::Value | Lex::ArrayFirst | Lex::StartValue, _) => self.value(b),
            _ => None,
        }
    }

    /// The first byte of a value.
    fn value(self, b: u8) -> Option<Self> {
        let literal = |word| Lex::Literal { word, at: 1 };
        Some(self.with(match b {
            b'{' => return self.push(true),
            b'[' => return self.push(false),
            b'"' => Lex::String {
                key: false,
                part: StringPart::Plain,
            },
            b'-' => Lex::Number(Number::Minus),
            b'0' => Lex::Number(Number::Zero),
            b'1'..=b'9' => Lex::Number(Number::Int),
            b't' => literal(0),
            b'f' => literal(1),
            b'n' => literal(2),
            _ => return None,
        }))
    }

    fn push(mut self, object: bool) -> Option<Self> {
        if self.depth >= MAX_DEPTH {
            return None;
        }
        if object {
            self.containers |= 1 << self.depth;
        }
        self.depth += 1;
        Some(self.with(if object {
            Lex::ObjectFirst
        } else {
            Lex::ArrayFirst
        }))
    }

    fn pop(mut self, object: bool) -> Option<Self> {
        if self.depth == 0 || self.top_is_object() != object {
            return None;
        }
        self.depth -= 1;
        self.containers &= !(1 << self.depth);
        Some(self.ended())
    }

    fn string(self, key: bool, part: StringPart, b: u8) -> Option<Self> {
        use StringPart::*;
        let utf8 = |left, lo, hi| Utf8 { left, lo, hi };
        let part = match part {
            Plain => match b {
                b'"' => {
                    return Some(if key {
                        self.with(Lex::Colon)
                    } else {
                        self.ended()
                    });
                }
                b'\\' => Escape,
                0x20..=0x7F => Plain,
                // UTF-8's well-formed sequences (Unicode 3.9, table 3-7): no overlong forms,
                // no surrogates, nothing past U+10FFFF.
                0xC2..=0xDF => utf8(1, 0x80, 0xBF),
                0xE0 => utf8(2, 0xA0, 0xBF),
                0xE1..=0xEC | 0xEE..=0xEF => utf8(2, 0x80, 0xBF),
                0xED => utf8(2, 0x80, 0x9F),
                0xF0 => utf8(3, 0x90, 0xBF),
                0xF1..=0xF3 => utf8(3, 0x80, 0xBF),
                0xF4 => utf8(3, 0x80, 0x8F),
                // Control characters must be escaped; the rest cannot start a character.
                _ => return None,
            },
            Utf8 { left, lo, hi } => {
                if !(lo..=hi).contains(&b) {
                    return None;
                }
                if left == 1 {
                    Plain
                } else {
                    utf8(left - 1, 0x80, 0xBF)
                }
            }
            Escape => match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Plain,
                b'u' => Hex {
                    left: 4,
                    class: Surrogate::No,
                    low: false,
                },
                _ => return None,
            },
            PairNext { seen_backslash } => match (seen_backslash, b) {
                (false, b'\\') => PairNext {
                    seen_backslash: true,
                },
                (true, b'u') => Hex {
                    left: 4,
                    class: Surrogate::No,
                    low: true,
                },
                _ => return None,
            },
            Hex { left, class, low } => {
                if !b.is_ascii_hexdigit() {
                    return None;
                }
                let digit = b.to_ascii_uppercase();
                let class = match (left, class) {
                    (4, _) if digit == b'D' => Surrogate::MaybeD,
                    (3, Surrogate::MaybeD) => match digit {
                        b'8'..=b'B' => Surrogate::High,
                        b'C'..=b'F' => Surrogate::Low,
                        _ => Surrogate::No,
                    },
                    (4, _) => Surrogate::No,
                    (_, class) => class,
                };
                // Refused at the first digit that rules the escape out, never later: a
                // sampler must not be led into an escape that no digit can finish.
                let wrong = match (low, left) {
                    // The low half of a pair: DC00-DFFF.
                    (true, 4) => class != Surrogate::MaybeD,
                    (true, 3) => class != Surrogate::Low,
                    // A low half alone.
                    (false, 3) => class == Surrogate::Low,
                    _ => false,
                };
                if wrong {
                    return None;
                }
                if left > 1 {
                    Hex {
                        left: left - 1,
                        class,
                        low,
                    }
                } else {
                    match (low, class) {
                        (true, Surrogate::Low) => Plain,
                        (false, Surrogate::High) => PairNext {
                            seen_backslash: false,
                        },
                        (false, Surrogate::No) => Plain,
                        // A low half alone, or a high half not followed by a low one.
                        _ => return None,
                    }
                }
            }
        };
        Some(self.with(Lex::String { key, part }))
    }
}

/// `bytes` stay inside any JSON string from between two of its characters: no byte closes
/// it or is refused there, whatever the string belongs to. A string state allows these
/// without a walk (`super::trie`).
pub(crate) fn stays_in_string(bytes: &[u8]) -> bool {
    let inside = Lex::String {
        key: false,
        part: StringPart::Plain,
    };
    let mut state = JsonState::VALUE.with(inside);
    bytes.iter().all(|&b| match state.step(b) {
        Some(next) if matches!(next.lex, Lex::String { .. }) => {
            state = next;
            true
        }
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use serde_json::Value;

    fn complete(text: &[u8]) -> bool {
        JsonState::START.walk(text).is_some_and(|s| s.is_complete())
    }

    fn alive(text: &[u8]) -> bool {
        JsonState::START.walk(text).is_some()
    }

    #[test]
    fn objects_are_accepted_whole_and_every_prefix_is_alive() {
        for text in [
            r#"{}"#,
            r#"{"a":1}"#,
            r#"{ "a" : [1, -2.5e+3, 0, 0.25E-1, true, false, null, {}, []] , "b":{"c":"d"}}"#,
            "{\n  \"k\": \"caf\u{e9} \u{1F600} \\n\\t\\\"\\\\\\/\\b\\f\\r \\u00e9\\ud83d\\ude00\"\n}",
            r#"{"":""}"#,
            r#"{"a":[[[[]]]]}"#,
        ] {
            let bytes = text.as_bytes();
            for end in 0..bytes.len() {
                assert!(alive(&bytes[..end]), "{text:?} up to {end}");
                assert!(!complete(&bytes[..end]), "{text:?} up to {end}");
            }
            assert!(complete(bytes), "{text:?}");
            serde_json::from_str::<serde_json::Map<String, Value>>(text).unwrap();
        }
    }

    #[test]
    fn what_is_not_a_json_object_dies_at_the_first_wrong_byte() {
        for (text, alive_for) in [
            ("[1]", 0),
            (" {}", 0),
            ("{}}", 2),
            ("{} ", 2),
            ("{]", 1),
            ("{\"a\":[}", 6),
            ("{\"a\" 1}", 5),
            ("{\"a\":01}", 6),
            ("{\"a\":-}", 6),
            ("{\"a\":1.}", 7),
            ("{\"a\":1e}", 7),
            ("{\"a\":+1}", 5),
            ("{\"a\":tru}", 8),
            ("{\"a\":nul,", 8),
            ("{\"a\":1,}", 7),
            ("{\"a\":[1,]}", 8),
            ("{'a':1}", 1),
            ("{\"a\nb\":1}", 3),
            ("{\"\\x\":1}", 3),
            ("{\"\\u12g4\":1}", 6),
            // A low surrogate alone; a high one not followed by a low one.
            ("{\"\\udc00\":1}", 5),
            ("{\"\\ud800x\":1}", 8),
            ("{\"\\ud800\\u0041\":1}", 10),
            // Overlong, surrogate and out-of-range UTF-8.
            ("{\"\u{0}", 2),
        ] {
            let bytes = text.as_bytes();
            assert!(
                alive(&bytes[..alive_for]),
                "{text:?} alive up to {alive_for}"
            );
            assert!(
                !alive(&bytes[..alive_for + 1]),
                "{text:?} dies at byte {alive_for}"
            );
        }
        for bad in [
            &[b'{', b'"', 0xC0, 0x80][..],
            &[b'{', b'"', 0xED, 0xA0, 0x80],
            &[b'{', b'"', 0xF4, 0x90, 0x80, 0x80],
            &[b'{', b'"', 0xFF],
            &[b'{', b'"', 0x80],
        ] {
            assert!(!alive(bad), "{bad:x?}");
        }
    }

    #[test]
    fn any_value_may_stand_alone_and_a_number_may_end_or_go_on() {
        let value = |text: &str| JsonState::VALUE.walk(text.as_bytes());
        for text in ["\"a\"", "true", "null", "[1, {}]", "{\"a\": 2}"] {
            let s = value(text).unwrap_or_else(|| panic!("{text}"));
            assert!(s.is_complete() && s.can_end(), "{text}");
            assert!(s.step(b' ').is_none() && s.step(b',').is_none(), "{text}");
        }
        let one = value("-1").unwrap();
        assert!(one.can_end() && !one.is_complete());
        assert!(one.step(b'2').is_some_and(|s| s.can_end()));
        // What ends a top-level number is not the value's: the caller takes it.
        assert!(one.step(b',').is_none() && one.step(b' ').is_none());
        assert!(!value("-").unwrap().can_end() && !value("1.").unwrap().can_end());
        assert!(!value("[1").unwrap().can_end());
        assert!(value(" 1").is_none() && value("}").is_none());
    }

    #[test]
    fn whitespace_runs_and_nesting_are_bounded() {
        let run = |n: usize| format!("{{{}}}", " ".repeat(n));
        assert!(complete(run(MAX_WHITESPACE_RUN as usize).as_bytes()));
        assert!(!alive(run(MAX_WHITESPACE_RUN as usize + 1).as_bytes()));
        // Runs are counted apart: each may be as long as allowed.
        let long = " ".repeat(MAX_WHITESPACE_RUN as usize);
        assert!(complete(
            format!("{{{long}\"a\"{long}:{long}1{long}}}").as_bytes()
        ));
        let nest = |n: usize| format!("{{\"a\":{}{}}}", "[".repeat(n - 1), "]".repeat(n - 1));
        assert!(complete(nest(MAX_DEPTH as usize).as_bytes()));
        assert!(!alive(nest(MAX_DEPTH as usize + 1).as_bytes()));
    }

    fn random_value(rng: &mut ChaCha8Rng, depth: usize) -> Value {
        let pick = if depth > 4 {
            rng.random_range(0..5)
        } else {
            rng.random_range(0..7)
        };
        match pick {
            0 => Value::Null,
            1 => Value::Bool(rng.random()),
            2 => serde_json::json!(rng.random_range(-1_000_000i64..1_000_000)),
            3 => serde_json::json!(rng.random::<f64>() * 10f64.powi(rng.random_range(-30..30))),
            4 => Value::String(
                (0..rng.random_range(0..8))
                    .map(|_| {
                        let pool = ['a', '"', '\\', '\n', '\u{1}', 'é', '€', '😀', '/', ' '];
                        pool[rng.random_range(0..pool.len())]
                    })
                    .collect(),
            ),
            5 => Value::Array(
                (0..rng.random_range(0..4))
                    .map(|_| random_value(rng, depth + 1))
                    .collect(),
            ),
            _ => random_object(rng, depth + 1),
        }
    }

    fn random_object(rng: &mut ChaCha8Rng, depth: usize) -> Value {
        Value::Object(
            (0..rng.random_range(0..4))
                .map(|i| (format!("k{i}\u{e9}"), random_value(rng, depth + 1)))
                .collect(),
        )
    }

    /// Some bytes lead from `state` to a whole object (a search over the bytes that close
    /// things and finish escapes, numbers and literals).
    fn completable(state: JsonState) -> bool {
        let alphabet = b"{\"}]:0dDcC\\u,truefalsn".as_slice();
        let mut seen = std::collections::HashSet::from([state]);
        let mut frontier = vec![state];
        for _ in 0..64 {
            let mut next = Vec::new();
            for s in frontier {
                if s.is_complete() {
                    return true;
                }
                for &b in alphabet.iter().chain(&[0x80, 0x90, 0xA0]) {
                    if let Some(t) = s.step(b)
                        && seen.insert(t)
                    {
                        next.push(t);
                    }
                }
            }
            frontier = next;
        }
        false
    }

    /// Every object serde_json writes (compact and pretty, UTF-8 and Python's ASCII-escaped
    /// spelling) is accepted, and mutated texts are accepted exactly when serde_json reads
    /// them as an object.
    #[test]
    fn agrees_with_serde_json_on_written_and_mutated_texts() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut accepted_mutants = 0;
        for _ in 0..2_000 {
            let object = random_object(&mut rng, 0);
            let compact = serde_json::to_string(&object).unwrap();
            let pretty = serde_json::to_string_pretty(&object).unwrap();
            // Python's json.dumps(ensure_ascii=True): non-ASCII as \u escapes, astral
            // characters as surrogate pairs.
            let ascii: String = compact
                .encode_utf16()
                .map(|u| {
                    if u < 0x80 {
                        char::from(u as u8).to_string()
                    } else {
                        format!("\\u{u:04x}")
                    }
                })
                .collect();
            for text in [&compact, &pretty, &ascii] {
                assert!(complete(text.as_bytes()), "{text}");
                assert!(serde_json::from_str::<Value>(text).is_ok(), "{text}");
            }
            let mut bytes = compact.into_bytes();
            for _ in 0..rng.random_range(1..3) {
                let at = rng.random_range(0..bytes.len());
                match rng.random_range(0..3) {
                    0 => bytes[at] = b"{}[]\",:0-.eE \\u9aD"[rng.random_range(0..18)],
                    1 => {
                        bytes.remove(at);
                    }
                    _ => bytes.insert(at, rng.random()),
                }
            }
            // Wherever the text is still alive, a JSON object can still be finished from
            // there: a sampler is never led into a dead end.
            let alive_for = (0..=bytes.len())
                .rev()
                .find(|&n| alive(&bytes[..n]))
                .unwrap();
            let state = JsonState::START.walk(&bytes[..alive_for]).unwrap();
            assert!(
                completable(state),
                "stuck after {:?}",
                String::from_utf8_lossy(&bytes[..alive_for])
            );
            let ours = complete(&bytes);
            // serde_json also reads whitespace around the object (the guide ends the text at
            // its `}`), and refuses numbers past f64 (JSON's grammar has no such limit).
            let theirs = bytes.first() == Some(&b'{')
                && bytes.last() == Some(&b'}')
                && std::str::from_utf8(&bytes).is_ok_and(|text| {
                    match serde_json::from_str::<serde_json::Map<String, Value>>(text) {
                        Ok(_) => true,
                        Err(e) => {
                            e.to_string().contains("number out of range")
                                && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
                        }
                    }
                });
            assert_eq!(ours, theirs, "{}", String::from_utf8_lossy(&bytes));
            accepted_mutants += usize::from(ours);
        }
        // The mutations kept some texts valid: the comparison saw both answers.
        assert!(accepted_mutants > 20, "{accepted_mutants}");
    }
}
