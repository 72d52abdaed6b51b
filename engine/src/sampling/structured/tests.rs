//! The guides' tests: regexes, choices and schemas over a small vocabulary, any JSON object
//! over Qwen3's.

use super::cache::GUIDE_CACHE_ENTRIES;
use super::json::JsonState;
use super::*;

const EOS: u32 = 100;
const EOS2: u32 = 101;

fn vocabulary() -> GuideVocabulary {
    let tokens: Vec<(u32, &[u8])> = vec![
        (0, b"0"),
        (1, b"1"),
        (2, b"2"),
        (3, b"12"),
        (4, b"a"),
        (5, b"yes"),
        (6, b"no"),
        (7, b"y"),
        (8, b"es"),
        (9, b"{"),
        (10, b"}"),
        (11, b"\""),
        (12, b":"),
        (13, b" "),
        (14, b"n"),
        (15, b"x"),
        (16, b","),
        (17, b"+"),
        (18, b"o"),
    ];
    GuideVocabulary::new(tokens, &[EOS, EOS2]).unwrap()
}

fn walk(spec: StructuredOutput, output: &[u32]) -> Vec<u32> {
    let guide = Arc::new(Guide::compile(&spec, &vocabulary()).unwrap());
    let mut state = GuideState::new(guide);
    let mut out = state.allowed(output).to_vec();
    out.sort_unstable();
    out
}

#[test]
fn a_regex_allows_the_tokens_that_continue_a_match_and_eos_only_at_a_whole_one() {
    let digits = || StructuredOutput::Regex("[0-9]{2}".into());
    assert_eq!(walk(digits(), &[]), vec![0, 1, 2, 3]);
    // One digit out: one more, and "12" would overshoot.
    assert_eq!(walk(digits(), &[1]), vec![0, 1, 2]);
    assert_eq!(walk(digits(), &[3]), vec![EOS, EOS2]);
    assert_eq!(walk(digits(), &[1, 2]), vec![EOS, EOS2]);
    // A token the guide did not allow (other processors masked the rest): only EOS.
    assert_eq!(walk(digits(), &[4]), vec![EOS, EOS2]);
}

#[test]
fn choices_are_spelled_whole_in_any_tokenization_and_literally() {
    let spec = || StructuredOutput::Choice(vec!["yes".into(), "no".into(), "1+".into()]);
    assert_eq!(walk(spec(), &[]), vec![1, 5, 6, 7, 14]);
    assert_eq!(walk(spec(), &[7]), vec![8]);
    assert_eq!(walk(spec(), &[7, 8]), vec![EOS, EOS2]);
    assert_eq!(walk(spec(), &[5]), vec![EOS, EOS2]);
    // "1+" is the two characters, not "one or more 1".
    assert_eq!(walk(spec(), &[1]), vec![17]);
}

#[test]
fn a_walk_resumes_where_it_stopped_and_restarts_on_a_shorter_output() {
    let guide =
        Arc::new(Guide::compile(&StructuredOutput::Regex("1+0".into()), &vocabulary()).unwrap());
    let mut state = GuideState::new(guide);
    let mut sorted = |output: &[u32]| {
        let mut ids = state.allowed(output).to_vec();
        ids.sort_unstable();
        ids
    };
    assert_eq!(sorted(&[1]), vec![0, 1]);
    assert_eq!(sorted(&[1, 1, 0]), vec![EOS, EOS2]);
    assert_eq!(sorted(&[]), vec![1]);
    // Asked again for the same output: the same list.
    assert_eq!(sorted(&[]), vec![1]);
}

