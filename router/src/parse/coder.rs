//! Qwen3-Coder's tool calls (`--tool-call-parser qwen3_coder`), as vLLM's
//! `Qwen3CoderToolParser` reads them: inside a `<tool_call>` block, `<function=NAME>` then
//! `<parameter=NAME>` … `</parameter>` pieces, each value the text between with one leading
//! and one trailing newline dropped, and converted by the type the request's tool schema gives
//! that parameter. The arguments are written as Python's `json.dumps` writes the dict vLLM
//! builds (`{"a": 1, "b": "x"}`).
//!
//! Not here: finding the blocks and the pieces in a streamed answer (the parser does that).

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

pub(super) const FUNCTION_START: &str = "<function=";
pub(super) const FUNCTION_END: &str = "</function>";
pub(super) const PARAMETER_START: &str = "<parameter=";
pub(super) const PARAMETER_END: &str = "</parameter>";

/// The request's tools, read for their parameters' types: per function name (the first tool
/// of that name), its `parameters.properties` (or `parameters` itself when it has no
/// `properties`, as vLLM reads it).
#[derive(Debug, Clone, Default)]
pub struct Schemas {
    functions: HashMap<String, serde_json::Map<String, Value>>,
}

impl Schemas {
    /// From the request's `tools` (OpenAI's `{"type": "function", "function": {"name",
    /// "parameters"}}`); anything else in the list is passed over.
    pub fn new<'a>(tools: impl IntoIterator<Item = &'a Value>) -> Self {
        let mut functions = HashMap::new();
        for tool in tools {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                continue;
            }
            let function = &tool["function"];
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let properties = match function.get("parameters") {
                Some(Value::Object(p)) => match p.get("properties") {
                    Some(Value::Object(props)) => props.clone(),
                    Some(_) => serde_json::Map::new(),
                    None => p.clone(),
                },
                _ => serde_json::Map::new(),
            };
            functions.entry(name.to_string()).or_insert(properties);
        }
        Self { functions }
    }

    /// From a request's tools: its `ChatInput.tools` (none for a text or token-id input).
    pub fn of_request(request: &pd_proto::pb::GenerateRequest) -> Self {
        let tools = match &request.input {
            Some(pd_proto::pb::generate_request::Input::Chat(chat)) => chat.tools.as_slice(),
            _ => &[],
        };
        Self::from_texts(tools.iter().map(String::as_str))
    }

    /// From tools as JSON texts (the gRPC `ChatInput.tools`); texts that are not JSON are
    /// passed over.
    pub fn from_texts<'a>(tools: impl IntoIterator<Item = &'a str>) -> Self {
        let values: Vec<Value> = tools
            .into_iter()
            .filter_map(|t| serde_json::from_str(t).ok())
            .collect();
        Self::new(&values)
    }

    /// Parameter `name` of `function`, its value `raw` (newlines already stripped), as the
    /// JSON text vLLM writes for it.
    pub fn convert(&self, function: &str, name: &str, raw: &str) -> String {
        // "null", any case, is null whatever the type, as vLLM reads it.
        if raw.to_lowercase() == "null" {
            return "null".into();
        }
        let Some(schema) = self.functions.get(function).and_then(|p| p.get(name)) else {
            return string(raw);
        };
        let kind = match schema.as_object().and_then(|s| s.get("type")) {
            None => "string".to_string(),
            Some(Value::String(t)) => t.trim().to_lowercase(),
            // Python's `str()` of a list or other value matches none of the names.
            Some(_) => "\u{0}other".to_string(),
        };
        let starts = |prefixes: &[&str]| prefixes.iter().any(|p| kind.starts_with(p));
        if ["string", "str", "text", "varchar", "char", "enum"].contains(&kind.as_str()) {
            string(raw)
        } else if starts(&["int", "uint", "long", "short", "unsigned"]) {
            python_int(raw).unwrap_or_else(|| string(raw))
        } else if starts(&["num", "float"]) {
            python_float(raw).unwrap_or_else(|| string(raw))
        } else if ["boolean", "bool", "binary"].contains(&kind.as_str()) {
            (raw.to_lowercase() == "true").to_string()
        } else {
            let json =
                ["object", "array", "arr"].contains(&kind.as_str()) || starts(&["dict", "list"]);
            let parsed = serde_json::from_str::<Py>(raw).ok();
            match parsed {
                Some(v) if json => v.dumps(),
                // `ast.literal_eval` for the rest: JSON without true/false/null reads the
                // same as a Python literal.
                Some(v) if v.is_python_literal() => v.dumps(),
                _ => string(raw),
            }
        }
    }
}

