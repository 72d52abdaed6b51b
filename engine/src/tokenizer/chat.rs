//! Chat messages and chat-template rendering.
//!
//! Templates are Jinja, rendered with minijinja in the environment Hugging Face's
//! `apply_chat_template` sets up: `trim_blocks` and `lstrip_blocks` on, the context holds
//! `messages`, `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`,
//! `pad_token`, when the tokenizer config names them), `tools` (the caller's function tools,
//! none when there are none) and `documents` (none), and any template variables the caller
//! passes (such as Qwen3's `enable_thinking`);
//! `raise_exception(message)` aborts rendering with that message. Model templates are written
//! for Python's Jinja2, so the common Python string and dict methods they call
//! (`startswith`, `split`, `strip`, `items`, ...) are provided, dicts keep their insertion
//! order as Python's do, and `tojson` writes JSON the way Python's
//! `json.dumps(..., ensure_ascii=False)` does.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::str::FromStr;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value, ValueKind, from_args};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;

use super::TokenizerError;

/// The name the chat template is registered under (it shows up in minijinja's error messages).
const TEMPLATE_NAME: &str = "chat_template";

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    System,
    User,
    Assistant,
    Tool,
}

impl ChatRole {
    pub const ALL: [ChatRole; 4] = [
        ChatRole::System,
        ChatRole::User,
        ChatRole::Assistant,
        ChatRole::Tool,
    ];

    /// The role as chat templates see it (`message.role`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        }
    }
}

impl fmt::Display for ChatRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ChatRole {
    type Err = TokenizerError;

    /// Parses the lowercase role names that OpenAI-style chat APIs use.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ChatRole::ALL
            .into_iter()
            .find(|role| role.as_str() == s)
            .ok_or_else(|| TokenizerError::UnknownChatRole {
                role: s.to_string(),
            })
    }
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub content: String,
    /// The calls an assistant turn made (`message.tool_calls` in the template; absent when
    /// there are none, as in transformers' messages).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
}

impl ChatMessage {
    pub fn new(role: ChatRole, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
        }
    }
}

/// Most tool calls one message may carry.
pub const MAX_TOOL_CALLS: usize = 128;

/// One call an assistant turn made, as OpenAI's API carries it back in a conversation:
/// `{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}`, the
/// arguments a JSON text (OpenAI's shape) or an object (transformers'), kept in its own key
/// order for the template.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ChatToolCall(Value);

impl ChatToolCall {
    /// Parses one call: a JSON object whose `function` (or, flat, itself) has a string
    /// `name` and `arguments` that are a string or an object.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("not valid JSON: {e}"))?;
        let call = value
            .get("function")
            .unwrap_or(&value)
            .as_object()
            .ok_or("a tool call must be a JSON object with a `function` object")?;
        if !call.get("name").is_some_and(serde_json::Value::is_string) {
            return Err("a tool call's function needs a string `name`".into());
        }
        match call.get("arguments") {
            Some(serde_json::Value::String(_) | serde_json::Value::Object(_)) => {}
            _ => {
                return Err(
                    "a tool call's function needs `arguments`: a JSON object or its text".into(),
                );
            }
        }
        // Parsed again as the template's value, the way tools are, to keep the key order.
        let value: Value =
            serde_json::from_str(json).map_err(|e| format!("not valid JSON: {e}"))?;
        Ok(ChatToolCall(value))
    }
}

/// Most function tools one conversation may carry.
pub const MAX_CHAT_TOOLS: usize = 128;

/// One function tool a template may describe to the model (`apply_chat_template(tools=...)`):
/// a JSON object, OpenAI's shape `{"type": "function", "function": {"name": ..., "description":
/// ..., "parameters": {...}}}`, kept in its own key order.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTool(Value);

