//! One benchmark request over gRPC, timed as the client sees it: time to the first token,
//! the gap before every later chunk, the end, and the usage the router reported; and which
//! API a session's requests go through ([`Target`]; the HTTP one is in `openai.rs`).

use std::time::{Duration, Instant};

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use tonic::transport::Channel;

use crate::auth::{ApiKey, Keyed};

use super::openai::OpenaiClient;
use super::workload::{Prompt, Session};

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Finished with this reason (`stop`, `length`, `abort`).
    Finished(String),
    /// The router answered with this gRPC status.
    Failed { code: tonic::Code, message: String },
    /// The stream ended without a finish reason.
    Incomplete,
}

impl Outcome {
    pub fn is_success(&self) -> bool {
        matches!(self, Outcome::Finished(r) if r != "abort")
    }

    /// `stop`, `length`, `abort`, a gRPC code in snake case (`unavailable`, ...) or
    /// `incomplete`: the same words as the router's `pd_router_requests_total{outcome}`.
    pub fn name(&self) -> String {
        match self {
            Outcome::Finished(r) => r.clone(),
            Outcome::Failed { code, .. } => code_snake_case(*code).to_string(),
            Outcome::Incomplete => "incomplete".into(),
        }
    }
}

pub fn code_snake_case(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        Cancelled => "cancelled",
        Unknown => "unknown",
        InvalidArgument => "invalid_argument",
        DeadlineExceeded => "deadline_exceeded",
        NotFound => "not_found",
        AlreadyExists => "already_exists",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        OutOfRange => "out_of_range",
        Unimplemented => "unimplemented",
        Internal => "internal",
        Unavailable => "unavailable",
        DataLoss => "data_loss",
        Unauthenticated => "unauthenticated",
    }
}

/// What the benchmark keeps of one request.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// Index of the session in the run, and of the turn in the session.
    pub session: usize,
    pub turn: usize,
    /// Sent this long after the measured window opened.
    pub start: Duration,
    /// Time to the first generated token.
    pub ttft: Option<Duration>,
    /// Gaps between chunks after the first token (one per chunk, as vLLM measures it).
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    pub outcome: Outcome,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    pub local_cached_tokens: u32,
    pub external_cached_tokens: u32,
}

impl RequestRecord {
    /// A request sent `start` after the window opened, not yet answered.
    pub fn new(session: usize, turn: usize, start: Duration) -> Self {
        Self {
            session,
            turn,
            start,
            ttft: None,
            itl: Vec::new(),
            e2e: Duration::ZERO,
            outcome: Outcome::Incomplete,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            local_cached_tokens: 0,
            external_cached_tokens: 0,
        }
    }

    /// Time per output token after the first; None with fewer than two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        (self.completion_tokens > 1)
            .then(|| (self.e2e.saturating_sub(ttft)) / (self.completion_tokens - 1))
    }
}

/// The wire request of one turn (`max_tokens` already resolved).
pub fn wire_request(
    prompt: &Prompt,
    max_tokens: u32,
    temperature: f32,
    ignore_eos: bool,
) -> pb::GenerateRequest {
    use pb::generate_request::Input;
    let input = match prompt {
        Prompt::TokenIds(ids) => Input::TokenIds(pb::TokenIds { ids: ids.clone() }),
        Prompt::Text(text) => Input::Text(text.clone()),
        Prompt::Chat(messages) => Input::Chat(pb::ChatInput {
            messages: messages
                .iter()
                .map(|m| pb::ChatMessage {
                    role: m.role.as_str().into(),
                    content: m.content.clone(),
                    ..Default::default()
                })
                .collect(),
            enable_thinking: None,
            tools: Vec::new(),
        }),
    };
    pb::GenerateRequest {
        input: Some(input),
        sampling: Some(pb::SamplingParams {
            temperature: Some(temperature),
            ..Default::default()
        }),
        max_tokens: Some(max_tokens),
        ignore_eos,
        ..Default::default()
    }
}

