//! A JSON schema's `pattern` keyword, made safe for the regex of JSON text. A pattern speaks
//! of a string's value; outlines pastes it between the quotes of the string's JSON text as it
//! is, so a pattern that allows `"`, `\` or a control character (`.*`, `[^a]`) let the guide
//! end a text that is no JSON, and a pattern with an alternation (`a|b`) split the quotes
//! between its members. Here each pattern is parsed, every character JSON must escape is
//! replaced by its escaped spellings (`"` by `\"`, a newline by `\n` or `\u000a`), and the
//! result is grouped, so the string's value matches the pattern and its text is JSON.
//!
//! A pattern matches the whole value, as outlines and xgrammar read it; `^` at its start and
//! `$` at its end are accepted and change nothing, and any other assertion (`\b`, an anchor
//! inside) is refused. Owns the rewriting of patterns; not the rest of the schema's regex.

use std::collections::HashSet;

use regex_syntax::hir::{Class, ClassUnicode, ClassUnicodeRange, Hir, HirKind};
use serde_json::Value;

use super::StructuredError;

/// Longest pattern a schema may hold (bytes): every escaped character becomes an alternation,
/// and the schema as a whole is bounded by the specification's own limit.
const MAX_PATTERN_BYTES: usize = 1024;

/// `schema` with every `pattern` outlines would read rewritten for JSON text, `None` when it
/// holds none (or is not JSON: outlines says why). Patterns are found where outlines looks
/// for schemas: the root, `properties`, `items`, `prefixItems`, `additionalProperties`,
/// `allOf` / `anyOf` / `oneOf` members and every `$ref` target within the schema.
pub(super) fn rewrite(schema: &str) -> Result<Option<String>, StructuredError> {
    if !schema.contains("pattern") {
        return Ok(None);
    }
    let Ok(mut value) = serde_json::from_str::<Value>(schema) else {
        return Ok(None);
    };
    let patterns = pattern_paths(&value);
    if patterns.is_empty() {
        return Ok(None);
    }
    for path in patterns {
        let Some(Value::String(pattern)) = lookup_mut(&mut value, &path) else {
            continue;
        };
        *pattern = json_text_regex(pattern)?;
    }
    Ok(Some(value.to_string()))
}

/// The regex of a JSON string's inner text whose value matches `pattern` whole.
pub(super) fn json_text_regex(pattern: &str) -> Result<String, StructuredError> {
    let refuse = |why: String| StructuredError::Schema(format!("the pattern {pattern:?} {why}"));
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(refuse(format!(
            "is {} bytes, more than the {MAX_PATTERN_BYTES} allowed",
            pattern.len()
        )));
    }
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .map_err(|e| refuse(format!("does not parse: {}", super::regex_error(&e))))?;
    let escaped = escape(&super::anchors::strip_ends(&hir)).map_err(refuse)?;
    Ok(format!("(?:{escaped})"))
}

/// `hir` over JSON string text: each character as JSON writes it inside quotes.
fn escape(hir: &Hir) -> Result<Hir, String> {
    Ok(match hir.kind() {
        HirKind::Empty => Hir::empty(),
        HirKind::Literal(literal) => {
            let text = std::str::from_utf8(&literal.0)
                .map_err(|_| "matches bytes that are not UTF-8 text".to_string())?;
            Hir::concat(text.chars().map(|c| class(&single(c))).collect())
        }
        HirKind::Class(Class::Unicode(c)) => class(c),
        HirKind::Class(Class::Bytes(bytes)) => {
            let ranges = bytes.ranges().iter().map(|r| {
                if r.end() > 0x7F {
                    Err("matches bytes that are not UTF-8 text".to_string())
                } else {
                    Ok(ClassUnicodeRange::new(
                        char::from(r.start()),
                        char::from(r.end()),
                    ))
                }
            });
            class(&ClassUnicode::new(ranges.collect::<Result<Vec<_>, _>>()?))
        }
        HirKind::Look(_) => {
            return Err(
                "holds an assertion (an anchor inside it, or a word boundary): a pattern \
                 matches the whole value, with `^` and `$` only at its ends"
                    .to_string(),
            );
        }
        HirKind::Repetition(rep) => {
            let mut rep = rep.clone();
            rep.sub = Box::new(escape(&rep.sub)?);
            Hir::repetition(rep)
        }
        // Groups are kept by the structure of the result; capture names mean nothing here.
        HirKind::Capture(capture) => escape(&capture.sub)?,
        HirKind::Concat(parts) => Hir::concat(parts.iter().map(escape).collect::<Result<_, _>>()?),
        HirKind::Alternation(parts) => {
            Hir::alternation(parts.iter().map(escape).collect::<Result<_, _>>()?)
        }
    })
}