impl ChatTool {
    /// Parses one tool; anything but a JSON object is refused.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let value: Value =
            serde_json::from_str(json).map_err(|e| format!("not valid JSON: {e}"))?;
        if value.kind() != ValueKind::Map {
            return Err(format!(
                "a tool must be a JSON object, got {}",
                value.kind()
            ));
        }
        Ok(ChatTool(value))
    }
}

/// Options for [`super::Tokenizer::apply_chat_template_with`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatTemplateOptions {
    /// End the prompt with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Qwen3's `enable_thinking` template variable. `None` leaves it undefined (the model
    /// decides whether to think); `Some(false)` makes Qwen3 templates append an empty think
    /// block to the generation prompt.
    pub enable_thinking: Option<bool>,
    /// Function tools for the template's `tools` (none when empty).
    pub tools: Vec<ChatTool>,
}

/// Where a chat template came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TemplateOrigin {
    BuiltIn,
    File(std::path::PathBuf),
}

impl fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateOrigin::BuiltIn => f.write_str("built-in Qwen3 chat template"),
            TemplateOrigin::File(path) => write!(f, "chat template in {}", path.display()),
        }
    }
}

/// The special tokens a template can refer to by name.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokenNames {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
}

/// A compiled chat template.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    origin: TemplateOrigin,
    special: SpecialTokenNames,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub(crate) fn compile(
        source: String,
        origin: TemplateOrigin,
        special: SpecialTokenNames,
    ) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(python_method);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|source| TokenizerError::ChatTemplateSyntax {
                origin: origin.to_string(),
                source,
            })?;
        Ok(ChatTemplate {
            env,
            origin,
            special,
        })
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        options: &ChatTemplateOptions,
    ) -> Result<String, TokenizerError> {
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from(Serde(messages)));
        ctx.insert(
            "add_generation_prompt",
            Value::from(options.add_generation_prompt),
        );
        ctx.insert(
            "tools",
            if options.tools.is_empty() {
                Value::from(())
            } else {
                Value::from_iter(options.tools.iter().map(|t| t.0.clone()))
            },
        );
        ctx.insert("documents", Value::from(()));
        if let Some(thinking) = options.enable_thinking {
            ctx.insert("enable_thinking", Value::from(thinking));
        }
        for (name, token) in [
            ("bos_token", &self.special.bos_token),
            ("eos_token", &self.special.eos_token),
            ("pad_token", &self.special.pad_token),
        ] {
            if let Some(token) = token {
                ctx.insert(name, Value::from(token.as_str()));
            }
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the chat template was added at compile time");
        template.render(Value::from_pairs(ctx)).map_err(|source| {
            TokenizerError::ChatTemplateRender {
                origin: self.origin.to_string(),
                source,
            }
        })
    }
}

/// `raise_exception(message)`: abort rendering with the template's own message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `value|tojson(indent=None)` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)`
/// writes it: `", "` and `": "` separators, non-ASCII kept, no HTML escaping.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(v.as_usize().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be a non-negative integer",
            )
        })?),
    };
    let cannot =
        |e| Error::new(ErrorKind::InvalidOperation, "tojson: cannot serialize").with_source(e);
    // Maps are written in their insertion order, as Python does; `sort_keys=True` sorts them.
    let text = if sort_keys == Some(true) {
        let sorted = sorted_keys(serde_json::to_value(value).map_err(cannot)?);
        python_json(&sorted, indent)
    } else {
        python_json(value, indent)
    }
    .map_err(cannot)?;
    Ok(Value::from_safe_string(text))
}

/// `value` with every object's keys in order, at every depth. Built explicitly: whether
/// serde_json's maps keep insertion order depends on a cargo feature any crate in the build
/// may turn on (outlines-core does).
fn sorted_keys(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted_keys(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(sorted_keys).collect())
        }
        other => other,
    }
}

/// `value` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)` writes it.
fn python_json<T: Serialize>(
    value: &T,
    indent: Option<usize>,
) -> Result<String, serde_json::Error> {
    let mut out = Vec::new();
    match indent {
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompact);
            value.serialize(&mut ser)?;
        }
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            value.serialize(&mut ser)?;
        }
    }
    Ok(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

/// serde_json formatter with Python's default separators (`", "`, `": "`).
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }
}

