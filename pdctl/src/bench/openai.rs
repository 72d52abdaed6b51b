//! One benchmark request through the router's OpenAI-compatible HTTP API (`--backend
//! openai`), timed as the gRPC client times it: `POST /v1/completions` (token ids or text) or
//! `/v1/chat/completions` (a conversation), streamed with `include_usage`; a chunk with text
//! is a token arrival, the usage chunk carries the prompt and cache counts.

use std::time::Instant;

use http_body_util::BodyExt as _;
use hyper::body::Bytes;
use pd_proto::pb;
use serde_json::{Value, json};

use super::client::{Outcome, RequestRecord};

type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>;

/// A session's HTTP/1.1 connection to the API, opened on first use and reopened when closed.
#[derive(Debug)]
pub struct OpenaiClient {
    /// `HOST:PORT`.
    authority: String,
    /// The path the routes hang under (`/v1`).
    prefix: String,
    conn: Option<Sender>,
    /// HTTPS (`--ca`).
    tls: Option<pd_tls::ClientTls>,
}

impl OpenaiClient {
    /// A client of the API at `base` (`http://HOST:PORT/v1`, or `https://` with `tls`).
    pub fn new(base: &str, tls: Option<pd_tls::ClientTls>) -> Self {
        let rest = base
            .strip_prefix("http://")
            .or_else(|| base.strip_prefix("https://"))
            .unwrap_or(base);
        let (authority, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        Self {
            authority: authority.to_string(),
            prefix: prefix.trim_end_matches('/').to_string(),
            conn: None,
            tls,
        }
    }

    async fn sender(&mut self) -> Result<&mut Sender, String> {
        if let Some(conn) = &mut self.conn
            && conn.ready().await.is_ok()
        {
            return Ok(self.conn.as_mut().expect("just checked"));
        }
        let (host, port) = self
            .authority
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse().ok()?)))
            .ok_or_else(|| format!("{} is not HOST:PORT", self.authority))?;
        let stream = pd_tls::dial(self.tls.as_ref(), host, port)
            .await
            .map_err(|e| format!("connecting to {}: {e}", self.authority))?;
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP handshake with {}: {e}", self.authority))?;
        tokio::spawn(conn);
        Ok(self.conn.insert(sender))
    }
}

/// The route and JSON body of a benchmark request.
fn body(request: &pb::GenerateRequest) -> (&'static str, Value) {
    use pb::generate_request::Input;
    let sampling = request.sampling.clone().unwrap_or_default();
    let mut body = match &request.input {
        Some(Input::Chat(chat)) => {
            let messages: Vec<Value> = chat
                .messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            json!({"messages": messages})
        }
        Some(Input::TokenIds(ids)) => json!({"prompt": ids.ids}),
        Some(Input::Text(text)) => json!({"prompt": text}),
        None => json!({"prompt": ""}),
    };
    body["max_tokens"] = json!(request.max_tokens);
    body["temperature"] = json!(sampling.temperature.unwrap_or(1.0));
    body["ignore_eos"] = json!(request.ignore_eos);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let route = match request.input {
        Some(Input::Chat(_)) => "/chat/completions",
        _ => "/completions",
    };
    (route, body)
}

/// The gRPC code of an HTTP status (the benchmark's outcomes use the router's words).
fn code_of(status: u16) -> tonic::Code {
    match status {
        400 => tonic::Code::InvalidArgument,
        404 => tonic::Code::NotFound,
        429 => tonic::Code::ResourceExhausted,
        501 => tonic::Code::Unimplemented,
        503 => tonic::Code::Unavailable,
        504 => tonic::Code::DeadlineExceeded,
        _ => tonic::Code::Internal,
    }
}

/// An error object's outcome.
fn failed(error: &Value) -> Outcome {
    Outcome::Failed {
        code: code_of(error["code"].as_u64().unwrap_or(500) as u16),
        message: error["message"].as_str().unwrap_or("").to_string(),
    }
}

