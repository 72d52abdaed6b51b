//! The bodies of `POST /v1/completions` and `POST /v1/chat/completions`, and their
//! translation into `pd.v1.GenerateRequest`s: one per prompt and choice (`n`).
//!
//! Only the shape is checked here (types, which fields belong to which endpoint, the values
//! OpenAI's API has and this cluster does not serve); the values themselves (ranges, the
//! vocabulary, the context) are checked by the router's validation, exactly as for a gRPC
//! request, so both APIs refuse the same things with the same words. An unknown field is
//! refused rather than ignored: a misspelt `temprature` must not silently sample at 1.0.

use std::collections::BTreeMap;

use pd_proto::pb;
use serde::Deserialize;
use serde_json::Value;

/// Most choices one request may ask for (`n`).
pub const MAX_N: u32 = 16;

/// Most generations one request may start: prompts × `n`.
pub const MAX_GENERATIONS: usize = 64;

/// Which endpoint a body was posted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// A body refused for its shape: HTTP 400 with this message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

fn bad(message: impl Into<String>) -> BadRequest {
    BadRequest(message.into())
}

/// Both endpoints' fields (OpenAI's, and vLLM's extensions that the cluster serves).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Body {
    model: Option<String>,
    // Completions.
    prompt: Option<Value>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<u32>,
    // Chat.
    messages: Option<Vec<Message>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    max_completion_tokens: Option<u32>,
    top_logprobs: Option<u32>,
    response_format: Option<ResponseFormat>,
    // Both.
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u32>>,
    include_stop_str_in_output: Option<bool>,
    ignore_eos: Option<bool>,
    min_tokens: Option<u32>,
    seed: Option<i64>,
    logit_bias: Option<BTreeMap<String, f32>>,
    /// Completions: an integer (top-K); chat: a boolean (with `top_logprobs`).
    logprobs: Option<Value>,
    prompt_logprobs: Option<u32>,
    allowed_token_ids: Option<Vec<u32>>,
    bad_words: Option<Vec<String>>,
    truncate_prompt_tokens: Option<u32>,
    cache_salt: Option<String>,
    request_id: Option<String>,
    skip_special_tokens: Option<bool>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_json: Option<Value>,
    structured_outputs: Option<StructuredOutputs>,
    /// OpenAI's end-user id: accepted and not used.
    #[allow(dead_code)]
    user: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
}

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
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSchemaFormat {
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
struct StructuredOutputs {
    regex: Option<String>,
    choice: Option<Vec<String>>,
    json: Option<Value>,
}

/// A prompt of `/v1/completions`: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

impl Prompt {
    pub fn to_input(&self) -> pb::generate_request::Input {
        match self {
            Prompt::Text(t) => pb::generate_request::Input::Text(t.clone()),
            Prompt::Ids(ids) => {
                pb::generate_request::Input::TokenIds(pb::TokenIds { ids: ids.clone() })
            }
        }
    }
}

/// What the response needs to know besides the generations' chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The request's id: the generations' ids are it (one) or it with `-i` appended.
    pub id: String,
    pub endpoint: Endpoint,
    /// The model name the response carries (the one the client sent, or the served name).
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices per prompt.
    pub n: usize,
    /// The prompts (completions), for echo; chat has one, unused.
    pub prompts: Vec<Prompt>,
    pub echo: bool,
    /// Per-token logprobs asked for (completions: top-K; chat: `top_logprobs`).
    pub logprobs: Option<u32>,
    /// The client asked for `prompt_logprobs` (vLLM's field on each choice).
    pub prompt_logprobs: bool,
    /// Chat with tools the model may call (`tool_choice` not `none`).
    pub tools: bool,
    /// The generations, prompt-major: generation `i` is choice `i` (prompt `i / n`).
    pub requests: Vec<pb::GenerateRequest>,
}

impl Plan {
    /// Replaces the prompts (the same ones, tokenized) and the generations' inputs with them.
    pub fn set_prompts(&mut self, prompts: Vec<Prompt>) {
        for (i, req) in self.requests.iter_mut().enumerate() {
            if let Some(p) = prompts.get(i / self.n) {
                req.input = Some(p.to_input());
            }
        }
        self.prompts = prompts;
    }
}

