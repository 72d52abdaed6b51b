//! A JSON schema as a request carries it (`response_format`, `guided_json`, a forced tool's
//! parameters), through the structured-output compiler: schema to regex (outlines' converter
//! with free-form parts marked), the state cap, and the guide over a vocabulary, then walked
//! as the sampler walks it.
//!
//! Properties: nothing panics; `validate` and `regex` agree, and a regex they return parses;
//! what validates compiles or fails with a typed vocabulary/complexity error; a guide always
//! allows something, walking from scratch allows what walking token by token allowed, and
//! every text the guide ends (EOS) is JSON (by its grammar: a number's range is not
//! JSON's to bound).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pd_engine::sampling::structured::{StructuredError, StructuredOutput};
use pd_fuzz::{compile, walk};

fuzz_target!(|data: &[u8]| {
    // The schema, then the walk's choices after a NUL.
    let (schema, choices) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(schema) = std::str::from_utf8(schema) else {
        return;
    };
    let spec = StructuredOutput::JsonSchema(schema.to_string());
    let validated = spec.validate();
    if spec.is_any_json_object() {
        assert!(validated.is_ok());
    } else {
        let regex = spec.regex();
        assert_eq!(validated.is_ok(), regex.is_ok(), "validate and regex agree");
        if let Ok(r) = &regex {
            assert_eq!(
                StructuredOutput::json_schema_regex(schema).as_ref(),
                Ok(r),
                "json_schema_regex is the schema's regex"
            );
        }
    }
    if validated.is_err() {
        return;
    }
    let guide = match compile(&spec) {
        Ok(g) => g,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    StructuredError::TooComplex(_)
                        | StructuredError::Vocabulary(_)
                        | StructuredError::Regex(_)
                ),
                "a validated schema failed to compile with {e:?}"
            );
            return;
        }
    };
    let (text, ended) = walk(guide, choices);
    // JSON's grammar, not serde_json's number range: JSON leaves the range of numbers to
    // implementations (RFC 8259 §6), and a guide bounds no exponent.
    if ended
        && let Err(e) = serde_json::from_slice::<serde_json::Value>(&text)
        && !e.to_string().starts_with("number out of range")
    {
        panic!(
            "the guide ended a text that is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&text)
        );
    }
});
