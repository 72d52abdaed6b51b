//! One API request from body to response: its generations started together through the
//! gRPC service, then either collected into one response or streamed as server-sent events
//! in the order their chunks arrive.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body as HttpBody, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use pd_engine::tokenizer::Tokenizer;
use pd_proto::pb;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{StreamExt, StreamMap};
use tonic::metadata::MetadataMap;

use super::request::{Body, Endpoint, Plan, Prompt};
use super::response::{self, Header, Scored, UsageSum};
use super::{Api, error, error_body, http_status, json_response};
use crate::choices::ChoiceOf;
use crate::choices::start::{Generations, start};
use crate::parse::coder::Schemas;
use crate::parse::{AnswerParser, Parsed, ToolCall};

/// Stream events buffered between the request's task and the client's connection.
const EVENT_BUFFER: usize = 16;

/// The stream's last event.
const DONE: &[u8] = b"data: [DONE]\n\n";

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) async fn handle(
    api: Api,
    tenant: crate::tenant::Tenant,
    account: Option<crate::limits::Account>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let arrival = tokio::time::Instant::now();
    let body = match Body::parse(body) {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    if let Some(refused) = api.refuse_model(body.model()) {
        return refused;
    }
    let header_id = match headers.get("x-request-id").map(HeaderValue::to_str) {
        None => None,
        Some(Ok(id)) => Some(id.to_string()),
        Some(Err(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "x-request-id must be visible ASCII",
            );
        }
    };
    let mut plan = match body.plan(endpoint, header_id, || api.shared.ids.request_id()) {
        Ok(plan) => plan,
        Err(e) => return e.into_response(),
    };
    if plan.forced_tool && !api.tools {
        return error(
            StatusCode::BAD_REQUEST,
            "tool_choice \"required\" or a named function needs the router's \
             --tool-call-parser (hermes or qwen3_coder: the forced call is read out of the \
             answer by it)",
        );
    }
    if plan.echo {
        // The echoed prompt shows every token, the first one's included: tokenize here.
        let shared = api.shared.clone();
        let prompts = std::mem::take(&mut plan.prompts);
        let tokenized = tokio::task::spawn_blocking(move || {
            prompts
                .into_iter()
                .map(|p| match p {
                    Prompt::Text(t) => shared.validator.tokenize(&t).map(Prompt::Ids),
                    ids => Ok(ids),
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await;
        match tokenized {
            Ok(Ok(prompts)) => plan.set_prompts(prompts),
            Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
            Err(e) => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("tokenizing the prompt panicked: {e}"),
                );
            }
        }
    }
    // Qwen3-Coder's calls are typed by the request's tools. A forced call is guided into a
    // Hermes JSON block whatever the parser, and read as one.
    let coder = plan
        .requests
        .first()
        .filter(|_| api.coder && plan.tools && !plan.forced_tool)
        .map(|request| Arc::new(Schemas::of_request(request)));
    let requests = std::mem::take(&mut plan.requests);
    // Every generation has the API request's deadline (`--request-timeout`), counted from its
    // arrival; the client cancels by going away, so there is no abort switch.
    let metadata = MetadataMap::new();
    let parent = ChoiceOf {
        abort: None,
        deadline: api.generation.deadline(&metadata, arrival),
        tenant,
        prompt_once: true,
        account,
    };
    let streams = match start(&api.generation, requests, plan.n, metadata, parent).await {
        Ok(streams) => streams,
        Err(status) => return error(http_status(status.code()), status.message()),
    };
    let output = Output {
        header: Header {
            id: match endpoint {
                Endpoint::Completions => format!("cmpl-{}", plan.id),
                Endpoint::ChatCompletions => format!("chatcmpl-{}", plan.id),
            },
            created: unix_now(),
            model: api.shared.model.name.clone(),
            endpoint,
        },
        tokenizer: api.shared.model.tokenizer().clone(),
        reasoning: endpoint == Endpoint::ChatCompletions && api.reasoning,
        tools: api.tools && plan.tools,
        coder,
        echo: plan
            .prompts
            .iter()
            .map(|p| match p {
                Prompt::Ids(ids) if plan.echo => ids.clone(),
                _ => Vec::new(),
            })
            .collect(),
        plan,
    };
    let request_id = HeaderValue::from_str(&output.plan.id).ok();
    let mut response = if output.plan.stream {
        stream(output, streams)
    } else {
        collect(output, streams).await
    };
    if let Some(id) = request_id {
        response.headers_mut().insert("x-request-id", id);
    }
    response
}

/// What shapes the response, besides the chunks.
struct Output {
    header: Header,
    tokenizer: Tokenizer,
    /// Chat answers are read for reasoning (`--reasoning-parser`).
    reasoning: bool,
    /// Chat answers are read for tool calls (`--tool-call-parser` and tools in the request).
    tools: bool,
    /// They are Qwen3-Coder's (`--tool-call-parser qwen3_coder`), typed by these tools.
    coder: Option<Arc<Schemas>>,
    /// Per prompt, the token ids to echo (empty without echo).
    echo: Vec<Vec<u32>>,
    plan: Plan,
}

/// One choice as its chunks arrive.
#[derive(Debug, Default)]
struct Choice {
    text: String,
    /// Streamed chat answers read for reasoning or tool calls.
    parser: Option<AnswerParser>,
    logprobs: Vec<pb::Logprob>,
    prompt_logprobs: Vec<pb::Logprob>,
    finish: Option<(&'static str, Value)>,
    /// Characters of text before the next token (completions' `text_offset`).
    offset: usize,
    started: bool,
    /// Streams with continuous usage: the prompt's length (its first chunk's
    /// `prompt_tokens`) and the tokens generated so far.
    prompt_tokens: u32,
    completion_tokens: u32,
}

impl Choice {
    /// Counts a chunk's tokens (the last chunk's usage is the exact count).
    fn count(&mut self, chunk: &pb::GenerateResponse) {
        if let Some(prompt_tokens) = chunk.prompt_tokens {
            self.prompt_tokens = prompt_tokens;
        }
        let tokens = u32::try_from(chunk.token_ids.len()).unwrap_or(u32::MAX);
        self.completion_tokens = self.completion_tokens.saturating_add(tokens);
        if let Some(usage) = &chunk.usage {
            self.prompt_tokens = usage.prompt_tokens;
            self.completion_tokens = usage.completion_tokens;
        }
    }
}

impl Output {
    fn prompt_of(&self, choice: usize) -> usize {
        choice / self.plan.n
    }

    fn echo_text(&self, choice: usize) -> String {
        match self.echo.get(self.prompt_of(choice)) {
            Some(ids) if !ids.is_empty() => self.tokenizer.decode(ids, false).unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Completions' logprobs of a piece of a choice: the echoed prompt's (on its first
    /// piece) and the new tokens'.
    fn completion_logprobs(
        &self,
        index: usize,
        first: bool,
        prompt: &[pb::Logprob],
        tokens: &[pb::Logprob],
        offset: usize,
    ) -> (Value, usize) {
        let mut entries = Vec::new();
        if first && let Some(&head) = self.echo[self.prompt_of(index)].first() {
            entries.push(Scored::Unscored(head));
            entries.extend(prompt.iter().map(Scored::Scored));
        }
        entries.extend(tokens.iter().map(Scored::Scored));
        response::completion_logprobs(&self.tokenizer, &entries, offset)
    }

    /// A choice of a whole response.
    fn whole_choice(&self, index: usize, c: &Choice) -> Value {
        let (reason, stop_reason) = c.finish.clone().unwrap_or(("stop", Value::Null));
        let mut value = match self.plan.endpoint {
            Endpoint::Completions => {
                let logprobs = if self.plan.logprobs.is_some() {
                    self.completion_logprobs(index, true, &c.prompt_logprobs, &c.logprobs, 0)
                        .0
                } else {
                    Value::Null
                };
                json!({
                    "index": index,
                    "text": format!("{}{}", self.echo_text(index), c.text),
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                })
            }
            Endpoint::ChatCompletions => {
                let (message, reason) = if self.parses() {
                    let mut parsed = self.parser().parse_whole(&c.text);
                    self.keep_calls(&mut parsed);
                    let reason = self.chat_finish(reason, !parsed.calls.is_empty());
                    let mut message = json!({
                        "role": "assistant",
                        "content": if parsed.content.is_empty() && !parsed.calls.is_empty() {
                            Value::Null
                        } else {
                            json!(parsed.content)
                        },
                    });
                    if self.reasoning {
                        message["reasoning_content"] = if parsed.reasoning.is_empty() {
                            Value::Null
                        } else {
                            json!(parsed.reasoning)
                        };
                    }
                    if !parsed.calls.is_empty() {
                        message["tool_calls"] = self.tool_calls(index, &parsed.calls, false);
                    }
                    (message, reason)
                } else {
                    (json!({"role": "assistant", "content": c.text}), reason)
                };
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": self.chat_logprobs(&c.logprobs),
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                })
            }
        };
        if self.plan.prompt_logprobs {
            value["prompt_logprobs"] =
                response::prompt_logprobs(&self.tokenizer, &c.prompt_logprobs);
        }
        value
    }

    /// `parallel_tool_calls: false`: the answer's first call only (its later blocks are
    /// neither calls nor content).
    fn keep_calls(&self, parsed: &mut Parsed) {
        if !self.plan.parallel_tool_calls {
            parsed.calls.retain(|call| call.index == 0);
        }
    }

    /// A parser for one chat answer.
    fn parser(&self) -> AnswerParser {
        AnswerParser::reading(self.reasoning, self.tools, self.coder.as_ref())
    }

    /// Whether chat answers are parsed at all.
    fn parses(&self) -> bool {
        self.reasoning || self.tools
    }

    /// A chat answer that stopped by itself after calling tools finishes with `tool_calls`.
    fn chat_finish(&self, reason: &'static str, called: bool) -> &'static str {
        if called && reason == "stop" {
            "tool_calls"
        } else {
            reason
        }
    }

    /// OpenAI's `tool_calls` of choice `index`: a call's first part carries its id, type and
    /// name, each part its arguments' text; a stream's parts carry their call's `index`.
    fn tool_calls(&self, index: usize, calls: &[ToolCall], streamed: bool) -> Value {
        calls
            .iter()
            .map(|call| {
                let mut value = json!({"function": {"arguments": call.arguments}});
                if let Some(name) = &call.name {
                    value["id"] = json!(format!("call-{}-{index}.{}", self.plan.id, call.index));
                    value["type"] = json!("function");
                    value["function"]["name"] = json!(name);
                }
                if streamed {
                    value["index"] = json!(call.index);
                }
                value
            })
            .collect()
    }

    fn chat_logprobs(&self, entries: &[pb::Logprob]) -> Value {
        if self.plan.logprobs.is_some() {
            response::chat_logprobs(&self.tokenizer, entries)
        } else {
            Value::Null
        }
    }

    /// The stream chunk of one piece of choice `index`, or `None` when it carries nothing.
    fn piece(&self, index: usize, c: &mut Choice, chunk: &pb::GenerateResponse) -> Option<Value> {
        let first = !c.started;
        c.started = true;
        let finish = response::finish(chunk);
        let mut text = if first {
            self.echo_text(index)
        } else {
            String::new()
        };
        text.push_str(&chunk.text);
        let (reason, stop_reason) = match &finish {
            Some((r, s)) => (json!(r), s.clone()),
            None => (Value::Null, Value::Null),
        };
        let mut value = match self.plan.endpoint {
            Endpoint::Completions => {
                let echoes = first && self.plan.echo;
                if text.is_empty() && chunk.logprobs.is_empty() && finish.is_none() && !echoes {
                    return None;
                }
                let logprobs = if self.plan.logprobs.is_some() {
                    let (v, end) = self.completion_logprobs(
                        index,
                        first,
                        &chunk.prompt_logprobs,
                        &chunk.logprobs,
                        c.offset,
                    );
                    c.offset = end;
                    v
                } else {
                    Value::Null
                };
                json!({
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                })
            }
            Endpoint::ChatCompletions => {
                let mut delta = serde_json::Map::new();
                let mut reason = reason;
                if self.parses() {
                    let parser = c.parser.get_or_insert_with(|| self.parser());
                    let mut parsed = parser.push(&text);
                    if finish.is_some() {
                        parsed.append(parser.finish());
                    }
                    self.keep_calls(&mut parsed);
                    if !parsed.reasoning.is_empty() {
                        delta.insert("reasoning_content".into(), json!(parsed.reasoning));
                    }
                    if !parsed.content.is_empty() {
                        delta.insert("content".into(), json!(parsed.content));
                    }
                    if !parsed.calls.is_empty() {
                        delta.insert(
                            "tool_calls".into(),
                            self.tool_calls(index, &parsed.calls, true),
                        );
                    }
                    if let Some((r, _)) = &finish {
                        reason = json!(self.chat_finish(r, parser.calls() > 0));
                    }
                } else if !text.is_empty() {
                    delta.insert("content".into(), json!(text));
                }
                if delta.is_empty() && chunk.logprobs.is_empty() && finish.is_none() {
                    return None;
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": if chunk.logprobs.is_empty() {
                        Value::Null
                    } else {
                        self.chat_logprobs(&chunk.logprobs)
                    },
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                })
            }
        };
        if first && self.plan.prompt_logprobs {
            value["prompt_logprobs"] =
                response::prompt_logprobs(&self.tokenizer, &chunk.prompt_logprobs);
        }
        Some(value)
    }
}

fn merged(streams: Vec<Generations>) -> StreamMap<usize, Generations> {
    let mut map = StreamMap::with_capacity(streams.len());
    for (i, s) in streams.into_iter().enumerate() {
        map.insert(i, s);
    }
    map
}

/// Waits for every generation and answers with the whole response (or the first error).
async fn collect(output: Output, streams: Vec<Generations>) -> Response {
    let mut choices: Vec<Choice> = (0..streams.len()).map(|_| Choice::default()).collect();
    let mut usage = UsageSum::default();
    let mut map = merged(streams);
    while let Some((i, item)) = map.next().await {
        let chunk = match item {
            Ok(chunk) => chunk,
            Err(status) => return error(http_status(status.code()), status.message()),
        };
        let c = &mut choices[i];
        c.text.push_str(&chunk.text);
        c.logprobs.extend(chunk.logprobs.iter().cloned());
        c.prompt_logprobs
            .extend(chunk.prompt_logprobs.iter().cloned());
        if let Some(f) = response::finish(&chunk) {
            c.finish = Some(f);
        }
        if let Some(u) = &chunk.usage {
            usage.add(u, i % output.plan.n == 0);
        }
    }
    let values = choices
        .iter()
        .enumerate()
        .map(|(i, c)| output.whole_choice(i, c))
        .collect();
    json_response(StatusCode::OK, &output.header.response(values, usage))
}

/// Answers at once with an event stream that a task of its own fills as chunks arrive.
fn stream(output: Output, streams: Vec<Generations>) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(EVENT_BUFFER);
    tokio::spawn(send_events(output, streams, tx));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        HttpBody::from_stream(ReceiverStream::new(rx)),
    )
        .into_response()
}

fn event(value: &Value) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("data: {value}\n\n")))
}

