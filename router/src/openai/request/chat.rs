//! The chat side of a body: its messages (roles, content parts, tool calls) and the chat
//! input they become, with tools and template options.

use pd_proto::pb;
use serde::Deserialize;
use serde_json::Value;

use super::{BadRequest, Body, bad, serde_message};

/// One entry of `messages`. OpenAI's client sends back an answer's whole message object
/// (`message.model_dump()`), so its other fields are accepted too: `refusal` and
/// `annotations` (not rendered), `audio` and `function_call` when null.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: Option<Value>,
    /// OpenAI's participant name: accepted and not rendered (Qwen3's template has no place
    /// for it).
    #[allow(dead_code)]
    name: Option<String>,
    tool_calls: Option<Vec<Value>>,
    /// Which call a tool message answers: accepted, not rendered (Qwen3's template answers
    /// calls in order).
    tool_call_id: Option<String>,
    /// An assistant turn's reasoning, as this API returned it: accepted and not rendered
    /// (Qwen3's template drops earlier turns' reasoning).
    #[allow(dead_code)]
    reasoning_content: Option<String>,
    #[allow(dead_code)]
    refusal: Option<String>,
    #[allow(dead_code)]
    annotations: Option<Value>,
    audio: Option<Value>,
    function_call: Option<Value>,
}

impl Body {
    /// `messages` (and tools, template options) as the router's chat input.
    pub(super) fn chat_input(&self) -> Result<pb::generate_request::Input, BadRequest> {
        let chat = chat_messages(
            self.messages.as_deref().unwrap_or_default(),
            self.tools.as_deref(),
            self.chat_template_kwargs.as_ref(),
        )?;
        Ok(pb::generate_request::Input::Chat(chat))
    }
}

/// Messages, tools and template options as the router's chat input (also `/tokenize`'s).
/// Each message is read on its own, so an error names the one at fault.
pub fn chat_messages(
    messages: &[Value],
    tools: Option<&[Value]>,
    template_kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<pb::ChatInput, BadRequest> {
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            Message::deserialize(m)
                .map_err(|e| bad(format!("messages[{i}]: {}", serde_message(&e))))?
                .to_wire(i)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tools = tools
        .unwrap_or_default()
        .iter()
        .map(Value::to_string)
        .collect();
    let mut enable_thinking = None;
    for (key, value) in template_kwargs.into_iter().flatten() {
        match (key.as_str(), value) {
            ("enable_thinking", Value::Bool(b)) => enable_thinking = Some(*b),
            ("enable_thinking", other) => {
                return Err(bad(format!(
                    "chat_template_kwargs.enable_thinking must be a boolean, got {other}"
                )));
            }
            (other, _) => {
                return Err(bad(format!(
                    "chat_template_kwargs.{other} is not supported: only enable_thinking"
                )));
            }
        }
    }
    Ok(pb::ChatInput {
        messages,
        enable_thinking,
        tools,
    })
}

impl Message {
    fn to_wire(&self, index: usize) -> Result<pb::ChatMessage, BadRequest> {
        for (field, value) in [
            ("audio", &self.audio),
            ("function_call", &self.function_call),
        ] {
            if value.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(bad(format!(
                    "messages[{index}].{field} is not supported (text only; calls go in \
                     tool_calls)"
                )));
            }
        }
        // OpenAI's newer name for the system role.
        let role = if self.role == "developer" {
            "system".to_string()
        } else {
            self.role.clone()
        };
        let tool_calls: Vec<String> = self
            .tool_calls
            .iter()
            .flatten()
            .map(Value::to_string)
            .collect();
        if !tool_calls.is_empty() && role != "assistant" {
            return Err(bad(format!(
                "messages[{index}].tool_calls is only for role \"assistant\""
            )));
        }
        if self.tool_call_id.is_some() && role != "tool" {
            return Err(bad(format!(
                "messages[{index}].tool_call_id is only for role \"tool\""
            )));
        }
        let content = match &self.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (p, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Value::as_str);
                    match (kind, part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (Some("text"), None) => {
                            return Err(bad(format!(
                                "messages[{index}].content[{p}] has type text and no text"
                            )));
                        }
                        (other, _) => {
                            return Err(bad(format!(
                                "messages[{index}].content[{p}] has type {}: only text is \
                                 supported",
                                other.unwrap_or("(none)")
                            )));
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{index}].content must be a string or a list of text parts"
                )));
            }
        };
        Ok(pb::ChatMessage {
            role,
            content,
            tool_calls,
        })
    }
}
