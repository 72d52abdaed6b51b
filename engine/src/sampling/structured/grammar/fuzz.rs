//! Random regular grammars against the `regex` crate: each random expression (literals,
//! classes, `.`, sequences, alternatives, repetitions, references to other rules) is written
//! both as GBNF and as a regex, and every text of a small alphabet is matched (whole) and
//! walked (byte by byte, alive or not) the same by both.

use proptest::prelude::*;
use regex_automata::dfa::{Automaton, dense};
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind, nfa::thompson, util::syntax};

use super::stacks::GrammarGuide;
use super::*;

#[derive(Debug, Clone)]
enum Ast {
    Literal(String),
    Class(Vec<(char, char)>, bool),
    Any,
    Sequence(Vec<Ast>),
    Alternatives(Vec<Ast>),
    Repeat(Box<Ast>, u32, Option<u32>),
    /// The helper rule `h0` or `h1`.
    Ref(usize),
}

const ALPHABET: &[char] = &['a', 'b', 'c', '-', '"', '\\', ']', 'é', '日'];

fn character() -> impl Strategy<Value = char> {
    proptest::sample::select(ALPHABET)
}

fn leaf(refs: bool) -> BoxedStrategy<Ast> {
    let mut leaves = vec![
        proptest::collection::vec(character(), 0..3)
            .prop_map(|cs| Ast::Literal(cs.into_iter().collect()))
            .boxed(),
        (
            proptest::collection::vec((character(), character()), 1..3),
            any::<bool>(),
        )
            .prop_map(|(ranges, negated)| {
                let ranges = ranges
                    .into_iter()
                    .map(|(a, b)| (a.min(b), a.max(b)))
                    .collect();
                Ast::Class(ranges, negated)
            })
            .boxed(),
        Just(Ast::Any).boxed(),
    ];
    if refs {
        leaves.push((0..2usize).prop_map(Ast::Ref).boxed());
    }
    proptest::strategy::Union::new(leaves).boxed()
}

fn ast(refs: bool) -> impl Strategy<Value = Ast> {
    leaf(refs).prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..3).prop_map(Ast::Sequence),
            proptest::collection::vec(inner.clone(), 1..3).prop_map(Ast::Alternatives),
            (
                inner,
                0..3u32,
                prop_oneof![Just(None), (0..3u32).prop_map(Some)]
            )
                .prop_map(|(item, min, extra)| Ast::Repeat(
                    Box::new(item),
                    min,
                    extra.map(|e| min + e)
                )),
        ]
    })
}

fn gbnf_char(c: char) -> String {
    match c {
        '"' | '\\' | ']' | '-' | '^' | '[' => format!("\\{c}"),
        c => c.to_string(),
    }
}

fn gbnf(ast: &Ast) -> String {
    match ast {
        Ast::Literal(s) => format!("\"{}\"", s.chars().map(gbnf_char).collect::<String>()),
        Ast::Class(ranges, negated) => {
            let body: String = ranges
                .iter()
                .map(|&(lo, hi)| format!("{}-{}", gbnf_char(lo), gbnf_char(hi)))
                .collect();
            format!("[{}{body}]", if *negated { "^" } else { "" })
        }
        Ast::Any => ".".into(),
        Ast::Sequence(items) if items.is_empty() => "\"\"".into(),
        Ast::Sequence(items) => {
            format!("({})", items.iter().map(gbnf).collect::<Vec<_>>().join(" "))
        }
        Ast::Alternatives(items) => {
            format!(
                "({})",
                items.iter().map(gbnf).collect::<Vec<_>>().join(" | ")
            )
        }
        Ast::Repeat(item, min, max) => {
            let bounds = match max {
                None => format!("{{{min},}}"),
                Some(max) => format!("{{{min},{max}}}"),
            };
            format!("({}){bounds}", gbnf(item))
        }
        Ast::Ref(i) => format!("h{i}"),
    }
}

fn regex(ast: &Ast, helpers: &[Ast]) -> String {
    let escape = |c: char| regex_syntax::escape(&c.to_string());
    match ast {
        Ast::Literal(s) => format!("(?:{})", regex_syntax::escape(s)),
        Ast::Class(ranges, negated) => {
            let body: String = ranges
                .iter()
                .map(|&(lo, hi)| format!("{}-{}", escape(lo), escape(hi)))
                .collect();
            format!("[{}{body}]", if *negated { "^" } else { "" })
        }
        Ast::Any => "(?s:.)".into(),
        Ast::Sequence(items) => format!(
            "(?:{})",
            items.iter().map(|i| regex(i, helpers)).collect::<String>()
        ),
        Ast::Alternatives(items) => format!(
            "(?:{})",
            items
                .iter()
                .map(|i| regex(i, helpers))
                .collect::<Vec<_>>()
                .join("|")
        ),
        Ast::Repeat(item, min, max) => {
            let bounds = match max {
                None => format!("{{{min},}}"),
                Some(max) => format!("{{{min},{max}}}"),
            };
            format!("(?:{}){bounds}", regex(item, helpers))
        }
        Ast::Ref(i) => regex(&helpers[*i], helpers),
    }
}

fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        proptest::sample::select(&['a', 'b', 'c', '-', '"', '\\', ']', 'é', '日', 'x'][..]),
        0..7,
    )
    .prop_map(|cs| cs.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(400)
    ))]

    #[test]
    fn a_regular_grammar_reads_texts_as_its_regex(
        root in ast(true),
        h0 in ast(false),
        h1 in ast(false),
        texts in proptest::collection::vec(text(), 40),
    ) {
        let helpers = [h0, h1];
        let src = format!(
            "root ::= {}\nh0 ::= {}\nh1 ::= {}",
            gbnf(&root),
            gbnf(&helpers[0]),
            gbnf(&helpers[1])
        );
        let grammar = match Grammar::parse(&src) {
            Ok(g) => g,
            // A repetition of something that may be empty: refused, as documented.
            Err(e) if e.to_string().contains("reach itself") => return Ok(()),
            Err(e) => panic!("{src}: {e}"),
        };
        let guide = GrammarGuide::new(grammar).unwrap();
        let re = regex(&root, &helpers);
        let whole = regex::Regex::new(&format!("^(?:{re})$")).unwrap();
        // A DFA reports a match one byte late, so a byte past a match would look alive:
        // with an end byte that no UTF-8 text holds, only that byte can reach a match, and a
        // prefix is alive exactly where the DFA is not dead.
        let dfa = dense::Builder::new()
            .syntax(syntax::Config::new().utf8(false))
            .thompson(thompson::Config::new().utf8(false))
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(regex_automata::dfa::StartKind::Anchored),
            )
            .build(&format!("(?:{re})(?-u:\\xFD)"))
            .unwrap();
        let dfa_start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .unwrap();
        let mut walker = guide.walker();
        for text in &texts {
            let mut state = Some(guide.start());
            let mut at = dfa_start;
            for &b in text.as_bytes() {
                state = state.and_then(|s| walker.step(s, b));
                at = dfa.next_state(at, b);
                prop_assert_eq!(
                    state.is_some(),
                    !dfa.is_dead_state(at),
                    "{} / {} on {:?} at byte {:#x}", src, re, text, b
                );
                if state.is_none() {
                    break;
                }
            }
            prop_assert_eq!(
                state.is_some_and(|s| walker.is_match(s)),
                whole.is_match(text),
                "{} / {} on {:?}", src, re, text
            );
        }
    }
}