/// A JSON string, as `json.dumps(…, ensure_ascii=False)` writes it.
pub(super) fn string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// `s` without digit-separating underscores, if every underscore is between two digits.
fn without_underscores(s: &str) -> Option<String> {
    let b = s.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        if c == b'_'
            && !(i > 0 && b[i - 1].is_ascii_digit() && b.get(i + 1).is_some_and(u8::is_ascii_digit))
        {
            return None;
        }
    }
    Some(s.replace('_', ""))
}

/// Python's `int(s)`, written as JSON: `None` where Python raises.
fn python_int(s: &str) -> Option<String> {
    let s = without_underscores(s.trim())?;
    let (minus, digits) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s.as_str()),
    };
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let digits = digits.trim_start_matches('0');
    Some(match (digits.is_empty(), minus) {
        (true, _) => "0".into(),
        (false, true) => format!("-{digits}"),
        (false, false) => digits.into(),
    })
}

/// vLLM's number conversion: Python's `float(s)`, a whole one written as an integer; `None`
/// where Python raises (infinities and NaN included: `int()` of them raises).
fn python_float(s: &str) -> Option<String> {
    let s = without_underscores(s.trim())?;
    let f: f64 = s.parse().ok()?;
    if !f.is_finite() {
        return None;
    }
    Some(if f.fract() == 0.0 {
        if f == 0.0 {
            "0".into()
        } else {
            format!("{f:.0}")
        }
    } else {
        float_repr(f)
    })
}

/// Python's `repr` of a finite float: the shortest digits that read back, fixed between
/// 1e-4 and 1e16, else `d.ddde±XX`.
fn float_repr(f: f64) -> String {
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let whole = exp as usize + 1;
            if digits.len() <= whole {
                let _ = write!(out, "{digits}{}.0", "0".repeat(whole - digits.len()));
            } else {
                let _ = write!(out, "{}.{}", &digits[..whole], &digits[whole..]);
            }
        } else {
            let _ = write!(out, "0.{}{digits}", "0".repeat((-exp - 1) as usize));
        }
    } else {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            let _ = write!(out, ".{rest}");
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
    out
}

/// A value as Python's `json.loads` gives it: objects keep their keys' order (a repeated key
/// keeps its first place and its last value), numbers are ints or floats.
#[derive(Debug, Clone, PartialEq)]
enum Py {
    Null,
    Bool(bool),
    Int(String),
    Float(f64),
    Str(String),
    List(Vec<Py>),
    Dict(Vec<(String, Py)>),
}

impl Py {
    /// `json.dumps(…, ensure_ascii=False)`.
    fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            Py::Null => out.push_str("null"),
            Py::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Py::Int(i) => out.push_str(i),
            Py::Float(f) => out.push_str(&float_repr(*f)),
            Py::Str(s) => out.push_str(&string(s)),
            Py::List(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Py::Dict(items) => {
                out.push('{');
                for (i, (key, value)) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&string(key));
                    out.push_str(": ");
                    value.write(out);
                }
                out.push('}');
            }
        }
    }

    /// Whether Python's `ast.literal_eval` reads the same text as this value: no JSON
    /// `true` / `false` / `null` in it.
    fn is_python_literal(&self) -> bool {
        match self {
            Py::Null | Py::Bool(_) => false,
            Py::Int(_) | Py::Float(_) | Py::Str(_) => true,
            Py::List(items) => items.iter().all(Py::is_python_literal),
            Py::Dict(items) => items.iter().all(|(_, v)| v.is_python_literal()),
        }
    }
}

