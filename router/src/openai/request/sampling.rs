//! The sampling side of a body: sampling fields on the wire, and the one structured output
//! among vLLM's `guided_*` fields, `structured_outputs`, SGLang's `ebnf` and OpenAI's
//! `response_format`.

use pd_proto::pb;
use serde::Deserialize;
use serde_json::Value;

use super::{BadRequest, Body, bad};

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct JsonSchemaFormat {
    #[allow(dead_code)]
    name: Option<String>,
    #[allow(dead_code)]
    description: Option<String>,
    schema: Option<Value>,
    /// Always strict here: the output is constrained to the schema.
    #[allow(dead_code)]
    strict: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StructuredOutputs {
    regex: Option<String>,
    choice: Option<Vec<String>>,
    json: Option<Value>,
    json_object: Option<bool>,
    grammar: Option<String>,
}

impl Body {
    /// The sampling fields (logprobs aside), on the wire.
    pub(super) fn sampling(&self) -> Result<pb::SamplingParams, BadRequest> {
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(u32::try_from(k).map_err(|_| bad("top_k is too large"))?),
            Some(k) => {
                return Err(bad(format!(
                    "top_k must be -1 or 0 (off) or positive, got {k}"
                )));
            }
        };
        // Python clients send any integer; the two's-complement bits keep each seed its own.
        let seed = self.seed.map(|s| s as u64);
        let logit_bias = self
            .logit_bias
            .iter()
            .flatten()
            .map(|(id, bias)| {
                id.parse::<u32>()
                    .map(|id| (id, *bias))
                    .map_err(|_| bad(format!("logit_bias keys must be token ids, got `{id}`")))
            })
            .collect::<Result<_, _>>()?;
        Ok(pb::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed,
            logprobs: None,
            prompt_logprobs: self.prompt_logprobs,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            min_tokens: self.min_tokens,
            logit_bias,
            allowed_token_ids: self.allowed_token_ids.clone().unwrap_or_default(),
            bad_words_token_ids: Vec::new(),
            structured_output: self.structured_output()?,
        })
    }

    /// The one structured output among vLLM's `guided_*` fields, `structured_outputs`,
    /// SGLang's `ebnf` and `response_format`.
    fn structured_output(&self) -> Result<Option<pb::StructuredOutput>, BadRequest> {
        use pb::structured_output::Kind;
        let schema_text = |v: &Value, field: &str| -> Result<String, BadRequest> {
            match v {
                Value::String(s) => Ok(s.clone()),
                Value::Object(_) | Value::Bool(_) => Ok(v.to_string()),
                _ => Err(bad(format!(
                    "{field} must be a JSON schema (an object or its text)"
                ))),
            }
        };
        let mut found: Vec<(&str, Kind)> = Vec::new();
        if let Some(r) = &self.guided_regex {
            found.push(("guided_regex", Kind::Regex(r.clone())));
        }
        if let Some(c) = &self.guided_choice {
            found.push((
                "guided_choice",
                Kind::Choice(pb::Choices { choices: c.clone() }),
            ));
        }
        if let Some(j) = &self.guided_json {
            found.push((
                "guided_json",
                Kind::JsonSchema(schema_text(j, "guided_json")?),
            ));
        }
        if let Some(s) = &self.structured_outputs {
            if let Some(r) = &s.regex {
                found.push(("structured_outputs.regex", Kind::Regex(r.clone())));
            }
            if let Some(c) = &s.choice {
                found.push((
                    "structured_outputs.choice",
                    Kind::Choice(pb::Choices { choices: c.clone() }),
                ));
            }
            if let Some(j) = &s.json {
                found.push((
                    "structured_outputs.json",
                    Kind::JsonSchema(schema_text(j, "structured_outputs.json")?),
                ));
            }
            if s.json_object == Some(true) {
                found.push(("structured_outputs.json_object", Kind::JsonObject(true)));
            }
            if let Some(g) = &s.grammar {
                found.push(("structured_outputs.grammar", Kind::Grammar(g.clone())));
            }
        }
        if let Some(g) = &self.guided_grammar {
            found.push(("guided_grammar", Kind::Grammar(g.clone())));
        }
        if let Some(g) = &self.ebnf {
            found.push(("ebnf", Kind::Grammar(g.clone())));
        }
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => {
                found.push(("response_format", Kind::JsonObject(true)));
            }
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let schema = json_schema
                    .schema
                    .as_ref()
                    .ok_or_else(|| bad("response_format.json_schema.schema is required"))?;
                found.push((
                    "response_format",
                    Kind::JsonSchema(schema_text(schema, "response_format.json_schema.schema")?),
                ));
            }
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found
                .pop()
                .map(|(_, kind)| pb::StructuredOutput { kind: Some(kind) })),
            _ => Err(bad(format!(
                "set at most one structured output, got {}",
                found
                    .iter()
                    .map(|(f, _)| *f)
                    .collect::<Vec<_>>()
                    .join(" and ")
            ))),
        }
    }
}
