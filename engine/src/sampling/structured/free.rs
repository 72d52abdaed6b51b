//! JSON schemas with free-form parts: a property, an item or an alternative that accepts any
//! value (`{}`, `true`, only a title), any object (`{"type": "object"}`, pydantic's
//! `dict[str, Any]`) or any array (`{"type": "array"}`). As a regex such a part nests without
//! bound: outlines unrolls it a few levels deep and the automaton passes the guides' state
//! cap. Instead each free-form part is marked in the schema, outlines writes the regex of the
//! rest, each mark becomes one byte that no UTF-8 text holds (`0xFF` any value, `0xFE` any
//! object, `0xFC` any array), and the recognizer ([`FreeJson`]) walks that regex's automaton
//! until it reaches such a byte, where the JSON grammar (`super::json`) reads the free-form
//! value and hands back at its end.
//!
//! Where the automaton could both go on by itself and enter a free-form part, the automaton
//! goes on: the free-form part is entered only where nothing else can. So that this loses no
//! text, an `anyOf` / `oneOf` with a member of any value is any value, and a member of any
//! object (array) drops its object (array) siblings (`narrow_alternatives`). Owns the marking
//! and the recognizer; not the masks (`super::trie`).

use regex_automata::dfa::{Automaton, dense};
use regex_automata::util::primitives::StateID;
use regex_automata::{Anchored, MatchKind, nfa::thompson, util::syntax};
use serde_json::Value;

use super::json::JsonState;
use super::{MAX_GUIDE_STATES, StructuredError};

/// The byte standing for a free-form value in the regex's automaton (this and the next two
/// are the highest bytes, which UTF-8 never uses).
const ANY_VALUE: u8 = 0xFF;
/// The byte standing for a free-form object.
const ANY_OBJECT: u8 = 0xFE;
/// The byte standing for a free-form array.
const ANY_ARRAY: u8 = 0xFC;
/// The byte that ends every text in the automaton. A DFA reports a match one byte late, so
/// a byte that leads into a match state may not continue the text at all; with this end
/// byte only it can, and whether the text is whole is asked by stepping it.
const END: u8 = 0xFD;
/// The constants that mark free-form parts in the schema handed to outlines (unlikely in a
/// user's schema; one that holds them is left unmarked).
const VALUE_MARK: &str = "pd-free-json-value-1d7c5e";
const OBJECT_MARK: &str = "pd-free-json-object-1d7c5e";
const ARRAY_MARK: &str = "pd-free-json-array-1d7c5e";

/// The schema with every free-form part marked, or `None` when it has none (or is not JSON).
pub(super) fn mark(schema: &str) -> Option<String> {
    if schema.contains(VALUE_MARK) || schema.contains(OBJECT_MARK) || schema.contains(ARRAY_MARK) {
        return None;
    }
    let mut value: Value = serde_json::from_str(schema).ok()?;
    let root = value.clone();
    mark_schema(&mut value, &root).then(|| value.to_string())
}

/// Replaces free-form parts at and below `schema` (`root` resolves `$ref`s); true if any was.
fn mark_schema(schema: &mut Value, root: &Value) -> bool {
    split_types(schema);
    narrow_alternatives(schema, root);
    if let Some(mark) = free_form(schema) {
        *schema = serde_json::json!({ "const": mark });
        return true;
    }
    let Value::Object(fields) = schema else {
        return false;
    };
    let mut marked = false;
    for (key, value) in fields.iter_mut() {
        marked |= match (key.as_str(), value) {
            ("properties" | "$defs" | "definitions", Value::Object(map)) => map
                .values_mut()
                .fold(false, |m, v| mark_schema(v, root) | m),
            // A map's values (outlines honours them where there are no properties).
            ("additionalProperties", v @ Value::Object(_)) => mark_schema(v, root),
            ("items", v @ (Value::Object(_) | Value::Bool(true))) => mark_schema(v, root),
            ("items" | "prefixItems" | "anyOf" | "oneOf", Value::Array(list)) => {
                list.iter_mut().fold(false, |m, v| mark_schema(v, root) | m)
            }
            _ => false,
        };
    }
    marked
}