#[test]
fn a_json_schema_becomes_a_regex_the_guide_walks() {
    let schema =
        r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#;
    let spec = StructuredOutput::JsonSchema(schema.into());
    let regex = spec.regex().unwrap();
    let matcher = regex::Regex::new(&format!("^(?:{regex})$")).unwrap();
    assert!(matcher.is_match(r#"{"n":12}"#));
    assert!(!matcher.is_match(r#"{"m":12}"#));
    assert_eq!(walk(spec, &[]), vec![9]);
}

#[test]
fn bad_specifications_are_refused_with_what_is_wrong() {
    let err = |s: StructuredOutput| s.regex().unwrap_err().to_string();
    assert!(err(StructuredOutput::Regex(String::new())).contains("regex is empty"));
    assert_eq!(
        err(StructuredOutput::Regex("ab[0-9".into())),
        "structured output: invalid regex: unclosed character class at byte 2"
    );
    assert!(
        err(StructuredOutput::Regex(
            "a".repeat(MAX_STRUCTURED_SPEC_BYTES + 1)
        ))
        .contains("more than")
    );
    assert!(err(StructuredOutput::Choice(vec![])).contains("choice list is empty"));
    assert!(err(StructuredOutput::Choice(vec!["".into()])).contains("empty string"));
    assert!(err(StructuredOutput::JsonSchema("{".into())).contains("invalid JSON schema"));
    assert!(
        err(StructuredOutput::JsonSchema(
            r#"{"type": "no-such-type"}"#.into()
        ))
        .contains("invalid JSON schema")
    );
    // A state explosion is refused before the vocabulary is walked.
    let e = Guide::compile(
        &StructuredOutput::Regex("[ab]*a[ab]{10}".into()),
        &vocabulary(),
    )
    .unwrap_err();
    assert!(matches!(e, StructuredError::TooComplex(_)), "{e}");
    assert!(e.to_string().contains("more than 1024 states"), "{e}");
    Guide::compile(
        &StructuredOutput::Regex("[ab]*a[ab]{7}".into()),
        &vocabulary(),
    )
    .unwrap();
    // Parses, but no token spells a "z".
    let e = Guide::compile(&StructuredOutput::Regex("z".into()), &vocabulary()).unwrap_err();
    assert!(matches!(e, StructuredError::Vocabulary(_)), "{e}");
    // An anchor inside can never hold (before, this failed on the vocabulary, which was not
    // what was wrong); anchors at the ends are the whole match anyway.
    let e = StructuredOutput::Regex("1$0".into())
        .validate()
        .unwrap_err();
    assert!(matches!(e, StructuredError::Regex(_)), "{e}");
    assert!(e.to_string().contains("can never match"), "{e}");
    assert_eq!(
        walk(StructuredOutput::Regex("^1|^0$".into()), &[]),
        vec![0, 1]
    );
}

#[test]
fn a_schema_holding_the_reserved_mark_text_is_refused_by_validate_as_by_compile() {
    // Found by fuzzing: validate accepted it, compiling refused it.
    let schema =
        r#"{"type": "object", "properties": {"okpd-free-json-value-1d7c5en": {"type": "number"}}}"#;
    let spec = StructuredOutput::JsonSchema(schema.into());
    let validated = spec.validate().unwrap_err();
    let compiled = Guide::compile(&spec, &vocabulary()).unwrap_err();
    assert_eq!(validated, compiled);
    assert!(
        validated.to_string().contains("`pd-free-json` is reserved"),
        "{validated}"
    );
}

#[test]
fn an_automaton_past_the_state_cap_is_refused_once_it_outgrows_room_for_the_cap() {
    // Whole (as the index builds it), `a[ab]{24}`'s DFA has 2^25 states: refused after about
    // four times the cap's states, not after 32 MiB of them.
    let e = check_states("a[ab]{24}").unwrap_err();
    assert!(matches!(e, StructuredError::TooComplex(_)), "{e}");
    // A schema (found by fuzzing) whose regex's automaton is far past the cap: 29 s of the
    // fuzz build before, well under a second now.
    let schema = r##"{"$defs": {"c": {"enum": ["red", "green", 1, null]}}, "type": "object",
        "$roperties": {"c": {"$ref": "#/$defs/c"}, "ok": {"type": "bool>ean"},
        "n": {"type": "number"}}}"##;
    let spec = StructuredOutput::JsonSchema(schema.into());
    spec.validate().unwrap();
    match Guide::compile(&spec, &vocabulary()) {
        Ok(_) | Err(StructuredError::TooComplex(_) | StructuredError::Vocabulary(_)) => {}
        Err(e) => panic!("{e}"),
    }
    // Another (fuzzing again): an array without `items` but with `minItems`, which outlines
    // unrolls into nested values. Far past the cap anchored already, it is refused while its
    // anchored states are counted, before its whole DFA is built (21 s of the fuzz build).
    for schema in [
        r#"{"type": "array", "{items": {"type": "object"}, "minItems": 1}"#,
        r#"{"type": "array", "items": {"type": "object", "prop(rties": {"y": {}},
            "additionalPropert`es": false}, "minItems": 1}"#,
    ] {
        let e = Guide::compile(&StructuredOutput::JsonSchema(schema.into()), &vocabulary())
            .unwrap_err();
        assert!(matches!(e, StructuredError::TooComplex(_)), "{e}");
    }
}

#[test]
fn the_sampler_chooses_only_what_the_guide_allows_on_the_host_and_on_a_backend() {
    use crate::sampling::device::{DeviceSampleRow, sample_row};
    use crate::sampling::{Sampler, SamplingParams};

    let guide = Arc::new(
        Guide::compile(&StructuredOutput::Regex("[0-9]{2}".into()), &vocabulary()).unwrap(),
    );
    let params = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    // What the model would rather say: "a", "yes" and EOS.
    let mut logits = vec![0.0f32; 102];
    for id in [4, 5, EOS] {
        logits[id as usize] = 12.0;
    }
    let mut lengths = [0usize; 3];
    for seed in 0..24 {
        let mut host = Sampler::new(&params, seed, &[EOS, EOS2]).with_guide(guide.clone());
        let mut dev = Sampler::new(&params, seed, &[EOS, EOS2]).with_guide(guide.clone());
        let mut output = Vec::new();
        loop {
            let token = host.sample(&logits, &[], &output).token_id;
            let plan = dev.device_plan(&[], &output, logits.len()).expect("a plan");
            let reshape = plan.reshape.as_ref().expect("the guide's edits");
            assert!(reshape.allowed_only);
            let sample = sample_row(&logits, &DeviceSampleRow::planned(0, &plan));
            assert_eq!(
                dev.accept(sample).token_id,
                token,
                "seed {seed}: same token"
            );
            if token == EOS || token == EOS2 {
                break;
            }
            assert!(
                [0, 1, 2, 3].contains(&token),
                "seed {seed}: {token} is no digit"
            );
            output.push(token);
        }
        // Two digits, spelt as "1" "2" or as "12": then EOS, never before.
        let digits: usize = output.iter().map(|&t| if t == 3 { 2 } else { 1 }).sum();
        assert_eq!(digits, 2, "seed {seed}: {output:?}");
        lengths[output.len()] += 1;
    }
    // Both spellings were drawn.
    assert!(lengths[1] > 0 && lengths[2] > 0, "{lengths:?}");
}

#[test]
fn a_cache_compiles_each_specification_once() {
    let cache = GuideCache::with_vocabulary(|| Ok(vocabulary()));
    let a = cache.get(&StructuredOutput::Regex("1+".into())).unwrap();
    let b = cache.get(&StructuredOutput::Regex("1+".into())).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let c = cache.get(&StructuredOutput::Regex("0+".into())).unwrap();
    assert!(!Arc::ptr_eq(&a, &c));
    // The least recently used goes once the cache is full; the one just used stays.
    for n in 0..GUIDE_CACHE_ENTRIES {
        cache
            .get(&StructuredOutput::Regex(format!("1{{{}}}", n + 1)))
            .unwrap();
        cache.get(&StructuredOutput::Regex("0+".into())).unwrap();
    }
    assert!(Arc::ptr_eq(
        &c,
        &cache.get(&StructuredOutput::Regex("0+".into())).unwrap()
    ));
    assert!(!Arc::ptr_eq(
        &a,
        &cache.get(&StructuredOutput::Regex("1+".into())).unwrap()
    ));
}

/// Qwen3's vocabulary, its guide of `spec`, and its EOS ids.
fn qwen3_guide(spec: &StructuredOutput) -> (crate::tokenizer::Tokenizer, Arc<Guide>, Vec<u32>) {
    let tokenizer = crate::tokenizer::Tokenizer::qwen3().unwrap();
    let eos = vec![
        tokenizer.token_id("<|im_end|>").unwrap(),
        tokenizer.token_id("<|endoftext|>").unwrap(),
    ];
    let vocabulary = GuideVocabulary::from_tokenizer(&tokenizer, &eos).unwrap();
    let guide = Guide::compile(spec, &vocabulary).unwrap();
    (tokenizer, Arc::new(guide), eos)
}

/// Every ordinary token but the EOS ones, with its bytes: what a mask is checked against.
fn ordinary_tokens(tokenizer: &crate::tokenizer::Tokenizer, eos: &[u32]) -> Vec<(u32, Vec<u8>)> {
    tokenizer
        .ordinary_tokens()
        .filter(|(id, _)| !eos.contains(id))
        .map(|(id, b)| (id, b.to_vec()))
        .collect()
}

fn qwen3_json() -> (crate::tokenizer::Tokenizer, Arc<Guide>, Vec<u32>) {
    qwen3_guide(&StructuredOutput::JsonObject)
}

/// Noisy logits over Qwen3's vocabulary with closing brackets and quotes drawn more often,
/// so guided outputs end within a few hundred tokens, and EOS the most likely token of all,
/// so it is taken wherever it is allowed.
fn closing_logits(tokenizer: &crate::tokenizer::Tokenizer, eos: &[u32], seed: u64) -> Vec<f32> {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut logits: Vec<f32> = (0..tokenizer.vocab_size())
        .map(|_| rng.random::<f32>() * 4.0)
        .collect();
    for (id, bytes) in tokenizer.ordinary_tokens() {
        if bytes.contains(&b'}') || bytes.contains(&b'"') || bytes.contains(&b']') {
            logits[id as usize] += 3.0;
        }
    }
    for &id in eos {
        logits[id as usize] = 30.0;
    }
    logits
}

/// A sampler guided by `guide` at temperature 1, drawing from `logits` until EOS: the
/// tokens before it.
fn sample_until_eos(guide: &Arc<Guide>, eos: &[u32], logits: &[f32], seed: u64) -> Vec<u32> {
    use crate::sampling::{Sampler, SamplingParams};
    let params = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(&params, seed, eos).with_guide(guide.clone());
    let mut output = Vec::new();
    loop {
        let token = sampler.sample(logits, &[], &output).token_id;
        if eos.contains(&token) {
            return output;
        }
        output.push(token);
        assert!(output.len() < 2_000, "seed {seed}: no end in sight");
    }
}

/// Along Qwen3's own tokenization of JSON texts, every step allows exactly the tokens whose
/// bytes continue a JSON object (checked against each of the 151k tokens walked alone), and
/// EOS exactly at the end.
#[test]
fn any_json_object_allows_exactly_the_qwen3_tokens_that_continue_one() {
    let (tokenizer, guide, eos) = qwen3_json();
    let ordinary = ordinary_tokens(&tokenizer, &eos);
    let mut state = GuideState::new(guide.clone());
    for text in [
        "{\"name\": \"Ada\", \"tags\": [\"x\", 1.5e-3, true, null], \"nested\": {\"k\": []}}",
        "{\n    \"caf\u{e9}\": \"\u{4f60}\u{597d} \\u00e9\\ud83d\\ude00\",\n    \"n\": -0.25\n}",
    ] {
        let ids = tokenizer.encode(text).unwrap();
        let mut timings = Vec::new();
        for end in 0..=ids.len() {
            let started = std::time::Instant::now();
            let mut allowed = state.allowed(&ids[..end]).to_vec();
            timings.push(started.elapsed());
            allowed.sort_unstable();
            let prefix = JsonState::START
                .walk(&tokenizer.decode(&ids[..end], false).unwrap().into_bytes())
                .unwrap();
            let mut expected: Vec<u32> = if prefix.is_complete() {
                eos.clone()
            } else {
                ordinary
                    .iter()
                    .filter(|(_, b)| prefix.walk(b).is_some())
                    .map(|&(id, _)| id)
                    .collect()
            };
            expected.sort_unstable();
            assert_eq!(allowed.len(), expected.len(), "{text:?} after {end} tokens");
            assert_eq!(allowed, expected, "{text:?} after {end} tokens");
            if end < ids.len() {
                assert!(allowed.binary_search(&ids[end]).is_ok());
            }
        }
        // Not asserted (timing): what a mask cost, first met and found again.
        eprintln!("{} masks, {timings:?}", timings.len());
    }
}

/// A sampler guided by any JSON object over Qwen3's vocabulary, drawing from noisy logits,
/// ends every output with EOS right after a whole JSON object, never before.
#[test]
fn sampled_outputs_are_json_objects() {
    // Not only `{}`: objects with members were drawn.
    assert!(sampled_object_members(&StructuredOutput::JsonObject, 3, 12) > 0);
}

/// Samples `count` outputs (seeds 0..count) guided by `spec` over Qwen3's vocabulary from
/// [`closing_logits`] of `logits_seed`, each of which must be a JSON object that serde_json
/// reads, ended by EOS; returns their members, counted.
fn sampled_object_members(spec: &StructuredOutput, logits_seed: u64, count: u64) -> usize {
    let (tokenizer, guide, eos) = qwen3_guide(spec);
    let logits = closing_logits(&tokenizer, &eos, logits_seed);
    (0..count)
        .map(|seed| {
            let output = sample_until_eos(&guide, &eos, &logits, seed);
            let text = tokenizer.decode(&output, false).unwrap();
            let object: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            object.len()
        })
        .sum()
}

/// A schema that asks for an object and nothing of it is guided as any JSON object (as a
/// regex it nests past the state cap); one that narrows it stays a regex.
#[test]
fn a_schema_of_any_object_is_guided_by_the_json_grammar() {
    for schema in [
        r#"{"type": "object"}"#,
        r#"{"type": "object", "title": "T", "description": "d", "properties": {}}"#,
        r#"{"type": "object", "additionalProperties": true, "required": []}"#,
    ] {
        let spec = StructuredOutput::JsonSchema(schema.into());
        assert!(spec.is_any_json_object(), "{schema}");
        spec.validate().unwrap();
        let guide = Arc::new(Guide::compile(&spec, &vocabulary()).unwrap());
        let mut state = GuideState::new(guide);
        // "{" then "}" then EOS: tokens 9 and 10 of the small vocabulary.
        assert_eq!(state.allowed(&[]), &[9]);
        assert!(state.allowed(&[9]).contains(&10));
        let mut end = state.allowed(&[9, 10]).to_vec();
        end.sort_unstable();
        assert_eq!(end, vec![EOS, EOS2]);
    }
    for schema in [
        r#"{}"#,
        r#"{"type": "object", "properties": {"a": {"type": "string"}}}"#,
        r#"{"type": "object", "additionalProperties": false}"#,
        r#"{"type": "object", "minProperties": 1}"#,
        r#"{"type": "array"}"#,
    ] {
        let spec = StructuredOutput::JsonSchema(schema.into());
        assert!(!spec.is_any_json_object(), "{schema}");
    }
    let long = format!(
        r#"{{"type": "object", "description": "{}"}}"#,
        "x".repeat(MAX_STRUCTURED_SPEC_BYTES)
    );
    let e = StructuredOutput::JsonSchema(long).validate().unwrap_err();
    assert!(matches!(e, StructuredError::TooLong { .. }), "{e}");
}

/// A schema with free-form parts (pydantic's `dict[str, Any]` and `Any` fields) is guided,
/// not refused: along Qwen3's tokenization of matching texts every step allows exactly the
/// tokens the recognizer takes one by one, EOS exactly at the end, and sampled outputs
/// keep the schema's fixed parts.
#[test]
fn a_schema_with_free_form_parts_is_guided_over_qwen3() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "meta": {"type": "object", "additionalProperties": true, "title": "Meta"},
            "payload": {"title": "Payload"},
        },
        "required": ["name", "meta", "payload"],
    });
    let spec = StructuredOutput::JsonSchema(schema.to_string());
    spec.validate().unwrap();
    let (tokenizer, guide, eos) = qwen3_guide(&spec);
    assert!(matches!(guide.kind, GuideKind::Free(..)), "{guide:?}");
    let ordinary: Vec<u32> = tokenizer
        .ordinary_tokens()
        .map(|(id, _)| id)
        .filter(|id| !eos.contains(id))
        .collect();
    let mut state = GuideState::new(guide.clone());
    for text in [
        r#"{"name":"Ada","meta":{"k":[1,{"x":null}]},"payload":12}"#,
        r#"{ "name": "b", "meta": {}, "payload": "caf\u00e9 \ud83d\ude00" }"#,
    ] {
        let ids = tokenizer.encode(text).unwrap();
        for end in 0..=ids.len() {
            let mut allowed = state.allowed(&ids[..end]).to_vec();
            allowed.sort_unstable();
            let walk = state.walk;
            let mut expected: Vec<u32> = ordinary
                .iter()
                .copied()
                .filter(|&t| guide.next(walk, t) != Walk::Free(None))
                .collect();
            if end == ids.len() {
                assert!(
                    expected.is_empty(),
                    "{text}: nothing after the end: {:?}",
                    expected
                        .iter()
                        .take(5)
                        .map(|&t| String::from_utf8_lossy(tokenizer.bytes_of(t).unwrap())
                            .to_string())
                        .collect::<Vec<_>>()
                );
                expected.extend(&eos);
            }
            expected.sort_unstable();
            assert_eq!(allowed, expected, "{text:?} after {end} tokens");
        }
    }
    // Sampled under noise, favouring closers: what ends is the schema's shape.
    let logits = closing_logits(&tokenizer, &eos, 5);
    for seed in 0..8 {
        let output = sample_until_eos(&guide, &eos, &logits, seed);
        let text = tokenizer.decode(&output, false).unwrap();
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(value["name"].is_string(), "{text}");
        assert!(value["meta"].is_object(), "{text}");
        assert!(value.get("payload").is_some(), "{text}");
    }
}