/// Send one request and time it; a failure is a record, never an error of the benchmark.
pub async fn send(
    client: &mut OpenaiClient,
    request: pb::GenerateRequest,
    window_start: Instant,
    session: usize,
    turn: usize,
) -> RequestRecord {
    let sent = Instant::now();
    let mut record =
        RequestRecord::new(session, turn, sent.saturating_duration_since(window_start));
    let result = exchange(client, &request, sent, &mut record).await;
    if let Err(message) = result {
        record.outcome = Outcome::Failed {
            code: tonic::Code::Unavailable,
            message,
        };
    }
    record.e2e = sent.elapsed();
    record
}

async fn exchange(
    client: &mut OpenaiClient,
    request: &pb::GenerateRequest,
    sent: Instant,
    record: &mut RequestRecord,
) -> Result<(), String> {
    let (route, body) = body(request);
    let http = hyper::Request::post(format!("{}{route}", client.prefix))
        .header(hyper::header::HOST, client.authority.as_str())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let response = client
        .sender()
        .await?
        .send_request(http)
        .await
        .map_err(|e| format!("HTTP request: {e}"))?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    if status != 200 {
        let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        record.outcome = failed(&v["error"]);
        return Ok(());
    }
    let mut pending = Vec::new();
    let mut last_token_at: Option<Instant> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        pending.extend_from_slice(data);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let Some(payload) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let payload = &payload[..payload.len() - 2];
            if payload == b"[DONE]" {
                return Ok(());
            }
            let chunk: Value =
                serde_json::from_slice(payload).map_err(|e| format!("a stream event: {e}"))?;
            if chunk.get("error").is_some() {
                record.outcome = failed(&chunk["error"]);
                return Ok(());
            }
            observe(&chunk, now, sent, &mut last_token_at, record);
        }
    }
    Ok(())
}

/// One stream chunk: a token arrival (text in it), the finish, the usage.
fn observe(
    chunk: &Value,
    now: Instant,
    sent: Instant,
    last_token_at: &mut Option<Instant>,
    record: &mut RequestRecord,
) {
    for choice in chunk["choices"].as_array().into_iter().flatten() {
        let text = choice["text"]
            .as_str()
            .or_else(|| choice["delta"]["content"].as_str())
            .unwrap_or("");
        let reasoning = choice["delta"]["reasoning_content"].as_str().unwrap_or("");
        if !text.is_empty() || !reasoning.is_empty() {
            match *last_token_at {
                None => record.ttft = Some(now - sent),
                Some(before) => record.itl.push(now - before),
            }
            *last_token_at = Some(now);
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            record.outcome = Outcome::Finished(reason.to_string());
        }
    }
    let usage = &chunk["usage"];
    if usage.is_object() {
        let count = |v: &Value| v.as_u64().unwrap_or(0) as u32;
        let details = &usage["prompt_tokens_details"];
        record.prompt_tokens = count(&usage["prompt_tokens"]);
        record.completion_tokens = count(&usage["completion_tokens"]);
        record.cached_tokens = count(&details["cached_tokens"]);
        record.local_cached_tokens = count(&details["local_cached_tokens"]);
        record.external_cached_tokens = count(&details["external_cached_tokens"]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_take_each_route_and_the_benchmarks_settings() {
        let mut req = super::super::client::wire_request(
            &super::super::workload::Prompt::TokenIds(vec![1, 2]),
            5,
            0.0,
            true,
        );
        let (route, b) = body(&req);
        assert_eq!(route, "/completions");
        assert_eq!(b["prompt"], json!([1, 2]));
        assert_eq!(
            (b["max_tokens"].clone(), b["ignore_eos"].clone()),
            (json!(5), json!(true))
        );
        assert_eq!(b["stream_options"]["include_usage"], true);
        req.input = Some(pb::generate_request::Input::Chat(pb::ChatInput {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            ..Default::default()
        }));
        let (route, b) = body(&req);
        assert_eq!(route, "/chat/completions");
        assert_eq!(b["messages"][0], json!({"role": "user", "content": "hi"}));
        let c = OpenaiClient::new("http://127.0.0.1:9/v1", None);
        assert_eq!(
            (c.authority.as_str(), c.prefix.as_str()),
            ("127.0.0.1:9", "/v1")
        );
    }
}
