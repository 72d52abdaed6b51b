//! Grammars in GBNF, llama.cpp's EBNF (what vLLM's xgrammar backend and SGLang's `ebnf` take):
//! `name ::= …` rules of alternatives (`|`), sequences, string literals, character classes
//! (`[a-z]`, `[^"\\]`), `.`, groups and repetitions (`*`, `+`, `?`, `{m,n}`), `#` comments,
//! starting at `root`. A grammar is parsed (`parse`) and lowered to bytes ([`Grammar`]): a
//! character class becomes the UTF-8 byte sequences that spell its characters and a
//! repetition becomes rules of its own, so the recognizer (`stacks`) reads bytes as the other
//! guides do, and its masks come from the vocabulary trie as the JSON grammar's do.
//!
//! Owns the syntax, the checks that make a grammar usable (every rule defined, once; `root`
//! present and able to end; no rule that reaches itself before reading a byte, which a
//! top-down recognizer would expand forever) and the lowering; not the recognizer's walk.

#[cfg(test)]
mod fuzz;
mod parse;
mod stacks;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use regex_syntax::hir::{ClassUnicode, ClassUnicodeRange};
use regex_syntax::utf8::Utf8Sequences;

use self::parse::{Item, RuleDef};
use super::StructuredError;
pub(crate) use stacks::{GrammarGuide, GrammarState};
pub use stacks::{MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_STACKS, MAX_WALK_WORK};

/// Most elements a grammar may lower to, its repetitions unrolled (`"ab"{3}` is six bytes).
pub const MAX_GRAMMAR_ELEMENTS: usize = 1 << 16;

/// One element of a lowered alternative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    /// One byte in this set (an index into [`Grammar::sets`]).
    Bytes(u16),
    /// The rule of this id.
    Rule(u32),
    /// The alternative's end.
    End,
}

/// A set of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ByteSet([u64; 4]);

impl ByteSet {
    fn range(lo: u8, hi: u8) -> Self {
        let mut set = Self([0; 4]);
        for b in lo..=hi {
            set.0[usize::from(b >> 6)] |= 1 << (b & 63);
        }
        set
    }

    fn union(self, other: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] | other.0[i]))
    }

    fn contains(&self, b: u8) -> bool {
        self.0[usize::from(b >> 6)] & (1 << (b & 63)) != 0
    }
}

/// A grammar lowered to bytes: every rule's alternatives laid out one after another in
/// `elems`, each ended by [`Elem::End`].
#[derive(Debug)]
pub(crate) struct Grammar {
    elems: Vec<Elem>,
    /// Per rule, where each of its alternatives starts in `elems`.
    alternatives: Vec<Vec<u32>>,
    sets: Vec<ByteSet>,
    root: u32,
}

impl Grammar {
    /// Parses, checks and lowers the GBNF text `src`.
    pub(crate) fn parse(src: &str) -> Result<Self, StructuredError> {
        let error = |e: String| StructuredError::Grammar(e);
        let defs = parse::parse(src).map_err(error)?;
        let mut builder = Builder::new(&defs).map_err(error)?;
        for (id, def) in defs.iter().enumerate() {
            let alternatives = def
                .body
                .iter()
                .map(|items| builder.sequence(items, id as u32))
                .collect::<Result<Vec<_>, _>>()
                .map_err(error)?;
            builder.rules[id] = alternatives;
        }
        let root = *builder
            .ids
            .get("root")
            .ok_or_else(|| error("the grammar has no `root` rule".into()))?;
        builder.check(root).map_err(error)?;
        Ok(builder.finish(root))
    }
}

/// Rules being lowered: named ones first (by their order in the text), then the ones made
/// for groups, classes and repetitions.
struct Builder<'a> {
    defs: &'a [RuleDef],
    ids: HashMap<&'a str, u32>,
    /// Each rule's alternatives, not yet ended.
    rules: Vec<Vec<Vec<Elem>>>,
    /// The named rule each rule was made for (itself for a named one), for messages.
    owner: Vec<u32>,
    sets: Vec<ByteSet>,
    set_ids: HashMap<ByteSet, u16>,
    /// Rules made for a non-ASCII class, by its ranges: a class written twice is one rule.
    classes: HashMap<Vec<(char, char)>, u32>,
    elements: usize,
}

impl<'a> Builder<'a> {
    fn new(defs: &'a [RuleDef]) -> Result<Self, String> {
        let mut ids = HashMap::new();
        for (id, def) in defs.iter().enumerate() {
            if let Some(first) = ids.insert(def.name.as_str(), id as u32) {
                return Err(format!(
                    "the rule `{}` is defined twice, at bytes {} and {}",
                    def.name, defs[first as usize].at, def.at
                ));
            }
        }
        Ok(Self {
            defs,
            ids,
            rules: vec![Vec::new(); defs.len()],
            owner: (0..defs.len() as u32).collect(),
            sets: Vec::new(),
            set_ids: HashMap::new(),
            classes: HashMap::new(),
            elements: 0,
        })
    }