/// Send one request and time it; a failure is a record, never an error of the benchmark.
pub async fn send(
    client: &mut GenerationClient<Keyed>,
    request: pb::GenerateRequest,
    window_start: Instant,
    session: usize,
    turn: usize,
) -> RequestRecord {
    let sent = Instant::now();
    let mut record =
        RequestRecord::new(session, turn, sent.saturating_duration_since(window_start));
    let fail = |record: &mut RequestRecord, status: tonic::Status| {
        record.outcome = Outcome::Failed {
            code: status.code(),
            message: status.message().to_string(),
        };
    };
    let mut stream = match client.generate(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            fail(&mut record, status);
            record.e2e = sent.elapsed();
            return record;
        }
    };
    let mut last_token_at: Option<Instant> = None;
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                let now = Instant::now();
                if !chunk.token_ids.is_empty() {
                    match last_token_at {
                        None => record.ttft = Some(now - sent),
                        Some(before) => record.itl.push(now - before),
                    }
                    last_token_at = Some(now);
                }
                if chunk.finish_reason != pb::FinishReason::Unspecified as i32 {
                    let reason = pd_proto::convert::engine_finish_reason(chunk.finish_reason())
                        .map(|r| r.as_str().to_string())
                        .unwrap_or_else(|| "unspecified".into());
                    record.outcome = Outcome::Finished(reason);
                    let usage = chunk.usage.unwrap_or_default();
                    record.prompt_tokens = usage.prompt_tokens;
                    record.completion_tokens = usage.completion_tokens;
                    record.cached_tokens = usage.cached_tokens;
                    record.local_cached_tokens = usage.local_cached_tokens;
                    record.external_cached_tokens = usage.external_cached_tokens;
                }
            }
            Ok(None) => break,
            Err(status) => {
                fail(&mut record, status);
                break;
            }
        }
    }
    record.e2e = sent.elapsed();
    record
}

/// Where the benchmark's requests go: the gRPC API, or the OpenAI-compatible HTTP API at a
/// base URL (`--backend openai`).
#[derive(Debug, Clone)]
pub enum Target {
    Grpc(Channel, ApiKey),
    /// The base URL, the key, and TLS (`--ca`).
    Openai(String, ApiKey, Option<pd_tls::ClientTls>),
}

impl Target {
    /// A session's own client (gRPC clients share the channel; HTTP ones keep a connection).
    pub fn client(&self) -> Client {
        match self {
            Target::Grpc(channel, key) => Client::Grpc(key.client(channel.clone())),
            Target::Openai(base, key, tls) => {
                Client::Openai(OpenaiClient::new(base, key, tls.clone()))
            }
        }
    }
}

/// One session's client.
#[derive(Debug)]
pub enum Client {
    Grpc(GenerationClient<Keyed>),
    Openai(OpenaiClient),
}

/// Send a session's turns one after another (a conversation's next turn waits for the
/// previous answer). `max_tokens[t]` is turn t's resolved output length.
#[allow(clippy::too_many_arguments)]
pub async fn run_session(
    mut client: Client,
    session: &Session,
    max_tokens: &[u32],
    temperature: f32,
    ignore_eos: bool,
    window_start: Instant,
    index: usize,
    mut on_done: impl FnMut(RequestRecord),
) {
    for (turn, req) in session.turns.iter().enumerate() {
        let wire = wire_request(&req.prompt, max_tokens[turn], temperature, ignore_eos);
        let record = match &mut client {
            Client::Grpc(grpc) => send(grpc, wire, window_start, index, turn).await,
            Client::Openai(http) => {
                super::openai::send(http, wire, window_start, index, turn).await
            }
        };
        let failed = !record.outcome.is_success();
        on_done(record);
        if failed {
            // The rest of a conversation depends on this answer.
            break;
        }
    }
}