impl Body {
    /// Parses a JSON body; the message says what is wrong and where.
    pub fn parse(bytes: &[u8]) -> Result<Self, BadRequest> {
        serde_json::from_slice(bytes).map_err(|e| {
            let mut text = e.to_string();
            // serde lists every known field after an unknown one: 40-odd names hide the point.
            if let (Some(from), Some(to)) = (text.find(", expected one of"), text.rfind(" at line"))
                && from < to
            {
                text.replace_range(from..to, " (the fields: docs/openai.md)");
            }
            bad(format!("invalid request body: {text}"))
        })
    }

    /// The model the body names, if any.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The generations this body asks for. They are named by the `X-Request-Id` header, else
    /// the body's `request_id`, else `new_id()`: that id for one, with `-i` appended for
    /// several (each must be unique among requests in flight).
    pub fn plan(
        self,
        endpoint: Endpoint,
        header_id: Option<String>,
        new_id: impl FnOnce() -> String,
    ) -> Result<Plan, BadRequest> {
        let chat = endpoint == Endpoint::ChatCompletions;
        let request_id = header_id
            .or_else(|| self.request_id.clone())
            .unwrap_or_else(new_id);
        self.check_fields(endpoint)?;
        if self.skip_special_tokens == Some(false) {
            return Err(bad(
                "skip_special_tokens=false is not supported: special tokens are always left out \
                 of the text (their ids are in the token ids)",
            ));
        }
        if let Some(best_of) = self.best_of
            && best_of > 1
        {
            return Err(bad(
                "best_of > 1 is not supported: ask for `n` choices and rank them yourself",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(bad(
                "suffix is not supported (Qwen3 has no fill-in-the-middle)",
            ));
        }
        let n = self.n.unwrap_or(1);
        if n == 0 || n > MAX_N {
            return Err(bad(format!("n must be 1 to {MAX_N}, got {n}")));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(bad("stream_options is only allowed with stream=true"));
        }
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);

        let logprobs = self.logprobs(endpoint)?;
        let echo = self.echo.unwrap_or(false);
        if echo && self.truncate_prompt_tokens.is_some() {
            return Err(bad("echo with truncate_prompt_tokens is not supported"));
        }
        let prompts = if chat { Vec::new() } else { self.prompts()? };
        let inputs: Vec<pb::generate_request::Input> = if chat {
            vec![self.chat_input()?]
        } else {
            prompts.iter().map(Prompt::to_input).collect()
        };
        let total = inputs.len() * n as usize;
        if total > MAX_GENERATIONS {
            return Err(bad(format!(
                "{} prompts × n={n} asks for {total} generations; at most {MAX_GENERATIONS} per \
                 request",
                inputs.len()
            )));
        }

        let mut sampling = self.sampling()?;
        sampling.logprobs = logprobs;
        if echo && logprobs.is_some() {
            // The echoed prompt's tokens carry their logprobs too (lm-eval's loglikelihood).
            sampling.prompt_logprobs = Some(
                logprobs
                    .unwrap_or(0)
                    .max(sampling.prompt_logprobs.unwrap_or(0)),
            );
        }
        let max_tokens = match endpoint {
            // OpenAI's default for completions.
            Endpoint::Completions => Some(self.max_tokens.unwrap_or(16)),
            Endpoint::ChatCompletions => self.max_completion_tokens.or(self.max_tokens),
        };
        let stop = self.stop_strings()?;
        let mut requests = Vec::with_capacity(total);
        for input in &inputs {
            for choice in 0..n {
                let mut sampling = sampling.clone();
                // Each choice samples its own sequence; with a seed, choice i uses seed + i so
                // the whole response is reproducible.
                if let Some(seed) = sampling.seed {
                    sampling.seed = Some(seed.wrapping_add(u64::from(choice)));
                }
                let id = if total == 1 {
                    request_id.clone()
                } else {
                    format!("{request_id}-{}", requests.len())
                };
                requests.push(pb::GenerateRequest {
                    model: self.model.clone().unwrap_or_default(),
                    input: Some(input.clone()),
                    sampling: Some(sampling),
                    max_tokens,
                    stop: stop.clone(),
                    stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
                    ignore_eos: self.ignore_eos.unwrap_or(false),
                    include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
                    cache_salt: self.cache_salt.clone(),
                    request_id: Some(id),
                    truncate_prompt_tokens: self.truncate_prompt_tokens,
                    bad_words: self.bad_words.clone().unwrap_or_default(),
                });
            }
        }
        Ok(Plan {
            id: request_id,
            endpoint,
            model: self.model.clone().filter(|m| !m.is_empty()),
            stream,
            include_usage,
            n: n as usize,
            prompts,
            echo,
            logprobs,
            prompt_logprobs: self.prompt_logprobs.is_some(),
            tools: chat
                && self.tools.as_ref().is_some_and(|t| !t.is_empty())
                && self.tool_choice.as_ref().and_then(Value::as_str) != Some("none"),
            requests,
        })
    }

    /// Refuses the fields of the other endpoint by name.
    fn check_fields(&self, endpoint: Endpoint) -> Result<(), BadRequest> {
        let completions_only = [
            ("prompt", self.prompt.is_some()),
            ("echo", self.echo.is_some()),
            ("suffix", self.suffix.is_some()),
            ("best_of", self.best_of.is_some()),
        ];
        let chat_only = [
            ("messages", self.messages.is_some()),
            ("tools", self.tools.is_some()),
            ("tool_choice", self.tool_choice.is_some()),
            ("parallel_tool_calls", self.parallel_tool_calls.is_some()),
            ("chat_template_kwargs", self.chat_template_kwargs.is_some()),
            (
                "max_completion_tokens",
                self.max_completion_tokens.is_some(),
            ),
            ("top_logprobs", self.top_logprobs.is_some()),
        ];
        let (foreign, other) = match endpoint {
            Endpoint::Completions => (&chat_only[..], Endpoint::ChatCompletions),
            Endpoint::ChatCompletions => (&completions_only[..], Endpoint::Completions),
        };
        if let Some((name, _)) = foreign.iter().find(|(_, set)| *set) {
            return Err(bad(format!(
                "`{name}` belongs to {}, not {}",
                other.path(),
                endpoint.path()
            )));
        }
        match endpoint {
            Endpoint::Completions if self.prompt.is_none() => Err(bad("`prompt` is required")),
            Endpoint::ChatCompletions if self.messages.is_none() => {
                Err(bad("`messages` is required"))
            }
            _ => Ok(()),
        }
    }

    /// The per-token logprobs asked for, as a top-K.
    fn logprobs(&self, endpoint: Endpoint) -> Result<Option<u32>, BadRequest> {
        match endpoint {
            Endpoint::Completions => match &self.logprobs {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(k)) => match k.as_u64().and_then(|k| u32::try_from(k).ok()) {
                    Some(k) => Ok(Some(k)),
                    None => Err(bad(format!(
                        "logprobs must be a non-negative integer (the top-K per token), got {k}"
                    ))),
                },
                Some(other) => Err(bad(format!(
                    "logprobs must be an integer (the top-K per token) on /v1/completions, got \
                     {other}"
                ))),
            },
            Endpoint::ChatCompletions => {
                let on = match &self.logprobs {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => {
                        return Err(bad(format!(
                            "logprobs must be a boolean on /v1/chat/completions (top_logprobs \
                             gives the top-K), got {other}"
                        )));
                    }
                };
                match (on, self.top_logprobs) {
                    (true, k) => Ok(Some(k.unwrap_or(0))),
                    (false, Some(k)) if k > 0 => Err(bad("top_logprobs needs logprobs=true")),
                    (false, _) => Ok(None),
                }
            }
        }
    }

