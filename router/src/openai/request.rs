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

mod chat;
mod sampling;
#[cfg(test)]
mod tests;
mod tool_choice;

pub use self::chat::chat_messages;
use self::sampling::{ResponseFormat, StructuredOutputs};

pub use crate::choices::MAX_N;

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
    messages: Option<Vec<Value>>,
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
    /// vLLM's: accepted and not used. Qwen3's tokenizer is a fast one, for which vLLM ignores
    /// it too (special tokens' text is written as it is).
    #[allow(dead_code)]
    spaces_between_special_tokens: Option<bool>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_json: Option<Value>,
    guided_grammar: Option<String>,
    /// SGLang's name for a grammar.
    ebnf: Option<String>,
    structured_outputs: Option<StructuredOutputs>,
    /// OpenAI's end-user id: accepted and not used.
    #[allow(dead_code)]
    user: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    /// vLLM's: every chunk carries the usage so far (only with `include_usage`).
    continuous_usage_stats: Option<bool>,
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
    /// `stream_options.continuous_usage_stats` with `include_usage` (vLLM ignores it
    /// without): every chunk carries its choice's usage so far.
    pub continuous_usage: bool,
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
    /// `tool_choice` forces a call (`required` or a named function): the answer is guided into
    /// one, which only the tool-call parser turns into `tool_calls`.
    pub forced_tool: bool,
    /// `parallel_tool_calls` (default true): false keeps an answer's first call only, and
    /// `tool_choice: "required"` guides the answer into exactly one.
    pub parallel_tool_calls: bool,
    /// The generations, prompt-major: generation `i` is choice `i` (prompt `i / n`).
    pub requests: Vec<pb::GenerateRequest>,
}

/// Parses a JSON body of any of the API's routes; the message says what is wrong and where.
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, BadRequest> {
    serde_json::from_slice(bytes)
        .map_err(|e| bad(format!("invalid request body: {}", serde_message(&e))))
}

/// A serde error's message without the list of every known field that follows an unknown
/// one: 40-odd names hide the point.
fn serde_message(e: &serde_json::Error) -> String {
    let mut text = e.to_string();
    if let Some(from) = text.find(", expected one of") {
        let to = text
            .rfind(" at line")
            .filter(|&to| to > from)
            .unwrap_or(text.len());
        text.replace_range(from..to, " (the fields: docs/openai.md)");
    }
    text
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
        parse_json(bytes)
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
        let option = |get: fn(&StreamOptions) -> Option<bool>| {
            self.stream_options.as_ref().and_then(get).unwrap_or(false)
        };
        let include_usage = option(|o| o.include_usage);
        let continuous_usage = include_usage && option(|o| o.continuous_usage_stats);

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
        let forced_tool = if chat { self.forced_tool_call()? } else { None };
        if let Some(call) = &forced_tool {
            if sampling.structured_output.is_some() {
                return Err(bad(
                    "tool_choice \"required\" or a named function already constrains the \
                     answer: leave out the structured output",
                ));
            }
            sampling.structured_output = Some(call.clone());
        }
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
                    skip_special_tokens: self.skip_special_tokens,
                    // Each choice is a request of its own here (started by `choices::start`).
                    n: None,
                    // The HTTP API reads answers itself (`--reasoning-parser`, ...).
                    parse_reasoning: false,
                    parse_tool_calls: false,
                    tool_call_format: pb::ToolCallFormat::Unspecified as i32,
                });
            }
        }
        Ok(Plan {
            id: request_id,
            endpoint,
            model: self.model.clone().filter(|m| !m.is_empty()),
            stream,
            include_usage,
            continuous_usage,
            n: n as usize,
            prompts,
            echo,
            logprobs,
            prompt_logprobs: self.prompt_logprobs.is_some(),
            tools: chat
                && self.tools.as_ref().is_some_and(|t| !t.is_empty())
                && self.tool_choice.as_ref().and_then(Value::as_str) != Some("none"),
            forced_tool: forced_tool.is_some(),
            parallel_tool_calls: self.parallel_tool_calls != Some(false),
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
}