impl<'de> Deserialize<'de> for Py {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Py;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Py, E> {
                Ok(Py::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<Py, E> {
                Ok(Py::Bool(b))
            }
            fn visit_i64<E>(self, i: i64) -> Result<Py, E> {
                Ok(Py::Int(i.to_string()))
            }
            fn visit_u64<E>(self, i: u64) -> Result<Py, E> {
                Ok(Py::Int(i.to_string()))
            }
            fn visit_f64<E>(self, f: f64) -> Result<Py, E> {
                Ok(Py::Float(f))
            }
            fn visit_str<E>(self, s: &str) -> Result<Py, E> {
                Ok(Py::Str(s.to_string()))
            }
            fn visit_string<E>(self, s: String) -> Result<Py, E> {
                Ok(Py::Str(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Py, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Py::List(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Py, A::Error> {
                let mut items: Vec<(String, Py)> = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, Py>()? {
                    match items.iter_mut().find(|(k, _)| *k == key) {
                        Some(slot) => slot.1 = value,
                        None => items.push((key, value)),
                    }
                }
                Ok(Py::Dict(items))
            }
        }
        d.deserialize_any(V)
    }
}

/// A parameter's piece of the arguments: `"name": value`, after a comma unless it is the
/// first. `region` is the text after `<parameter=` up to where the parameter ends; `extra`
/// trailing newlines more are dropped where vLLM's regular expressions end it at `$` (the
/// end of the function's text, or of an unclosed block at the end of the answer). `None`: no
/// `>` ends the name (vLLM gives up on it; here the parameter is dropped).
pub(super) fn parameter(
    schemas: &Schemas,
    function: &str,
    first: bool,
    region: &str,
    extra: usize,
) -> Option<String> {
    let gt = region.find('>')?;
    let name = &region[..gt];
    let mut value = &region[gt + 1..];
    for _ in 0..extra {
        value = value.strip_suffix('\n').unwrap_or(value);
    }
    value = value.strip_prefix('\n').unwrap_or(value);
    value = value.strip_suffix('\n').unwrap_or(value);
    Some(format!(
        "{}{}: {}",
        if first { "" } else { ", " },
        string(name),
        schemas.convert(function, name, value)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> Schemas {
        Schemas::new(&[
            json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {
                "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
                "e": {"enum": ["x", "y"]}, "u": {"type": ["integer", "null"]},
                "t": {"type": " Float "}}}}}),
        ])
    }

    #[test]
    fn values_convert_as_vllm_converts_them() {
        let s = schemas();
        let c = |name: &str, raw: &str| s.convert("f", name, raw);
        assert_eq!(c("s", "5"), "\"5\"");
        assert_eq!(c("s", "NULL"), "null");
        assert_eq!(c("i", " 42 "), "42");
        assert_eq!(c("i", "-007"), "-7");
        assert_eq!(c("i", "1_000"), "1000");
        assert_eq!(c("i", "4.5"), "\"4.5\"");
        assert_eq!(c("n", "4.5"), "4.5");
        assert_eq!(c("n", "3.0"), "3");
        assert_eq!(c("n", "1e20"), "100000000000000000000");
        assert_eq!(c("n", "1.5e-5"), "1.5e-05");
        assert_eq!(c("n", "-0.0001"), "-0.0001");
        assert_eq!(c("n", "inf"), "\"inf\"");
        assert_eq!(c("n", "abc"), "\"abc\"");
        assert_eq!(c("t", "0.5"), "0.5");
        assert_eq!(c("b", "True"), "true");
        assert_eq!(c("b", "yes"), "false");
        assert_eq!(
            c("o", "{\"k\": [1, 2.50, \"x\"], \"a\": true}"),
            "{\"k\": [1, 2.5, \"x\"], \"a\": true}"
        );
        assert_eq!(c("o", "{\"z\":1,\"a\":2,\"z\":3}"), "{\"z\": 3, \"a\": 2}");
        assert_eq!(c("o", "not json"), "\"not json\"");
        assert_eq!(c("a", "[1,2]"), "[1, 2]");
        assert_eq!(c("e", "x"), "\"x\"");
        // Other types: Python literals; JSON's true is not one.
        assert_eq!(c("u", "5"), "5");
        assert_eq!(c("u", "[true]"), "\"[true]\"");
        // Not in the schema, or no such tool: a string.
        assert_eq!(c("zz", "5"), "\"5\"");
        assert_eq!(s.convert("g", "i", "5"), "\"5\"");
        assert_eq!(s.convert("g", "i", "null"), "null");
    }

    #[test]
    fn parameters_without_properties_are_the_properties() {
        let s = Schemas::new(&[json!({"type": "function", "function": {"name": "f",
            "parameters": {"x": {"type": "integer"}}}})]);
        assert_eq!(s.convert("f", "x", "3"), "3");
        let s = Schemas::from_texts([
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \
             \"parameters\": {\"properties\": {\"x\": {\"type\": \"integer\"}}}}}",
            "nope",
        ]);
        assert_eq!(s.convert("f", "x", "3"), "3");
    }

    #[test]
    fn floats_are_written_as_python_writes_them() {
        for (f, want) in [
            (0.1, "0.1"),
            (1.5, "1.5"),
            (123456.789, "123456.789"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.0, "1.0"),
            (-2.5e-7, "-2.5e-07"),
            (1234567890123456.7, "1234567890123456.8"),
        ] {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }
}