/// A list of types (`"type": ["object", "null"]`, or OpenAPI's `"nullable": true`) as an
/// `anyOf` of one type each, the other keywords with every one (a keyword of another type
/// is ignored there, as JSON Schema says), so that an any-object or any-array member is
/// found. Applied to marked schemas only: one without free-form parts goes to outlines as
/// written.
fn split_types(schema: &mut Value) {
    let Value::Object(fields) = schema else {
        return;
    };
    let nullable = fields.get("nullable") == Some(&Value::Bool(true));
    let types: Vec<Value> = match fields.get("type") {
        Some(Value::Array(list)) => list.clone(),
        Some(t @ Value::String(_)) if nullable => vec![t.clone(), Value::String("null".into())],
        _ => return,
    };
    if types.len() < 2 {
        return;
    }
    let mut rest = fields.clone();
    rest.remove("type");
    rest.remove("nullable");
    let members: Vec<Value> = types
        .into_iter()
        .map(|t| {
            let mut member = rest.clone();
            member.insert("type".into(), t);
            Value::Object(member)
        })
        .collect();
    *schema = serde_json::json!({ "anyOf": members });
}

/// An `anyOf` / `oneOf` with a free-form member: the regex would go its other members' way
/// wherever they can start (`FreeJson::step`), so a text only the free-form member takes
/// could not be written. A member of any value makes the whole choice any value; one of any
/// object (or array) takes over the other object (array) members, which it holds.
fn narrow_alternatives(schema: &mut Value, root: &Value) {
    let Value::Object(fields) = schema else {
        return;
    };
    for key in ["anyOf", "oneOf"] {
        let Some(Value::Array(members)) = fields.get_mut(key) else {
            continue;
        };
        if members.iter().any(|m| free_form(m) == Some(VALUE_MARK)) {
            fields.remove(key);
            if fields.keys().all(|k| ANNOTATIONS.contains(&k.as_str())) {
                *schema = Value::Bool(true);
                return;
            }
            continue;
        }
        for (mark, kind) in [(OBJECT_MARK, "object"), (ARRAY_MARK, "array")] {
            if members.iter().any(|m| free_form(m) == Some(mark)) {
                members.retain(|m| free_form(m) == Some(mark) || json_type(m, root) != Some(kind));
            }
        }
    }
}

/// The JSON type a schema's values have, where it says (through one `$ref`).
fn json_type<'a>(schema: &'a Value, root: &'a Value) -> Option<&'a str> {
    let schema = match schema.get("$ref").and_then(Value::as_str) {
        Some(reference) => root.pointer(reference.strip_prefix('#')?)?,
        None => schema,
    };
    match schema.get("type").and_then(Value::as_str) {
        Some(t) => Some(t),
        None if schema.get("properties").is_some() => Some("object"),
        None if schema.get("items").is_some() || schema.get("prefixItems").is_some() => {
            Some("array")
        }
        None => None,
    }
}

/// Keys that say nothing about a value.
const ANNOTATIONS: [&str; 7] = [
    "title",
    "description",
    "$comment",
    "examples",
    "default",
    "$schema",
    "$id",
];

/// Which mark stands for `schema`, if it accepts any value, any object or any array.
fn free_form(schema: &Value) -> Option<&'static str> {
    let only = |fields: &serde_json::Map<String, Value>, extra: &[(&str, &Value)]| {
        fields.iter().all(|(k, v)| {
            ANNOTATIONS.contains(&k.as_str()) || extra.iter().any(|(ek, ev)| ek == k && *ev == v)
        })
    };
    match schema {
        Value::Bool(true) => Some(VALUE_MARK),
        Value::Object(fields) if only(fields, &[]) => Some(VALUE_MARK),
        Value::Object(_) if super::any_object_value(schema) => Some(OBJECT_MARK),
        Value::Object(fields)
            if only(
                fields,
                &[
                    ("type", &Value::String("array".into())),
                    ("items", &Value::Bool(true)),
                    ("items", &serde_json::json!({})),
                ],
            ) && fields.get("type") == Some(&Value::String("array".into())) =>
        {
            Some(ARRAY_MARK)
        }
        _ => None,
    }
}

/// The regex of any JSON object: one free-form part alone.
pub(super) fn any_object_regex() -> String {
    format!("\"{}\"", regex_syntax::escape(OBJECT_MARK))
}

