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
    #[cfg(test)]
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
    #[cfg(test)]
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
mod tests;
