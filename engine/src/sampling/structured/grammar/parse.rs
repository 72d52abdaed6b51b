//! GBNF text into rules: names, alternatives, sequences, literals, character classes, groups
//! and repetitions, each with the byte offset it starts at for errors. Owns the syntax only;
//! checking names and lowering to bytes is `super`'s.

/// One `name ::= body` definition.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RuleDef {
    pub(super) name: String,
    /// Byte offset of its name.
    pub(super) at: usize,
    pub(super) body: Alternatives,
}

/// `a | b | …`: at least one sequence (an empty sequence matches the empty text).
pub(super) type Alternatives = Vec<Vec<Item>>;

/// One element of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Item {
    /// `"…"`: these characters in order.
    Literal(String),
    /// `[…]` or `[^…]`: one character in (out of) these inclusive ranges.
    Class {
        ranges: Vec<(char, char)>,
        negated: bool,
    },
    /// `.`: any one character.
    Any,
    /// Another rule, by name, and where the name is written.
    Ref(String, usize),
    /// `( … )`.
    Group(Alternatives),
    /// `x*`, `x+`, `x?`, `x{m}`, `x{m,}`, `x{m,n}`, `x{,n}`: `min` to `max` (unbounded when
    /// `None`) of `item`.
    Repeat {
        item: Box<Item>,
        min: u32,
        max: Option<u32>,
    },
}

/// Largest bound a repetition may write (`{m,n}` is unrolled into `n` copies).
pub(super) const MAX_REPEAT: u32 = 1024;
/// Deepest nesting of groups and repetitions (parsing and lowering recurse on it).
pub(super) const MAX_NESTING: usize = 64;

/// The rules of `src`, in the order written.
pub(super) fn parse(src: &str) -> Result<Vec<RuleDef>, String> {
    let mut p = Parser {
        src,
        pos: 0,
        depth: 0,
    };
    let mut rules = Vec::new();
    loop {
        p.skip_space();
        if p.eof() {
            break;
        }
        if p.peek() == Some(')') {
            return Err(format!("unmatched `)` at byte {}", p.pos));
        }
        let at = p.pos;
        let name = p
            .name()
            .ok_or_else(|| format!("expected a rule name at byte {at}, found {}", p.found()))?;
        p.skip_space();
        if !p.src[p.pos..].starts_with("::=") {
            let hint = if p.src[p.pos..].starts_with(':') {
                " (this looks like Lark; write rules in GBNF, `name ::= …`)"
            } else {
                ""
            };
            return Err(format!(
                "expected `::=` after the rule name `{name}` at byte {}, found {}{hint}",
                p.pos,
                p.found()
            ));
        }
        p.pos += 3;
        let body = p.alternatives(false)?;
        rules.push(RuleDef { name, at, body });
    }
    if rules.is_empty() {
        return Err("the grammar has no rules".into());
    }
    Ok(rules)
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
    /// Groups and repetitions open around the current position.
    depth: usize,
}