/// The regex (outlines' of a marked schema, or one holding such a regex) has marks.
pub(super) fn has_marks(regex: &str) -> bool {
    [VALUE_MARK, OBJECT_MARK, ARRAY_MARK]
        .iter()
        .any(|mark| regex.contains(&regex_syntax::escape(mark)))
}

/// A marked schema's regex over bytes, each free-form part one reserved byte.
pub(crate) struct FreeJson {
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
}

/// Where a text stands: the automaton's state, and inside a free-form part the JSON
/// grammar's (the automaton then waits past the part's byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FreeState {
    dfa: StateID,
    part: Option<JsonState>,
}

impl FreeState {
    /// Inside a string of a free-form part, between characters (what the automaton's own
    /// strings are is its business: those are walked).
    pub(crate) fn in_plain_string(&self) -> bool {
        self.part.is_some_and(|p| p.in_plain_string())
    }
}

/// `regex` with each free-form part's mark replaced by its byte; refused where text of a mark
/// is left elsewhere (a schema or regex holding the marks' reserved text itself), which
/// [`super::StructuredOutput::validate`] checks too, so that what validates compiles.
pub(super) fn bytes_regex(regex: &str) -> Result<String, StructuredError> {
    let mut bytes_regex = regex.to_string();
    for (mark, byte) in [
        (VALUE_MARK, ANY_VALUE),
        (OBJECT_MARK, ANY_OBJECT),
        (ARRAY_MARK, ANY_ARRAY),
    ] {
        let literal = format!("\"{}\"", regex_syntax::escape(mark));
        bytes_regex = bytes_regex.replace(&literal, &format!("(?-u:\\x{byte:02X})"));
    }
    if bytes_regex.contains("pd\\-free\\-json") {
        return Err(StructuredError::Schema(
            "a free-form part of the schema could not be placed (the text `pd-free-json` is \
             reserved)"
                .into(),
        ));
    }
    Ok(bytes_regex)
}

impl FreeJson {
    /// From the regex outlines wrote for a marked schema.
    pub(super) fn new(regex: &str) -> Result<Self, StructuredError> {
        let bytes_regex = format!("(?:{})(?-u:\\x{END:02X})", bytes_regex(regex)?);
        let too_complex = || {
            StructuredError::TooComplex(format!(
                "the schema's automaton has more than {MAX_GUIDE_STATES} states; simplify it"
            ))
        };
        let limit = Some(super::states::DFA_BUILD_LIMIT);
        let dfa = dense::Builder::new()
            .syntax(syntax::Config::new().utf8(false))
            .thompson(thompson::Config::new().utf8(false))
            .configure(
                dense::Config::new()
                    // Every way the text may go on is kept, not only the leftmost match's.
                    .match_kind(MatchKind::All)
                    .determinize_size_limit(limit)
                    .dfa_size_limit(limit),
            )
            .build(&bytes_regex)
            .map_err(|_| too_complex())?;
        let start = dfa.universal_start_state(Anchored::Yes).ok_or_else(|| {
            StructuredError::Regex("the schema's regex has no single start".into())
        })?;
        if !super::states::within_state_cap(&dfa, start) {
            return Err(too_complex());
        }
        Ok(Self { dfa, start })
    }

    pub(crate) fn start(&self) -> FreeState {
        FreeState {
            dfa: self.start,
            part: None,
        }
    }

    fn go(&self, state: StateID, byte: u8) -> Option<StateID> {
        let next = self.dfa.next_state(state, byte);
        let alive = !self.dfa.is_dead_state(next)
            && !self.dfa.is_quit_state(next)
            // Only the end byte completes a match: a match state after any other byte is
            // the end of a match before it.
            && !self.dfa.is_match_state(next);
        alive.then_some(next)
    }

