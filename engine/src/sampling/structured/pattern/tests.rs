//! Patterns over JSON text: what the rewritten regex accepts is JSON whose value the pattern
//! matches whole.

use super::super::StructuredOutput;
use super::*;

/// The whole regex of `schema`, as a matcher of whole texts.
fn schema_matcher(schema: &str) -> regex::Regex {
    let regex = StructuredOutput::JsonSchema(schema.into()).regex().unwrap();
    regex::Regex::new(&format!("^(?:{regex})$")).unwrap()
}

/// The matcher of a string schema with `pattern`.
fn string_matcher(pattern: &str) -> regex::Regex {
    let schema = serde_json::json!({"type": "string", "pattern": pattern});
    schema_matcher(&schema.to_string())
}

#[test]
fn a_pattern_allowing_quotes_backslashes_and_controls_accepts_only_their_escaped_text() {
    let any = string_matcher("(?s).*");
    for value in [
        "",
        "plain",
        "a\"b",
        "back\\slash",
        "tab\there",
        "\u{1}",
        "é\u{1f}\n",
    ] {
        let text = serde_json::to_string(value).unwrap();
        assert!(any.is_match(&text), "{text} is the JSON of {value:?}");
    }
    // Every spelling JSON has for a character it escapes.
    for text in [r#""\n""#, r#""\u000A""#, r#""\u000a""#, r#""\"\\""#] {
        assert!(any.is_match(text), "{text}");
    }
    for text in [
        "\"a\"b\"",
        "\"a\\\"",
        "\"\u{1}\"",
        "\"\\x\"",
        "\"a\"\"",
        "\"\n\"",
    ] {
        assert!(!any.is_match(text), "{text:?} is no JSON text");
    }
    // `.` is no newline: its escaped spellings are refused as the newline itself would be.
    let line = string_matcher(".*");
    assert!(line.is_match(r#""a\tb""#));
    assert!(!line.is_match(r#""a\nb""#) && !line.is_match(r#""\u000a""#));
}

#[test]
fn a_pattern_matches_the_value_whole_and_its_alternation_stays_inside_the_quotes() {
    let either = string_matcher("ab|cd");
    assert!(either.is_match(r#""ab""#) && either.is_match(r#""cd""#));
    assert!(!either.is_match(r#""ab"#) && !either.is_match(r#"cd""#));
    assert!(!either.is_match(r#""abcd""#));
    // `^` first and `$` last say what is meant anyway; either alone too.
    for pattern in [
        "^/[a-z]{1,4}$",
        "/[a-z]{1,4}$",
        "^/[a-z]{1,4}",
        "/[a-z]{1,4}",
    ] {
        let m = string_matcher(pattern);
        assert!(m.is_match(r#""/abc""#), "{pattern}");
        assert!(
            !m.is_match(r#""/abcde""#) && !m.is_match(r#""x/abc""#),
            "{pattern}"
        );
    }
    // A class holding `"` and `\`: both escaped, the rest as written.
    let quoted = string_matcher(r#"["\\a]+"#);
    assert!(quoted.is_match(r#""a\"\\a""#));
    assert!(!quoted.is_match(r#""a\""#));
}

#[test]
fn an_assertion_inside_a_pattern_is_refused_with_why() {
    for pattern in [r"\bword", "a^b", "a$b", "(?m)^a", "(a|b^)"] {
        let err = json_text_regex(pattern).unwrap_err().to_string();
        assert!(err.contains("assertion"), "{pattern}: {err}");
        assert!(err.contains(pattern), "{pattern}: {err}");
    }
    let err = json_text_regex("(unclosed").unwrap_err().to_string();
    assert!(err.contains("does not parse"), "{err}");
    let schema = serde_json::json!({"type": "string", "pattern": "x".repeat(2000)});
    let err = StructuredOutput::JsonSchema(schema.to_string())
        .validate()
        .unwrap_err();
    assert!(
        err.to_string().contains("more than the 1024 allowed"),
        "{err}"
    );
}

#[test]
fn patterns_are_rewritten_where_outlines_reads_schemas_and_data_is_left_alone() {
    let schema = serde_json::json!({
        "$defs": {"slug": {"type": "string", "pattern": "a|b"}},
        "type": "object",
        "properties": {
            "pattern": {"$ref": "#/$defs/slug"},
            "list": {"type": "array", "items": {"type": "string", "pattern": "\"+"}},
            "either": {"anyOf": [{"type": "string", "pattern": "x|y"}, {"type": "null"}]},
            "fixed": {"const": {"pattern": "a|b"}}
        },
        "required": ["pattern", "list", "either", "fixed"]
    });
    let m = schema_matcher(&schema.to_string());
    let text = r#"{"pattern":"b","list":["\"\"","\""],"either":"y","fixed":{"pattern":"a|b"}}"#;
    assert!(m.is_match(text), "{text}");
    for wrong in [
        r#"{"pattern":"ab","list":[],"either":null,"fixed":{"pattern":"a|b"}}"#,
        r#"{"pattern":"a","list":["""],"either":null,"fixed":{"pattern":"a|b"}}"#,
        r#"{"pattern":"a","list":[],"either":"x|y","fixed":{"pattern":"a|b"}}"#,
        r#"{"pattern":"a","list":[],"either":null,"fixed":{"pattern":"a"}}"#,
    ] {
        assert!(!m.is_match(wrong), "{wrong}");
    }
    // Nothing to rewrite: the schema goes to outlines as written.
    assert_eq!(rewrite(r#"{"type": "string"}"#), Ok(None));
    assert_eq!(rewrite(r#"{"const": {"pattern": "a"}}"#), Ok(None));
}

#[test]
fn the_fuzzed_schema_guides_only_json_texts() {
    // Found by the json_schema fuzz target: outlines pasted the pattern between the quotes,
    // so its `$` could never match and `"` reached the string's inside unescaped.
    let schema = r#"{"anyOf": [{"type": "string", "pattern": "/[a-z]{1,4}$"}, {"type": "object"}, {"type": "null"}]}"#;
    let m = schema_matcher(schema);
    // (The object member is free-form: the JSON grammar reads it, not this regex.)
    for text in [r#""/ab""#, "null"] {
        assert!(m.is_match(text), "{text}");
    }
    assert!(!m.is_match(r#""/ab"#) && !m.is_match(r#""/a"b""#));
}