    /// `prompt`: a string, a list of strings, a list of token ids or a list of such lists.
    fn prompts(&self) -> Result<Vec<Prompt>, BadRequest> {
        const SHAPE: &str = "prompt must be a string, a list of strings, a list of token ids \
                             or a list of lists of token ids";
        let ids = |list: &[Value]| -> Option<Vec<u32>> {
            list.iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect()
        };
        let prompts = match self.prompt.as_ref() {
            Some(Value::String(text)) => vec![Prompt::Text(text.clone())],
            Some(Value::Array(items)) if items.is_empty() => {
                return Err(bad("prompt is an empty list"));
            }
            Some(Value::Array(items)) => match &items[0] {
                Value::String(_) => items
                    .iter()
                    .map(|v| v.as_str().map(|s| Prompt::Text(s.to_string())))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(SHAPE))?,
                Value::Number(_) => vec![Prompt::Ids(ids(items).ok_or_else(|| bad(SHAPE))?)],
                Value::Array(_) => items
                    .iter()
                    .map(|v| v.as_array().and_then(|l| ids(l)).map(Prompt::Ids))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(SHAPE))?,
                _ => return Err(bad(SHAPE)),
            },
            _ => return Err(bad(SHAPE)),
        };
        Ok(prompts)
    }

    /// `messages` (and tools, template options) as the router's chat input.
    fn chat_input(&self) -> Result<pb::generate_request::Input, BadRequest> {
        let messages = self.messages.as_deref().unwrap_or_default();
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| m.to_wire(i))
            .collect::<Result<Vec<_>, _>>()?;
        match self.tool_choice.as_ref() {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "auto" || s == "none" => {}
            Some(other) => {
                return Err(bad(format!(
                    "tool_choice {other} is not supported: only \"auto\" and \"none\" (the \
                     model decides; its calls come back as text)"
                )));
            }
        }
        let tools = self
            .tools
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(Value::to_string)
            .collect();
        let mut enable_thinking = None;
        for (key, value) in self.chat_template_kwargs.iter().flatten() {
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
        Ok(pb::generate_request::Input::Chat(pb::ChatInput {
            messages,
            enable_thinking,
            tools,
        }))
    }

    /// `stop`: a string or a list of strings.
    fn stop_strings(&self) -> Result<Vec<String>, BadRequest> {
        match &self.stop {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("stop must be a string or a list of strings")),
            Some(_) => Err(bad("stop must be a string or a list of strings")),
        }
    }

    /// The sampling fields (logprobs aside), on the wire.
    fn sampling(&self) -> Result<pb::SamplingParams, BadRequest> {
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

    /// The one structured output among vLLM's `guided_*` fields, `structured_outputs` and
    /// `response_format`.
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
        }
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => {
                // Any JSON object nests without bound: a regex (what guides are) cannot hold
                // it, and its bounded unrolling passes the guides' state cap.
                return Err(bad(
                    "response_format json_object is not supported: give a json_schema \
                     (response_format {\"type\": \"json_schema\", ...}) whose shape the output \
                     must take",
                ));
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

impl Message {
    fn to_wire(&self, index: usize) -> Result<pb::ChatMessage, BadRequest> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(endpoint: Endpoint, body: Value) -> Result<Plan, BadRequest> {
        Body::parse(body.to_string().as_bytes())?.plan(endpoint, None, || "r".to_string())
    }

    fn completions(body: Value) -> Result<Plan, BadRequest> {
        plan(Endpoint::Completions, body)
    }

    fn chat(body: Value) -> Result<Plan, BadRequest> {
        plan(Endpoint::ChatCompletions, body)
    }

    fn refused(result: Result<Plan, BadRequest>) -> String {
        result.expect_err("refused").0
    }

    fn sampling(p: &Plan, i: usize) -> &pb::SamplingParams {
        p.requests[i].sampling.as_ref().unwrap()
    }

    #[test]
    fn prompts_of_every_shape_fan_out_prompt_major_with_seeds_per_choice() {
        let p = completions(json!({"prompt": "hi"})).unwrap();
        assert_eq!(p.requests.len(), 1);
        assert_eq!(p.requests[0].request_id.as_deref(), Some("r"));
        assert_eq!(p.requests[0].max_tokens, Some(16), "OpenAI's default");
        let p = completions(json!({"prompt": [[1, 2], [3]], "n": 2, "seed": 9})).unwrap();
        let ids: Vec<_> = p
            .requests
            .iter()
            .map(|r| r.request_id.clone().unwrap())
            .collect();
        assert_eq!(ids, ["r-0", "r-1", "r-2", "r-3"]);
        assert_eq!(
            p.requests[2].input,
            Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                ids: vec![3]
            }))
        );
        let seeds: Vec<_> = (0..4).map(|i| sampling(&p, i).seed.unwrap()).collect();
        assert_eq!(seeds, [9, 10, 9, 10]);
        assert_eq!(
            completions(json!({"prompt": [5, 6]})).unwrap().prompts,
            [Prompt::Ids(vec![5, 6])]
        );
        assert_eq!(
            completions(json!({"prompt": ["a", "b"]}))
                .unwrap()
                .prompts
                .len(),
            2
        );
        for bad_prompt in [
            json!([]),
            json!([1, "a"]),
            json!([-1]),
            json!(3),
            json!([{}]),
        ] {
            assert!(refused(completions(json!({"prompt": bad_prompt}))).contains("prompt"));
        }
        assert!(refused(completions(json!({"prompt": "x", "n": 17}))).contains("n must be"));
        let many = vec!["x"; 8];
        assert!(refused(completions(json!({"prompt": many, "n": 9}))).contains("72 generations"));
    }

    #[test]
    fn fields_are_refused_by_name_when_unknown_or_on_the_other_endpoint() {
        assert!(
            refused(completions(json!({"prompt": "x", "temprature": 1}))).contains("temprature")
        );
        assert!(refused(completions(json!({"messages": []}))).contains("/v1/chat/completions"));
        assert!(refused(chat(json!({"messages": [], "echo": true}))).contains("/v1/completions"));
        assert!(refused(completions(json!({"max_tokens": 3}))).contains("`prompt` is required"));
        assert!(refused(chat(json!({}))).contains("`messages` is required"));
        assert!(refused(completions(json!({"prompt": "x", "best_of": 2}))).contains("best_of"));
        assert!(refused(completions(json!({"prompt": "x", "suffix": "y"}))).contains("suffix"));
        assert!(
            refused(completions(
                json!({"prompt": "x", "stream_options": {"include_usage": true}})
            ))
            .contains("stream=true")
        );
        assert!(
            refused(completions(
                json!({"prompt": "x", "skip_special_tokens": false})
            ))
            .contains("skip_special_tokens")
        );
        // OpenAI's fields that change nothing here are accepted.
        assert!(completions(json!({"prompt": "x", "user": "u", "best_of": 1})).is_ok());
    }

    #[test]
    fn sampling_fields_reach_the_wire() {
        let p = completions(json!({
            "prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1,
            "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
            "min_tokens": 2, "seed": -1, "logit_bias": {"42": -100}, "allowed_token_ids": [1, 42],
            "bad_words": ["no"], "stop": "\n", "stop_token_ids": [7], "ignore_eos": true,
            "include_stop_str_in_output": true, "truncate_prompt_tokens": 5, "cache_salt": "s",
            "max_tokens": 9, "prompt_logprobs": 2,
        }))
        .unwrap();
        let r = &p.requests[0];
        let s = sampling(&p, 0);
        assert_eq!(
            (s.temperature, s.top_p, s.top_k),
            (Some(0.5), Some(0.9), None)
        );
        assert_eq!(s.seed, Some(u64::MAX));
        assert_eq!(s.logit_bias.get(&42), Some(&-100.0));
        assert_eq!(s.allowed_token_ids, [1, 42]);
        assert_eq!(s.prompt_logprobs, Some(2));
        assert_eq!(r.bad_words, ["no"]);
        assert_eq!(r.stop, ["\n"]);
        assert_eq!(r.stop_token_ids, [7]);
        assert!(r.ignore_eos && r.include_stop_str_in_output);
        assert_eq!(r.truncate_prompt_tokens, Some(5));
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!(r.max_tokens, Some(9));
        assert!(p.prompt_logprobs);
        assert!(refused(completions(json!({"prompt": "x", "top_k": -2}))).contains("top_k"));
        assert!(
            refused(completions(json!({"prompt": "x", "logit_bias": {"a": 1}})))
                .contains("token ids")
        );
        assert!(refused(completions(json!({"prompt": "x", "stop": 3}))).contains("stop"));
    }

    #[test]
    fn logprobs_take_each_endpoints_shape_and_echo_scores_the_prompt() {
        assert_eq!(
            completions(json!({"prompt": "x", "logprobs": 3}))
                .unwrap()
                .logprobs,
            Some(3)
        );
        assert!(refused(completions(json!({"prompt": "x", "logprobs": true}))).contains("integer"));
        let p = chat(json!({"messages": [], "logprobs": true, "top_logprobs": 4})).unwrap();
        assert_eq!((p.logprobs, sampling(&p, 0).logprobs), (Some(4), Some(4)));
        assert_eq!(
            chat(json!({"messages": [], "logprobs": true}))
                .unwrap()
                .logprobs,
            Some(0)
        );
        assert!(refused(chat(json!({"messages": [], "logprobs": 2}))).contains("boolean"));
        assert!(
            refused(chat(json!({"messages": [], "top_logprobs": 2}))).contains("logprobs=true")
        );
        let p = completions(json!({"prompt": "x", "echo": true, "logprobs": 2})).unwrap();
        assert!(p.echo);
        assert_eq!(sampling(&p, 0).prompt_logprobs, Some(2));
        assert!(
            !p.prompt_logprobs,
            "the echo's scores are not vLLM's prompt_logprobs field"
        );
    }

    #[test]
    fn chat_messages_tools_and_template_options() {
        let p = chat(json!({
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
            "chat_template_kwargs": {"enable_thinking": false},
            "max_completion_tokens": 7, "max_tokens": 99,
        }))
        .unwrap();
        let Some(pb::generate_request::Input::Chat(c)) = &p.requests[0].input else {
            panic!("chat input");
        };
        let roles: Vec<_> = c.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(c.messages[1].content, "ab");
        assert_eq!(c.messages[2].content, "");
        assert_eq!(c.enable_thinking, Some(false));
        assert_eq!(c.tools.len(), 1);
        assert_eq!(
            p.requests[0].max_tokens,
            Some(7),
            "max_completion_tokens wins"
        );
        assert_eq!(
            chat(json!({"messages": []})).unwrap().requests[0].max_tokens,
            None
        );
        let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]});
        assert!(refused(chat(image)).contains("only text"));
        let calls = json!({"messages": [{"role": "user", "tool_calls": [{}]}]});
        assert!(refused(chat(calls)).contains("only for role \"assistant\""));
        let call =
            json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}});
        let calls = json!({"messages": [
            {"role": "assistant", "content": null, "tool_calls": [call], "reasoning_content": "r"},
        ]});
        let Some(pb::generate_request::Input::Chat(c)) = &chat(calls).unwrap().requests[0].input
        else {
            panic!("chat input");
        };
        assert_eq!(c.messages[0].tool_calls, [call.to_string()]);
        let required = json!({"messages": [], "tool_choice": "required"});
        assert!(refused(chat(required)).contains("tool_choice"));
        let kwargs = json!({"messages": [], "chat_template_kwargs": {"foo": 1}});
        assert!(refused(chat(kwargs)).contains("chat_template_kwargs.foo"));
    }

    #[test]
    fn one_structured_output_from_any_of_its_spellings() {
        use pb::structured_output::Kind;
        let kind = |body: Value| {
            chat(body).unwrap().requests[0]
                .sampling
                .as_ref()
                .unwrap()
                .structured_output
                .clone()
                .and_then(|s| s.kind)
        };
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            kind(json!({"messages": [], "guided_regex": "[0-9]+"})),
            Some(Kind::Regex("[0-9]+".into()))
        );
        assert_eq!(
            kind(json!({"messages": [], "structured_outputs": {"choice": ["y", "n"]}})),
            Some(Kind::Choice(pb::Choices {
                choices: vec!["y".into(), "n".into()]
            }))
        );
        assert_eq!(
            kind(json!({"messages": [], "guided_json": schema})),
            Some(Kind::JsonSchema(schema.to_string()))
        );
        assert_eq!(
            kind(
                json!({"messages": [], "response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": schema, "strict": true}}})
            ),
            Some(Kind::JsonSchema(schema.to_string()))
        );
        let object = json!({"messages": [], "response_format": {"type": "json_object"}});
        assert!(refused(chat(object)).contains("json_object is not supported"));
        assert_eq!(
            kind(json!({"messages": [], "response_format": {"type": "text"}})),
            None
        );
        let both = json!({"messages": [], "guided_regex": "a", "guided_choice": ["b"]});
        assert!(refused(chat(both)).contains("guided_regex and guided_choice"));
        let unknown = json!({"messages": [], "response_format": {"type": "grammar"}});
        assert!(refused(chat(unknown)).contains("grammar"));
    }

    #[test]
    fn the_header_id_names_the_request_before_the_body_id() {
        let body = Body::parse(br#"{"prompt": "x", "request_id": "body"}"#).unwrap();
        let p = body.plan(
            Endpoint::Completions,
            Some("head".into()),
            || unreachable!(),
        );
        assert_eq!(p.unwrap().id, "head");
        let body = Body::parse(br#"{"prompt": "x", "request_id": "body"}"#).unwrap();
        let p = body.plan(Endpoint::Completions, None, || unreachable!());
        assert_eq!(p.unwrap().id, "body");
    }
}
