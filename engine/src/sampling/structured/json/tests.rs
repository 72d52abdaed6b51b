//! The JSON recognizer's tests: texts it must accept and refuse, its limits, and serde_json
//! as the reference on written and mutated texts.

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