/// A schema's regex embedded in a larger regex (a forced tool call's) keeps its free-form
/// parts: the regex's guide reads them with the JSON grammar.
#[test]
fn a_regex_holding_a_schema_with_free_form_parts_guides_them() {
    let schema = r#"{"type": "object", "properties": {"a": {}}, "required": ["a"]}"#;
    let inner = StructuredOutput::json_schema_regex(schema).unwrap();
    let spec = StructuredOutput::Regex(format!("x({inner})"));
    spec.validate().unwrap();
    let guide = Arc::new(Guide::compile(&spec, &vocabulary()).unwrap());
    assert!(matches!(guide.kind, GuideKind::Free(..)), "{guide:?}");
    // x{"a":{"a":12,"no":0}} then EOS: any value where the schema says so.
    let text: &[u32] = &[
        15, 9, 11, 4, 11, 12, 9, 11, 4, 11, 12, 1, 2, 16, 11, 6, 11, 12, 0, 10, 10,
    ];
    let mut state = GuideState::new(guide);
    for end in 0..text.len() {
        assert!(state.allowed(&text[..end]).contains(&text[end]), "{end}");
    }
    let mut last = state.allowed(text).to_vec();
    last.sort_unstable();
    assert_eq!(last, vec![EOS, EOS2]);
    // Without free-form parts the regex is outlines' own, as before.
    let plain = StructuredOutput::json_schema_regex(r#"{"type": "integer"}"#).unwrap();
    let guide = Guide::compile(&StructuredOutput::Regex(plain), &vocabulary()).unwrap();
    assert!(matches!(guide.kind, GuideKind::Regex(_)));
}

/// Inside a JSON string a guide allows nearly every token: a backend gets the few it leaves
/// out as masks (not a quarter of the vocabulary's worth of edits, which would send the row
/// to the host), and draws what the host draws.
#[test]
fn a_guide_allowing_most_tokens_travels_as_masks_of_the_rest() {
    use crate::sampling::device::{DeviceSampleRow, sample_row};
    use crate::sampling::{Sampler, SamplingParams};

    let (tokenizer, guide, eos) = qwen3_json();
    let limit = tokenizer.vocab_size();
    let logits = closing_logits(&tokenizer, &eos, 9);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 50,
        ..SamplingParams::default()
    };
    let output = tokenizer.encode("{\"k\": \"some text").unwrap();
    let mut masked = 0;
    for seed in 0..16 {
        let mut host = Sampler::new(&params, seed, &eos).with_guide(guide.clone());
        let mut dev = Sampler::new(&params, seed, &eos).with_guide(guide.clone());
        for end in 0..=output.len() {
            let token = host.sample(&logits, &[], &output[..end]).token_id;
            let plan = dev
                .device_plan(&[], &output[..end], limit)
                .expect("a backend plan, at every step");
            let reshape = plan.reshape.as_ref().expect("the guide's edits");
            if !reshape.allowed_only {
                // Masks of the ids left out: few, and nothing else.
                assert!(reshape.edits.len() < limit / 20, "{}", reshape.edits.len());
                assert!(
                    reshape
                        .edits
                        .iter()
                        .all(|e| e.ops == crate::sampling::device::edit::MASK)
                );
                masked += 1;
            }
            let sample = sample_row(&logits, &DeviceSampleRow::planned(0, &plan));
            assert_eq!(
                dev.accept(sample).token_id,
                token,
                "seed {seed}, step {end}"
            );
        }
    }
    // The string's steps went as masks.
    assert!(masked >= 16, "{masked}");
}

mod grammar;