/// Fills the event stream. A client gone (the channel closed) ends it, which drops the
/// generations: each is cancelled on its nodes as a gRPC stream dropped by its client is.
///
/// With continuous usage (`stream_options.continuous_usage_stats`), every chunk carries its
/// choice's usage so far as vLLM counts it: the choice's prompt, the tokens that choice has
/// generated up to and with this chunk (chat's role chunks: 0). The last, usage-only chunk
/// still sums every choice.
async fn send_events(
    output: Output,
    mut streams: Vec<Generations>,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let count = streams.len();
    let mut choices: Vec<Choice> = (0..count).map(|_| Choice::default()).collect();
    let mut usage = UsageSum::default();
    let continuous = output.plan.continuous_usage;
    if continuous {
        // Each generation's first chunk is in already (`start` looked at it), with its
        // prompt's length: chat's role chunks carry it before any token.
        for (stream, c) in streams.iter_mut().zip(&mut choices) {
            if let Some(Ok(first)) = stream.peek().await {
                c.prompt_tokens = first.prompt_tokens.unwrap_or_default();
            }
        }
    }
    if output.plan.endpoint == Endpoint::ChatCompletions {
        let roles: Vec<Value> = (0..count)
            .map(|i| {
                json!({
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                })
            })
            .collect();
        if continuous {
            // One chunk per choice, as vLLM sends them: a usage is one choice's.
            for (role, c) in roles.into_iter().zip(&choices) {
                let mut value = output.header.chunk(vec![role]);
                value["usage"] = response::running_usage(c.prompt_tokens, 0);
                if tx.send(event(&value)).await.is_err() {
                    return;
                }
            }
        } else if tx.send(event(&output.header.chunk(roles))).await.is_err() {
            return;
        }
    }
    let mut map = merged(streams);
    loop {
        // A client gone is noticed at once, not at the next event: the parser may hold text
        // (an open tool call) for many tokens, which must not run on for nobody.
        let next = tokio::select! {
            next = map.next() => next,
            () = tx.closed() => return,
        };
        let Some((i, item)) = next else { break };
        let chunk = match item {
            Ok(chunk) => chunk,
            Err(status) => {
                let body = error_body(http_status(status.code()), status.message());
                if tx.send(event(&body)).await.is_ok() {
                    let _ = tx.send(Ok(Bytes::from_static(DONE))).await;
                }
                return;
            }
        };
        if let Some(u) = &chunk.usage {
            usage.add(u, i % output.plan.n == 0);
        }
        let c = &mut choices[i];
        c.count(&chunk);
        let Some(piece) = output.piece(i, c, &chunk) else {
            continue;
        };
        let mut value = output.header.chunk(vec![piece]);
        if continuous {
            value["usage"] = response::running_usage(c.prompt_tokens, c.completion_tokens);
        }
        if tx.send(event(&value)).await.is_err() {
            return;
        }
    }
    drop(map);
    if output.plan.include_usage
        && tx
            .send(event(&output.header.usage_chunk(usage)))
            .await
            .is_err()
    {
        return;
    }
    let _ = tx.send(Ok(Bytes::from_static(DONE))).await;
}