/// The Python `str` and `dict` methods that model chat templates call.
fn python_method(
    _state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(value, method, args),
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "startswith" | "endswith" => {
            let (affix,): (Value,) = from_args(args)?;
            let test = |a: &str| {
                if method == "startswith" {
                    s.starts_with(a)
                } else {
                    s.ends_with(a)
                }
            };
            if let Some(a) = affix.as_str() {
                return Ok(Value::from(test(a)));
            }
            // A tuple/list of alternatives, as Python allows.
            let mut any = false;
            for item in affix.try_iter()? {
                let a = item
                    .as_str()
                    .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "expected strings"))?;
                any |= test(a);
            }
            Ok(Value::from(any))
        }
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<String>,) = from_args(args)?;
            let is_stripped = |c: char| match &chars {
                Some(set) => set.contains(c),
                None => c.is_whitespace(),
            };
            let out = match method {
                "strip" => s.trim_matches(is_stripped),
                "lstrip" => s.trim_start_matches(is_stripped),
                _ => s.trim_end_matches(is_stripped),
            };
            Ok(Value::from(out))
        }
        "split" => {
            let (sep, maxsplit): (Option<String>, Option<i64>) = from_args(args)?;
            let limit = maxsplit.filter(|&m| m >= 0).map(|m| m as usize);
            let parts: Vec<Value> = match sep.as_deref() {
                Some("") => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "split: empty separator",
                    ));
                }
                Some(sep) => match limit {
                    Some(m) => s.splitn(m + 1, sep).map(Value::from).collect(),
                    None => s.split(sep).map(Value::from).collect(),
                },
                None => split_whitespace(s, limit),
            };
            Ok(Value::from(parts))
        }
        "lower" => {
            let () = from_args(args)?;
            Ok(Value::from(s.to_lowercase()))
        }
        "upper" => {
            let () = from_args(args)?;
            Ok(Value::from(s.to_uppercase()))
        }
        "replace" => {
            let (old, new, count): (String, String, Option<i64>) = from_args(args)?;
            Ok(Value::from(match count {
                Some(n) if n >= 0 => s.replacen(&old, &new, n as usize),
                _ => s.replace(&old, &new),
            }))
        }
        "find" => {
            let (needle,): (String,) = from_args(args)?;
            Ok(Value::from(
                s.find(&needle)
                    .map_or(-1, |byte| s[..byte].chars().count() as i64),
            ))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// Python's `str.split()` without a separator: runs of whitespace, no empty parts.
fn split_whitespace(s: &str, limit: Option<usize>) -> Vec<Value> {
    let mut parts = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        if limit.is_some_and(|m| parts.len() == m) {
            parts.push(Value::from(rest));
            break;
        }
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        parts.push(Value::from(&rest[..end]));
        rest = rest[end..].trim_start();
    }
    parts
}

fn map_method(map: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "items" => {
            let () = from_args(args)?;
            let mut items = Vec::new();
            for key in map.try_iter()? {
                let value = map.get_item(&key)?;
                items.push(Value::from(vec![key, value]));
            }
            Ok(Value::from(items))
        }
        "keys" => {
            let () = from_args(args)?;
            Ok(Value::from(map.try_iter()?.collect::<Vec<_>>()))
        }
        "values" => {
            let () = from_args(args)?;
            let mut values = Vec::new();
            for key in map.try_iter()? {
                values.push(map.get_item(&key)?);
            }
            Ok(Value::from(values))
        }
        "get" => {
            let (key, default): (Value, Option<Value>) = from_args(args)?;
            let value = map.get_item(&key)?;
            Ok(if value.is_undefined() {
                default.unwrap_or(Value::from(()))
            } else {
                value
            })
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}