impl Parser<'_> {
    fn eof(&self) -> bool {
        self.pos >= self.src.len()
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    /// What stands at the current position, for an error.
    fn found(&self) -> String {
        match self.peek() {
            None => "the end of the grammar".into(),
            Some(c) => format!("`{}`", c.escape_default()),
        }
    }

    /// White space (newlines included) and `#` comments to the end of their line.
    fn skip_space(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while let Some(c) = self.bump() {
                    if c == '\n' {
                        break;
                    }
                }
            } else if c.is_whitespace() {
                self.pos += c.len_utf8();
            } else {
                break;
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                self.pos += 1;
            } else {
                break;
            }
        }
        (self.pos > start).then(|| self.src[start..self.pos].to_string())
    }

    /// A rule's name then `::=` starts here: the previous rule's body ended before it (rules
    /// may span lines, so a newline alone does not end one).
    fn at_rule_start(&self) -> bool {
        let mut look = Parser {
            src: self.src,
            pos: self.pos,
            depth: 0,
        };
        look.name().is_some() && {
            look.skip_space();
            look.src[look.pos..].starts_with("::=")
        }
    }

    fn alternatives(&mut self, nested: bool) -> Result<Alternatives, String> {
        let mut alternatives = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            alternatives.push(self.sequence(nested)?);
        }
        Ok(alternatives)
    }

    /// Items up to `|`, `)`, the next rule or the end (leaving the position there).
    fn sequence(&mut self, nested: bool) -> Result<Vec<Item>, String> {
        let mut items = Vec::new();
        loop {
            self.skip_space();
            match self.peek() {
                None | Some('|' | ')') => break,
                _ if !nested && self.at_rule_start() => break,
                _ => {}
            }
            let item = self.atom()?;
            items.push(self.postfix(item)?);
        }
        Ok(items)
    }

    fn atom(&mut self) -> Result<Item, String> {
        let at = self.pos;
        match self.peek() {
            Some('"') => {
                self.pos += 1;
                let mut text = String::new();
                loop {
                    match self.peek() {
                        None => return Err(format!("unclosed string starting at byte {at}")),
                        Some('"') => {
                            self.pos += 1;
                            break;
                        }
                        Some(_) => text.push(self.char()?),
                    }
                }
                Ok(Item::Literal(text))
            }
            Some('[') => self.class(),
            Some('.') => {
                self.pos += 1;
                Ok(Item::Any)
            }
            Some('(') => {
                self.pos += 1;
                self.nest(at)?;
                let body = self.alternatives(true)?;
                self.depth -= 1;
                if self.peek() != Some(')') {
                    return Err(format!("unclosed `(` at byte {at}"));
                }
                self.pos += 1;
                Ok(Item::Group(body))
            }
            _ => match self.name() {
                Some(name) => Ok(Item::Ref(name, at)),
                None => Err(format!("unexpected {} at byte {at}", self.found())),
            },
        }
    }

    fn class(&mut self) -> Result<Item, String> {
        let at = self.pos;
        self.pos += 1;
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return Err(format!("unclosed `[` at byte {at}")),
                Some(']') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => {
                    let lo = self.char()?;
                    let hi = if self.src[self.pos..].starts_with('-')
                        && !self.src[self.pos..].starts_with("-]")
                    {
                        self.pos += 1;
                        if self.eof() {
                            return Err(format!("unclosed `[` at byte {at}"));
                        }
                        let hi_at = self.pos;
                        let hi = self.char()?;
                        if hi < lo {
                            return Err(format!(
                                "the range `{}-{}` at byte {hi_at} is reversed",
                                lo.escape_default(),
                                hi.escape_default()
                            ));
                        }
                        hi
                    } else {
                        lo
                    };
                    ranges.push((lo, hi));
                }
            }
        }
        if ranges.is_empty() {
            return Err(format!("empty character class at byte {at}"));
        }
        Ok(Item::Class { ranges, negated })
    }

    /// One character of a literal or class, escapes read.
    fn char(&mut self) -> Result<char, String> {
        let at = self.pos;
        let c = self
            .bump()
            .ok_or_else(|| "unexpected end of the grammar".to_string())?;
        if c != '\\' {
            return Ok(c);
        }
        let escaped = self
            .bump()
            .ok_or_else(|| format!("unfinished escape at byte {at}"))?;
        let hex = |p: &mut Self, digits: usize| -> Result<char, String> {
            let text = p.src.get(p.pos..p.pos + digits).unwrap_or("");
            let code = (text.len() == digits)
                .then(|| u32::from_str_radix(text, 16).ok())
                .flatten()
                .ok_or_else(|| format!("`\\{escaped}` at byte {at} needs {digits} hex digits"))?;
            p.pos += digits;
            char::from_u32(code)
                .ok_or_else(|| format!("`\\{escaped}{text}` at byte {at} is not a character"))
        };
        Ok(match escaped {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            '0' => '\0',
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            '\\' | '"' | '\'' | '[' | ']' | '-' | '^' | '/' | '.' | '(' | ')' | '|' | '*' | '+'
            | '?' | '{' | '}' => escaped,
            other => {
                return Err(format!(
                    "unknown escape `\\{}` at byte {at}",
                    other.escape_default()
                ));
            }
        })
    }

    /// One more group or repetition around what follows, refused past [`MAX_NESTING`].
    fn nest(&mut self, at: usize) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            return Err(format!(
                "groups and repetitions nest more than {MAX_NESTING} deep at byte {at}"
            ));
        }
        Ok(())
    }

    /// `*`, `+`, `?` and `{…}` after an item, any number of them, white space before each
    /// allowed (as llama.cpp reads `x *`).
    fn postfix(&mut self, mut item: Item) -> Result<Item, String> {
        let outer = self.depth;
        let item = loop {
            self.skip_space();
            let at = self.pos;
            let (min, max) = match self.peek() {
                Some('*') => (0, None),
                Some('+') => (1, None),
                Some('?') => (0, Some(1)),
                Some('{') => {
                    self.pos += 1;
                    self.bounds(at)?
                }
                _ => break item,
            };
            if self.pos == at {
                self.pos += 1;
            }
            self.nest(at)?;
            item = Item::Repeat {
                item: Box::new(item),
                min,
                max,
            };
        };
        self.depth = outer;
        Ok(item)
    }

    /// `m}`, `m,}`, `m,n}` or `,n}` after a `{` at `at` (leaving the position past `}`).
    fn bounds(&mut self, at: usize) -> Result<(u32, Option<u32>), String> {
        let close = self.src[self.pos..]
            .find('}')
            .ok_or_else(|| format!("unclosed `{{` at byte {at}"))?;
        let inside = &self.src[self.pos..self.pos + close];
        self.pos += close + 1;
        let number = |text: &str| -> Result<Option<u32>, String> {
            let text = text.trim();
            if text.is_empty() {
                return Ok(None);
            }
            match text.parse::<u32>() {
                Ok(n) if n <= MAX_REPEAT => Ok(Some(n)),
                _ => Err(format!(
                    "the repetition `{{{inside}}}` at byte {at} needs counts of 0 to {MAX_REPEAT}"
                )),
            }
        };
        if inside.trim() == "," {
            return Err(format!("the repetition `{{,}}` at byte {at} has no count"));
        }
        let (min, max) = match inside.split_once(',') {
            None => {
                let n = number(inside)?;
                (n, n)
            }
            Some((lo, hi)) => (number(lo)?, number(hi)?),
        };
        let min = match (min, inside.contains(',')) {
            (Some(m), _) => m,
            (None, true) => 0,
            (None, false) => {
                return Err(format!("the repetition `{{}}` at byte {at} has no count"));
            }
        };
        if max.is_some_and(|max| max < min) {
            return Err(format!(
                "the repetition `{{{inside}}}` at byte {at} has its maximum below its minimum"
            ));
        }
        Ok((min, max))
    }
}