/// A class of one character.
fn single(c: char) -> ClassUnicode {
    ClassUnicode::new([ClassUnicodeRange::new(c, c)])
}

/// The characters JSON writes escaped inside a string: `"`, `\` and the controls.
fn must_escape() -> ClassUnicode {
    ClassUnicode::new([
        ClassUnicodeRange::new('\0', '\u{1F}'),
        ClassUnicodeRange::new('"', '"'),
        ClassUnicodeRange::new('\\', '\\'),
    ])
}

/// The JSON text of any character of `chars`: those written as they are, and the escaped
/// spellings of the rest.
fn class(chars: &ClassUnicode) -> Hir {
    let mut plain = chars.clone();
    plain.difference(&must_escape());
    let mut escaped = chars.clone();
    escaped.intersect(&must_escape());
    let mut spellings = Vec::new();
    if !plain.ranges().is_empty() {
        spellings.push(Hir::class(Class::Unicode(plain)));
    }
    for range in escaped.ranges() {
        for c in range.start()..=range.end() {
            spellings.extend(escapes(c).into_iter().map(|s| Hir::literal(s.into_bytes())));
        }
    }
    Hir::alternation(spellings)
}

/// Every spelling JSON has for a character it must escape (RFC 8259 §7), `\u` in either case.
fn escapes(c: char) -> Vec<String> {
    let short = match c {
        '"' => Some("\\\""),
        '\\' => Some("\\\\"),
        '\u{8}' => Some("\\b"),
        '\u{c}' => Some("\\f"),
        '\n' => Some("\\n"),
        '\r' => Some("\\r"),
        '\t' => Some("\\t"),
        _ => None,
    };
    let code = c as u32;
    let mut out: Vec<String> = short.map(str::to_string).into_iter().collect();
    out.push(format!("\\u{code:04x}"));
    let upper = format!("\\u{code:04X}");
    if !out.contains(&upper) {
        out.push(upper);
    }
    out
}

/// A key path from the root of a schema.
type Path = Vec<String>;

/// The paths of every string `pattern` in a schema position outlines reads, `$ref` targets
/// followed (within the document, as outlines resolves them: `#/a/b` by object keys).
fn pattern_paths(root: &Value) -> Vec<Path> {
    let mut todo: Vec<Path> = vec![Vec::new()];
    let mut seen: HashSet<Path> = HashSet::new();
    let mut found = Vec::new();
    while let Some(path) = todo.pop() {
        let Some(Value::Object(fields)) = lookup(root, &path) else {
            continue;
        };
        if !seen.insert(path.clone()) {
            continue;
        }
        let child = |keys: &[&str]| {
            let mut p = path.clone();
            p.extend(keys.iter().map(|k| k.to_string()));
            p
        };
        for (key, value) in fields {
            match (key.as_str(), value) {
                ("pattern", Value::String(_)) => found.push(child(&["pattern"])),
                ("properties", Value::Object(map)) => {
                    todo.extend(map.keys().map(|k| child(&["properties", k])));
                }
                ("items" | "additionalProperties", Value::Object(_)) => todo.push(child(&[key])),
                ("items" | "prefixItems" | "allOf" | "anyOf" | "oneOf", Value::Array(list)) => {
                    let indices = (0..list.len()).map(|i| i.to_string());
                    todo.extend(indices.map(|i| child(&[key, &i])));
                }
                ("$ref", Value::String(target)) => {
                    let fragment = target.rsplit_once('#').map_or(target.as_str(), |(_, f)| f);
                    let keys = fragment.split('/').filter(|s| !s.is_empty());
                    todo.push(keys.map(str::to_string).collect());
                }
                _ => {}
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// The value at `path` (object keys, or indices into arrays).
fn lookup<'a>(root: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(root, |v, key| match v {
        Value::Object(map) => map.get(key),
        Value::Array(list) => list.get(key.parse::<usize>().ok()?),
        _ => None,
    })
}

/// [`lookup`], mutable.
fn lookup_mut<'a>(root: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path.iter().try_fold(root, |v, key| match v {
        Value::Object(map) => map.get_mut(key),
        Value::Array(list) => list.get_mut(key.parse::<usize>().ok()?),
        _ => None,
    })
}

#[cfg(test)]
mod tests;