    /// The state after one more byte, or `None` if the text can no longer match.
    pub(crate) fn step(&self, s: FreeState, b: u8) -> Option<FreeState> {
        if let Some(part) = s.part {
            if let Some(part) = part.step(b) {
                return Some(FreeState {
                    dfa: s.dfa,
                    part: Some(part),
                });
            }
            // The byte after a whole free-form value is the automaton's again.
            if !part.can_end() {
                return None;
            }
            return self.step(
                FreeState {
                    dfa: s.dfa,
                    part: None,
                },
                b,
            );
        }
        // The reserved bytes stand for parts of the text; no UTF-8 text holds them (but a
        // byte-level vocabulary has a token of each).
        if b >= ANY_ARRAY {
            return None;
        }
        if let Some(dfa) = self.go(s.dfa, b) {
            return Some(FreeState { dfa, part: None });
        }
        [
            (ANY_VALUE, JsonState::VALUE),
            (ANY_OBJECT, JsonState::START),
            (ANY_ARRAY, JsonState::ARRAY),
        ]
        .into_iter()
        .find_map(|(byte, start)| {
            let dfa = self.go(s.dfa, byte)?;
            Some(FreeState {
                dfa,
                part: Some(start.step(b)?),
            })
        })
    }

    /// The text so far is a whole match.
    pub(crate) fn is_match(&self, s: FreeState) -> bool {
        s.part.is_none_or(|p| p.can_end())
            && self
                .go(s.dfa, END)
                .is_some_and(|end| self.dfa.is_match_state(self.dfa.next_eoi_state(end)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::StructuredOutput;
    use super::*;

    fn guide(schema: &Value) -> FreeJson {
        let marked = mark(&schema.to_string()).expect("free-form parts");
        let regex = StructuredOutput::JsonSchema(marked).regex().unwrap();
        FreeJson::new(&regex).unwrap()
    }

    fn matches(g: &FreeJson, text: &str) -> bool {
        text.bytes()
            .try_fold(g.start(), |s, b| g.step(s, b))
            .is_some_and(|s| g.is_match(s))
    }

    fn alive(g: &FreeJson, text: &str) -> bool {
        text.bytes()
            .try_fold(g.start(), |s, b| g.step(s, b))
            .is_some()
    }

    #[test]
    fn free_form_parts_take_any_json_and_the_rest_keeps_its_shape() {
        let g = guide(&serde_json::json!({
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "meta": {"type": "object", "additionalProperties": true, "title": "Meta"},
                "extra": {},
                "list": {"type": "array", "items": {"title": "Any"}},
            },
            "required": ["id", "meta", "extra", "list"],
        }));
        for ok in [
            r#"{"id":1,"meta":{},"extra":null,"list":[]}"#,
            r#"{"id":12,"meta":{"a":[1,{"b":"}"}]},"extra":-3.5e2,"list":[1,"x",[],{"k":true}]}"#,
            r#"{ "id": 1, "meta": {"deep": [[[{}]]]}, "extra": "s", "list": [12, 3] }"#,
            r#"{"id":1,"meta":{},"extra":12,"list":[7]}"#,
        ] {
            assert!(matches(&g, ok), "{ok}");
            serde_json::from_str::<Value>(ok).unwrap();
        }
        for (bad, alive_for) in [
            (r#"{"id":"1""#, 6),
            (r#"{"id":1,"meta":[]"#, 15),
            (r#"{"id":1,"meta":{},"extra":nul}"#, 29),
            (r#"{"id":1,"meta":{},"extra":1,"list":[1,]}"#, 38),
        ] {
            assert!(alive(&g, &bad[..alive_for]), "{bad} up to {alive_for}");
            assert!(!alive(&g, &bad[..=alive_for]), "{bad} dies at {alive_for}");
        }
        // The reserved bytes are no text: not where a free-form part stands, not at the end.
        let walked = |bytes: &[u8]| bytes.iter().try_fold(g.start(), |s, &b| g.step(s, b));
        for byte in [ANY_VALUE, ANY_OBJECT, END] {
            assert!(walked(&[br#"{"id":1,"meta":"#.as_slice(), &[byte]].concat()).is_none());
            let whole = br#"{"id":1,"meta":{},"extra":1,"list":[]}"#;
            assert!(walked(&[whole.as_slice(), &[byte]].concat()).is_none());
        }
        // Whole only at the end.
        let text = r#"{"id":1,"meta":{},"extra":12,"list":[]}"#;
        for end in 0..text.len() {
            assert!(!matches(&g, &text[..end]), "{}", &text[..end]);
        }
    }

    #[test]
    fn a_schema_of_any_value_and_alternatives() {
        let g = guide(&serde_json::json!({}));
        for ok in ["1", "12.5", "\"s\"", "[1,[2]]", "{\"a\":null}", "true"] {
            assert!(matches(&g, ok), "{ok}");
        }
        assert!(!alive(&g, " 1") && !matches(&g, "1 "));
        // A string or anything: a string goes the string's way, anything else is free.
        let g = guide(&serde_json::json!({"anyOf": [{"type": "string"}, true]}));
        for ok in ["\"s\"", "[1]", "{}", "-1"] {
            assert!(matches(&g, ok), "{ok}");
        }
    }

    /// What pydantic writes for `Union[int, Any]`, `Union[Model, dict[str, Any]]`,
    /// `dict[str, dict[str, Any]]`, `dict[str, list[Any]]` and a bare `list`: every text
    /// the schema accepts can be written, nothing else.
    #[test]
    fn alternatives_maps_and_arrays_with_free_form_parts() {
        let cases = [
            (
                serde_json::json!({"anyOf": [{"type": "integer"}, {}]}),
                vec!["1", "1.5", "-1e3", "\"x\"", "[]"],
                vec!["1 ", "{"],
            ),
            (
                serde_json::json!({
                    "$defs": {"M": {"type": "object", "properties": {"k": {"type": "integer"}},
                        "required": ["k"]}},
                    "anyOf": [{"$ref": "#/$defs/M"},
                        {"type": "object", "additionalProperties": true}],
                }),
                vec!["{}", "{\"z\":1}", "{\"k\":1}", "{\"k\":\"s\"}"],
                vec!["[]", "1"],
            ),
            (
                serde_json::json!({"type": "object", "additionalProperties":
                    {"type": "object", "additionalProperties": true}}),
                vec!["{}", "{\"a\":{\"b\":[1]}}", "{\"a\":{},\"b\":{\"c\":null}}"],
                vec!["{\"a\":1}", "{\"a\":[]}"],
            ),
            (
                serde_json::json!({"type": "object", "additionalProperties":
                    {"type": "array", "items": {}}}),
                vec!["{\"a\":[1,{}]}", "{\"a\":[],\"b\":[\"x\"]}"],
                vec!["{\"a\":1}", "{\"a\":{}}"],
            ),
            (
                serde_json::json!({"type": "object", "properties": {
                    "a": {"type": ["object", "null"]},
                    "b": {"type": "object", "nullable": true, "title": "B"},
                    "c": {"type": ["integer", "array"]}},
                    "required": ["a", "b", "c"]}),
                vec![
                    "{\"a\":null,\"b\":null,\"c\":1}",
                    "{\"a\":{\"x\":[1]},\"b\":{},\"c\":[\"s\",{}]}",
                ],
                vec![
                    "{\"a\":1,\"b\":null,\"c\":1}",
                    "{\"a\":null,\"b\":null,\"c\":\"s\"}",
                ],
            ),
            (
                serde_json::json!({"type": "object", "properties":
                    {"l": {"type": "array"}, "m": {"type": "array", "items": true}},
                    "required": ["l", "m"]}),
                vec!["{\"l\":[[1],{}],\"m\":[]}", "{\"l\":[],\"m\":[null,\"s\"]}"],
                vec!["{\"l\":{},\"m\":[]}", "{\"l\":[],\"m\":1}"],
            ),
        ];
        for (schema, good, bad) in cases {
            let g = guide(&schema);
            for text in good {
                assert!(matches(&g, text), "{schema}: {text}");
            }
            for text in bad {
                assert!(!matches(&g, text), "{schema}: {text}");
            }
        }
    }

    #[test]
    fn schemas_without_free_form_parts_are_left_alone() {
        for schema in [
            r#"{"type": "object", "properties": {"a": {"type": "string"}}}"#,
            r#"{"type": "object", "additionalProperties": false}"#,
            r#"{"enum": [1, 2]}"#,
            "not json",
        ] {
            assert_eq!(mark(schema), None, "{schema}");
        }
        let own = format!(r#"{{"properties": {{"a": {{"const": "{VALUE_MARK}"}}, "b": {{}}}}}}"#);
        assert_eq!(mark(&own), None);
    }
}
