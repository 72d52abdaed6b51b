//! `tool_choice` `"required"` or a named function: the answer is made to be calls (one or
//! more for `required`, one of the named function), in the form the model writes them
//! (`<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`),
//! by a structured output over it: the call's JSON follows a schema built from the tool's
//! own `parameters` (a tool without them takes no arguments). The tool-call parser then reads
//! it out as `tool_calls`.

use pd_engine::sampling::StructuredOutput;
use pd_proto::pb;
use serde_json::{Value, json};

use super::{BadRequest, Body, bad};

/// A function tool's name and parameters schema.
fn function(tool: &Value) -> Option<(&str, Value)> {
    let f = tool.get("function")?;
    let name = f.get("name")?.as_str()?;
    let mut parameters = f.get("parameters").cloned().unwrap_or_else(
        || json!({"type": "object", "properties": {}, "additionalProperties": false}),
    );
    // `"properties": {}` is how clients (LangChain, the OpenAI SDK's helpers) declare a tool
    // that takes no arguments; as a schema it would allow any object, which a forced call's
    // regex cannot hold. Read it as the declaration it is: the arguments are `{}`.
    if let Some(fields) = parameters.as_object_mut()
        && fields
            .get("properties")
            .is_some_and(|p| p.as_object().is_some_and(|p| p.is_empty()))
        && !fields.contains_key("additionalProperties")
    {
        fields.insert("additionalProperties".into(), Value::Bool(false));
    }
    Some((name, parameters))
}

/// The regex of one call of `name` with arguments that `parameters` accepts (free-form parts
/// of them included: the node's guide reads those with its JSON grammar).
fn call_regex(name: &str, parameters: &Value) -> Result<String, BadRequest> {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
    });
    StructuredOutput::json_schema_regex(&schema.to_string()).map_err(|e| {
        bad(format!(
            "tool `{name}`: its parameters cannot guide a call: {e}"
        ))
    })
}

impl Body {
    /// The structured output a forcing `tool_choice` stands for; `None` for `auto`, `none`
    /// or no choice.
    pub(super) fn forced_tool_call(&self) -> Result<Option<pb::StructuredOutput>, BadRequest> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let named = matches!(self.tool_choice, Some(Value::Object(_)));
        let wanted: Vec<(&str, Value)> = match self.tool_choice.as_ref() {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) if s == "auto" || s == "none" => return Ok(None),
            Some(Value::String(s)) if s == "required" => {
                let all: Vec<_> = tools.iter().filter_map(function).collect();
                if all.is_empty() {
                    return Err(bad(
                        "tool_choice \"required\" needs at least one function tool",
                    ));
                }
                all
            }
            Some(choice @ Value::Object(_)) => {
                let name = choice
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        bad("tool_choice must be \"auto\", \"none\", \"required\" or \
                             {\"type\": \"function\", \"function\": {\"name\": ...}}")
                    })?;
                let tool = tools
                    .iter()
                    .filter_map(function)
                    .find(|(n, _)| *n == name)
                    .ok_or_else(|| {
                        bad(format!("tool_choice names `{name}`, which is not in tools"))
                    })?;
                vec![tool]
            }
            Some(other) => {
                return Err(bad(format!(
                    "tool_choice must be \"auto\", \"none\", \"required\" or a named function, \
                     got {other}"
                )));
            }
        };
        let calls = wanted
            .iter()
            .map(|(name, parameters)| call_regex(name, parameters))
            .collect::<Result<Vec<_>, _>>()?;
        let call = format!("<tool_call>\\n({})\\n</tool_call>", calls.join("|"));
        // `required` is one call or more, one block each, a newline after each as Qwen3's
        // template writes them (written as a loop: the calls' states once, not twice); a
        // named function is called once, and so is any with `parallel_tool_calls: false`.
        let regex = if named || self.parallel_tool_calls == Some(false) {
            call
        } else {
            format!("({call}\\n?)+")
        };
        Ok(Some(pb::StructuredOutput {
            kind: Some(pb::structured_output::Kind::Regex(regex)),
        }))
    }
}
