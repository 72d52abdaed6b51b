//! The grammar's tests: syntax and its errors, the checks, and texts accepted and refused
//! byte by byte (against the `regex` crate where the grammar is regular).

use super::stacks::Walker;
use super::*;
use crate::sampling::structured::grammar::stacks::GrammarGuide;

fn guide(src: &str) -> GrammarGuide {
    GrammarGuide::new(Grammar::parse(src).unwrap_or_else(|e| panic!("{src}: {e}"))).unwrap()
}

/// The state after `text`, `None` where a byte is refused.
fn walk(walker: &mut Walker<'_>, start: GrammarState, text: &[u8]) -> Option<GrammarState> {
    text.iter().try_fold(start, |s, &b| walker.step(s, b))
}

fn matches(g: &GrammarGuide, text: &str) -> bool {
    let mut walker = g.walker();
    walk(&mut walker, g.start(), text.as_bytes()).is_some_and(|s| walker.is_match(s))
}

fn alive(g: &GrammarGuide, text: &str) -> bool {
    let mut walker = g.walker();
    walk(&mut walker, g.start(), text.as_bytes()).is_some()
}

fn error(src: &str) -> String {
    match Grammar::parse(src) {
        Ok(_) => panic!("{src}: accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn literals_alternatives_and_rules() {
    let g = guide(
        r#"
        # a greeting
        root ::= greeting " " name "!"?
        greeting ::= "hello" | "hi"
        name ::= [A-Z] [a-z]*
        "#,
    );
    for yes in ["hello Ann", "hi Bo!", "hi X"] {
        assert!(matches(&g, yes), "{yes}");
    }
    for no in ["hello", "hello ann", "hey Ann", "hi Ann!!", "hi Ann "] {
        assert!(!matches(&g, no), "{no}");
    }
    assert!(alive(&g, "hel"));
    assert!(!alive(&g, "hex"));
}

#[test]
fn white_space_may_come_before_a_repetition() {
    let g = guide("root ::= [0-9] + \"x\" ? (\"y\") {2}");
    assert!(matches(&g, "12yy"));
    assert!(matches(&g, "1xyy"));
    assert!(!matches(&g, "x"));
    assert!(!matches(&g, "1y"));
}

#[test]
fn a_rule_may_span_lines_and_ends_where_the_next_begins() {
    let g = guide("root ::= a\n  | b\nb ::=\n  \"y\"\n  \"z\"\na ::= \"x\"");
    assert!(matches(&g, "x"));
    assert!(matches(&g, "yz"));
    assert!(!matches(&g, "y"));
}

#[test]
fn nesting_is_not_regular_and_is_read_to_any_depth_within_the_limit() {
    let g = guide(r#"root ::= "(" root ")" root | """#);
    for yes in ["", "()", "(())()", "((()())())"] {
        assert!(matches(&g, yes), "{yes}");
    }
    for no in ["(", ")", "())", "(()"] {
        assert!(!matches(&g, no), "{no}");
    }
    let deep = |n: usize| format!("{}{}", "(".repeat(n), ")".repeat(n));
    assert!(matches(&g, &deep(MAX_GRAMMAR_DEPTH - 1)));
    // Deeper than the stacks may grow: refused where it passes the limit.
    assert!(!alive(&g, &"(".repeat(MAX_GRAMMAR_DEPTH + 1)));
}

#[test]
fn classes_read_utf8_and_escapes() {
    let g = guide(r#"root ::= [^"\\]* "\"" [\u00e9-\u00ea\x41] "\n" "日" . "#);
    assert!(matches(&g, "añ日\"é\n日\u{10FFFF}"));
    assert!(matches(&g, "\"A\n日\n"));
    assert!(matches(&g, "\"ê\n日x"));
    assert!(!matches(&g, "\\\"é\n日x"));
    assert!(!matches(&g, "\"ë\n日x"));
    // A character's bytes one at a time: alive in the middle, whole at its end.
    let mut walker = g.walker();
    let after_quote = walk(&mut walker, g.start(), b"\"").unwrap();
    let mid = walker.step(after_quote, 0xC3).unwrap();
    assert!(walker.step(mid, 0xA9).is_some());
    assert!(walker.step(mid, 0xAB).is_none());
    // Invalid UTF-8 is no character.
    assert!(walker.step(g.start(), 0xFF).is_none());
    assert!(walker.step(g.start(), 0x80).is_none());
}

#[test]
fn repetitions_match_the_regex_of_the_same_shape() {
    let pairs = [
        (
            r#"root ::= [a-c]+ ("x" | "yz")? [0-9]{2,3}"#,
            "[a-c]+(x|yz)?[0-9]{2,3}",
        ),
        (
            r#"root ::= ("ab"){2} "c"{,2} "d"{1,}"#,
            "(ab){2}c{0,2}d{1,}",
        ),
        (r#"root ::= ([a-b] "-"?)* "."{0,1}"#, r"([a-b]-?)*\.?"),
    ];
    // Every text of up to 6 bytes over the alphabet.
    let alphabet = b"abcxyz019-.";
    for (grammar, regex) in pairs {
        let g = guide(grammar);
        let re = regex::Regex::new(&format!("^(?:{regex})$")).unwrap();
        let mut texts = vec![String::new()];
        for _ in 0..6 {
            let longer: Vec<String> = texts
                .iter()
                .flat_map(|t| alphabet.iter().map(move |&c| format!("{t}{}", c as char)))
                .collect();
            for text in texts.iter().chain(&longer) {
                assert_eq!(
                    matches(&g, text),
                    re.is_match(text),
                    "{grammar} on {text:?}"
                );
            }
            // Only the live prefixes go on (the count stays small).
            texts = longer.into_iter().filter(|t| alive(&g, t)).collect();
        }
    }
}

#[test]
fn an_ambiguous_grammar_is_read_every_way_at_once() {
    // "a" "a"* and "a"* "a": both readings, one state after each byte.
    let g = guide(
        r#"root ::= x | y
x ::= "a" "a"*
y ::= "a"* "a" "b"?"#,
    );
    assert!(matches(&g, "aaa"));
    assert!(matches(&g, "aaab"));
    assert!(!matches(&g, "b"));
}

#[test]
fn a_step_is_the_same_state_every_time() {
    let g = guide(r#"root ::= [a-z]* "!""#);
    let mut walker = g.walker();
    let one = walker.step(g.start(), b'q').unwrap();
    let two = walker.step(one, b'r').unwrap();
    // `x*` keeps the stack as deep as it was: the loop is one state.
    assert_eq!(one, two);
    assert_eq!(walker.step(g.start(), b'q'), Some(one));
}

#[test]
fn errors_say_what_and_where() {
    let cases = [
        ("", "no rules"),
        ("root ::= \"a", "unclosed string starting at byte 9"),
        ("root ::= [a-", "unclosed `[` at byte 9"),
        ("root ::= [z-a]", "reversed"),
        ("root ::= []", "empty character class"),
        ("root ::= (\"a\"", "unclosed `(` at byte 9"),
        ("root ::= \"a\")", "unmatched `)`"),
        ("root ::= x", "the rule `x` at byte 9 is not defined"),
        ("x ::= \"a\"", "no `root` rule"),
        (
            "root ::= \"a\"\nroot ::= \"b\"",
            "defined twice, at bytes 0 and 13",
        ),
        ("root ::= root \"a\" | \"b\"", "`root` can reach itself"),
        ("root ::= x | \"b\"\nx ::= \"\"? root", "can reach itself"),
        ("root ::= (\"a\"?)*", "can reach itself"),
        ("root ::= \"a\" root", "matches no text"),
        ("root ::= \"a\"{3,1}", "maximum below its minimum"),
        ("root ::= \"a\"{2000}", "0 to 1024"),
        ("root ::= \"a\"{,}", "no count"),
        ("root ::= \"\\q\"", "unknown escape `\\q` at byte 10"),
        ("root ::= \"\\xZZ\"", "needs 2 hex digits"),
        ("root ::= \"\\uD800\"", "not a character"),
        ("root: \"a\"", "looks like Lark"),
        ("root ::= ^", "unexpected `^` at byte 9"),
        ("root ::= [^\\u0000-\\U0010FFFF]", "matches no character"),
        ("root ::= \"abcdefgh\"{1000}{1000}", "too large"),
    ];
    for (src, wanted) in cases {
        let e = error(src);
        assert!(e.contains(wanted), "{src:?}: {e}");
    }
    let deep = format!("root ::= {}\"a\"{}", "(".repeat(100), ")".repeat(100));
    assert!(error(&deep).contains("nest more than 64 deep"));
}

/// An ambiguous grammar (found by fuzzing: `fuzz/findings/gbnf_grammar-slow-ambiguous`) whose
/// expansions grow by half again with every `+5`.
const AMBIGUOUS: &str = "root ::= expr\nexpr ::=| term ((\"+\" |root \"[-\") *term)+*\n\
                         term ::= num | \"(\" expr \")\"\nnum ::= [5-|9]+\n";

#[test]
fn a_walk_spends_at_most_its_budget_and_what_it_could_not_afford_stays_refused() {
    let text = b"5+5+5+5+5+5+5+5";
    // With the whole budget the text is alive, for some thousands of expansions.
    let rich = guide(AMBIGUOUS);
    let mut walker = rich.walker();
    assert!(walk(&mut walker, rich.start(), text).is_some());
    let spent = MAX_WALK_WORK - walker.budget_left();
    assert!((5_000..MAX_WALK_WORK).contains(&spent), "{spent}");
    drop(walker);

    // A walk that can afford a third of that is refused on the way, having spent no more
    // than its budget...
    let poor = guide(AMBIGUOUS);
    let mut walker = poor.walker_with_budget(spent / 3);
    let mut state = poor.start();
    let mut refused_at = None;
    for (i, &b) in text.iter().enumerate() {
        match walker.step(state, b) {
            Some(next) => state = next,
            None => {
                refused_at = Some(i);
                break;
            }
        }
    }
    assert!(walker.exhausted());
    let refused_at = refused_at.expect("refused within the text");
    assert!(refused_at > 2, "it got some way first: {refused_at}");
    drop(walker);
    // ... and the step it could not afford stays refused for every later walk, so masks and
    // walks agree whenever they are computed.
    let mut walker = poor.walker();
    let before = walk(&mut walker, poor.start(), &text[..refused_at]).expect("alive before");
    assert_eq!(walker.step(before, text[refused_at]), None);
    assert!(!walker.exhausted());
}