    fn new_rule(&mut self, owner: u32) -> u32 {
        self.rules.push(Vec::new());
        self.owner.push(self.owner[owner as usize]);
        (self.rules.len() - 1) as u32
    }

    /// Counts `n` more elements, refused past [`MAX_GRAMMAR_ELEMENTS`].
    fn grow(&mut self, n: usize) -> Result<(), String> {
        self.elements += n;
        if self.elements > MAX_GRAMMAR_ELEMENTS {
            return Err(format!(
                "the grammar is too large: more than {MAX_GRAMMAR_ELEMENTS} elements once its \
                 repetitions are unrolled"
            ));
        }
        Ok(())
    }

    fn set(&mut self, set: ByteSet) -> Result<Elem, String> {
        if let Some(&id) = self.set_ids.get(&set) {
            return Ok(Elem::Bytes(id));
        }
        let id = u16::try_from(self.sets.len())
            .map_err(|_| "the grammar has too many distinct byte sets".to_string())?;
        self.sets.push(set);
        self.set_ids.insert(set, id);
        Ok(Elem::Bytes(id))
    }

    fn sequence(&mut self, items: &[Item], owner: u32) -> Result<Vec<Elem>, String> {
        let mut out = Vec::new();
        for item in items {
            self.item(item, owner, &mut out)?;
        }
        Ok(out)
    }

    fn item(&mut self, item: &Item, owner: u32, out: &mut Vec<Elem>) -> Result<(), String> {
        match item {
            Item::Literal(text) => {
                self.grow(text.len())?;
                for b in text.bytes() {
                    out.push(self.set(ByteSet::range(b, b))?);
                }
            }
            Item::Class { ranges, negated } => self.class(ranges, *negated, owner, out)?,
            Item::Any => self.class(&[('\0', char::MAX)], false, owner, out)?,
            Item::Ref(name, at) => {
                let id = *self
                    .ids
                    .get(name.as_str())
                    .ok_or_else(|| format!("the rule `{name}` at byte {at} is not defined"))?;
                self.grow(1)?;
                out.push(Elem::Rule(id));
            }
            Item::Group(alternatives) if alternatives.len() == 1 => {
                for item in &alternatives[0] {
                    self.item(item, owner, out)?;
                }
            }
            Item::Group(alternatives) => {
                let rule = self.new_rule(owner);
                let lowered = alternatives
                    .iter()
                    .map(|items| self.sequence(items, owner))
                    .collect::<Result<Vec<_>, _>>()?;
                self.rules[rule as usize] = lowered;
                self.grow(1)?;
                out.push(Elem::Rule(rule));
            }
            Item::Repeat { item, min, max } => {
                let mut unit = Vec::new();
                self.item(item, owner, &mut unit)?;
                for _ in 0..*min {
                    self.grow(unit.len())?;
                    out.extend_from_slice(&unit);
                }
                // `x*` is `R ::= x R | ε`; `x{0,n}` a chain of n optional ones, each `x`
                // then the next, or nothing.
                let tail = match max {
                    None => {
                        let rule = self.new_rule(owner);
                        let mut again = unit.clone();
                        again.push(Elem::Rule(rule));
                        self.rules[rule as usize] = vec![again, Vec::new()];
                        Some(rule)
                    }
                    Some(max) => {
                        let mut tail = None;
                        for _ in *min..*max {
                            let rule = self.new_rule(owner);
                            let mut once = unit.clone();
                            once.extend(tail.map(Elem::Rule));
                            self.grow(once.len())?;
                            self.rules[rule as usize] = vec![once, Vec::new()];
                            tail = Some(rule);
                        }
                        tail
                    }
                };
                if let Some(rule) = tail {
                    self.grow(1)?;
                    out.push(Elem::Rule(rule));
                }
            }
        }
        Ok(())
    }

