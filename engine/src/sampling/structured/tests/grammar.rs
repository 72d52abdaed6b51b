//! Grammar guides: the tokens a grammar allows are those its regex twin allows, exactly the
//! Qwen3 tokens that continue its text, and sampled texts are what it describes.

use super::*;

/// JSON in GBNF (`\u` escapes below `\uD000`, so that no lone surrogate is drawn for
/// serde_json to refuse).
const JSON_GBNF: &str = include_str!("../grammar/json.gbnf");

fn grammar(src: &str) -> StructuredOutput {
    StructuredOutput::Grammar(src.into())
}

#[test]
fn a_regular_grammar_allows_what_its_regex_allows_at_every_step() {
    let pairs = [
        (
            r#"root ::= "yes" | "no" | [0-9]+ "+"?"#,
            r"(yes|no|[0-9]+\+?)",
        ),
        (
            r#"root ::= ("1" | "2"){2,3} "a"? x
x ::= "" | "o" x"#,
            "[12]{2,3}a?o*",
        ),
    ];
    let vocabulary = vocabulary();
    for (src, regex) in pairs {
        let by_grammar = Arc::new(Guide::compile(&grammar(src), &vocabulary).unwrap());
        let by_regex =
            Arc::new(Guide::compile(&StructuredOutput::Regex(regex.into()), &vocabulary).unwrap());
        // Every output of up to 4 tokens the regex keeps alive, token by token.
        let mut outputs: Vec<Vec<u32>> = vec![vec![]];
        for _ in 0..4 {
            let mut longer = Vec::new();
            for output in &outputs {
                let mut a = GuideState::new(by_grammar.clone()).allowed(output).to_vec();
                let mut b = GuideState::new(by_regex.clone()).allowed(output).to_vec();
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b, "{src} after {output:?}");
                longer.extend(b.iter().filter(|t| **t < EOS).map(|&t| {
                    let mut next = output.clone();
                    next.push(t);
                    next
                }));
            }
            outputs = longer;
        }
        assert!(!outputs.is_empty());
    }
}

#[test]
fn grammars_that_cannot_be_used_are_refused_before_compiling() {
    for (src, wanted) in [
        ("", "the grammar is empty"),
        ("root ::= \"a\" b", "`b` at byte 13 is not defined"),
        ("start ::= \"a\"", "no `root` rule"),
    ] {
        let e = grammar(src).validate().unwrap_err().to_string();
        assert!(e.contains(wanted), "{src:?}: {e}");
    }
    let long = format!("root ::= \"{}\"", "a".repeat(MAX_STRUCTURED_SPEC_BYTES));
    assert!(matches!(
        grammar(&long).validate(),
        Err(StructuredError::TooLong {
            what: "grammar",
            ..
        })
    ));
    assert!(matches!(
        grammar("root ::= \"a\"").regex(),
        Err(StructuredError::NotRegular("a grammar"))
    ));
    // A character no token spells.
    let e = Guide::compile(&grammar("root ::= \"é\""), &vocabulary()).unwrap_err();
    assert!(e.to_string().contains("no token starts"), "{e}");
}

/// Along Qwen3's own tokenization of JSON texts, every step allows exactly the tokens whose
/// bytes the grammar reads on from there (each of the 151k tokens walked alone), and EOS
/// exactly where the text is whole.
#[test]
fn a_grammar_allows_exactly_the_qwen3_tokens_that_continue_its_text() {
    let (tokenizer, guide, eos) = qwen3_guide(&grammar(JSON_GBNF));
    let GuideKind::Grammar(recognizer, _) = &guide.kind else {
        panic!("{guide:?}");
    };
    let ordinary = ordinary_tokens(&tokenizer, &eos);
    let mut state = GuideState::new(guide.clone());
    let text =
        "{\"name\": \"Ada \\u00e9\", \"tags\": [\"x\", 1.5e-3, true, null],\n  \"n\": {\"k\": []}}";
    let ids = tokenizer.encode(text).unwrap();
    for end in 0..=ids.len() {
        let mut allowed = state.allowed(&ids[..end]).to_vec();
        allowed.sort_unstable();
        let prefix = tokenizer.decode(&ids[..end], false).unwrap().into_bytes();
        let mut walker = recognizer.walker();
        let at = prefix
            .iter()
            .try_fold(recognizer.start(), |s, &b| walker.step(s, b))
            .unwrap();
        let mut expected: Vec<u32> = ordinary
            .iter()
            .filter(|(_, b)| b.iter().try_fold(at, |s, &b| walker.step(s, b)).is_some())
            .map(|&(id, _)| id)
            .collect();
        if walker.is_match(at) {
            expected.extend(&eos);
        }
        drop(walker);
        expected.sort_unstable();
        assert_eq!(allowed, expected, "after {end} tokens");
        if end < ids.len() {
            assert!(allowed.binary_search(&ids[end]).is_ok());
        }
    }
}

/// A sampler guided by the JSON grammar over Qwen3's vocabulary, from noisy logits, ends
/// every output with EOS right after a JSON object that serde_json reads.
#[test]
fn sampled_grammar_outputs_are_what_it_describes() {
    assert!(sampled_object_members(&grammar(JSON_GBNF), 5, 8) > 0);
}