    /// One character of `ranges` (of none of them when `negated`): one byte set when they
    /// are all ASCII, else a rule with an alternative per UTF-8 byte sequence.
    fn class(
        &mut self,
        ranges: &[(char, char)],
        negated: bool,
        owner: u32,
        out: &mut Vec<Elem>,
    ) -> Result<(), String> {
        let mut class = ClassUnicode::new(
            ranges
                .iter()
                .map(|&(lo, hi)| ClassUnicodeRange::new(lo, hi)),
        );
        if negated {
            class.negate();
        }
        let key: Vec<(char, char)> = class
            .ranges()
            .iter()
            .map(|r| (r.start(), r.end()))
            .collect();
        if key.is_empty() {
            return Err("a character class matches no character".into());
        }
        self.grow(1)?;
        if key.iter().all(|&(_, hi)| hi.is_ascii()) {
            let set = key
                .iter()
                .map(|&(lo, hi)| ByteSet::range(lo as u8, hi as u8))
                .fold(ByteSet([0; 4]), ByteSet::union);
            out.push(self.set(set)?);
            return Ok(());
        }
        if let Some(&rule) = self.classes.get(&key) {
            out.push(Elem::Rule(rule));
            return Ok(());
        }
        let rule = self.new_rule(owner);
        let mut single = None;
        let mut alternatives = Vec::new();
        for &(lo, hi) in &key {
            for sequence in Utf8Sequences::new(lo, hi) {
                let bytes = sequence.as_slice();
                self.grow(bytes.len())?;
                if let [one] = bytes {
                    // Single bytes of the class read as one set, not one alternative each.
                    let set = ByteSet::range(one.start, one.end);
                    single = Some(single.map_or(set, |s: ByteSet| s.union(set)));
                    continue;
                }
                let elems = bytes
                    .iter()
                    .map(|r| self.set(ByteSet::range(r.start, r.end)))
                    .collect::<Result<Vec<_>, _>>()?;
                alternatives.push(elems);
            }
        }
        if let Some(set) = single {
            alternatives.push(vec![self.set(set)?]);
        }
        self.rules[rule as usize] = alternatives;
        self.classes.insert(key, rule);
        out.push(Elem::Rule(rule));
        Ok(())
    }

    /// `root` can end (some finite text matches it), and no rule reaches itself before
    /// reading a byte.
    fn check(&self, root: u32) -> Result<(), String> {
        let n = self.rules.len();
        // Rules that match the empty text, and rules that match some text, to a fixed point.
        let mut nullable = vec![false; n];
        let mut productive = vec![false; n];
        let mut changed = true;
        while changed {
            changed = false;
            for (rule, alternatives) in self.rules.iter().enumerate() {
                let all = |known: &[bool], alt: &Vec<Elem>, bytes: bool| {
                    alt.iter().all(|e| match e {
                        Elem::Bytes(_) => bytes,
                        Elem::Rule(r) => known[*r as usize],
                        Elem::End => true,
                    })
                };
                if !nullable[rule] && alternatives.iter().any(|a| all(&nullable, a, false)) {
                    nullable[rule] = true;
                    changed = true;
                }
                if !productive[rule] && alternatives.iter().any(|a| all(&productive, a, true)) {
                    productive[rule] = true;
                    changed = true;
                }
            }
        }
        if !productive[root as usize] {
            return Err(
                "the rule `root` matches no text: every alternative recurses without \
                        end"
                .into(),
            );
        }
        // The rules each rule may expand before reading a byte: its alternatives' rules up
        // to the first that cannot be empty. A cycle there is left recursion.
        let first: Vec<Vec<u32>> = self
            .rules
            .iter()
            .map(|alternatives| {
                let mut first = Vec::new();
                for alt in alternatives {
                    for e in alt {
                        match e {
                            Elem::Rule(r) => {
                                first.push(*r);
                                if !nullable[*r as usize] {
                                    break;
                                }
                            }
                            _ => break,
                        }
                    }
                }
                first
            })
            .collect();
        // Depth-first, iteratively (a chain of rules may be long): 0 unseen, 1 on the
        // path, 2 done.
        let mut mark = vec![0u8; n];
        for start in 0..n {
            if mark[start] != 0 {
                continue;
            }
            let mut path: Vec<(usize, usize)> = vec![(start, 0)];
            mark[start] = 1;
            while let Some((rule, next)) = path.last_mut() {
                let rule = *rule;
                match first[rule].get(*next) {
                    Some(&to) => {
                        *next += 1;
                        let to = to as usize;
                        match mark[to] {
                            0 => {
                                mark[to] = 1;
                                path.push((to, 0));
                            }
                            1 => {
                                let name = &self.defs[self.owner[to] as usize].name;
                                return Err(format!(
                                    "the rule `{name}` can reach itself without reading any \
                                     text (left recursion, or a repetition of something that \
                                     may be empty, such as `(x?)*`); rewrite it"
                                ));
                            }
                            _ => {}
                        }
                    }
                    None => {
                        mark[rule] = 2;
                        path.pop();
                    }
                }
            }
        }
        Ok(())
    }

    fn finish(self, root: u32) -> Grammar {
        let mut elems = Vec::with_capacity(self.elements + self.rules.len());
        let alternatives = self
            .rules
            .into_iter()
            .map(|alternatives| {
                alternatives
                    .into_iter()
                    .map(|alt| {
                        let start = elems.len() as u32;
                        elems.extend(alt);
                        elems.push(Elem::End);
                        start
                    })
                    .collect()
            })
            .collect();
        Grammar {
            elems,
            alternatives,
            sets: self.sets,
            root,
        }
    }
}
