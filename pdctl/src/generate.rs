//! `pdctl generate`: one request to a running cluster's router, printed like `pdctl run`
//! (streamed text, or one JSON object with `--json`); with `--n` several choices, each
//! printed when it ends (text after `[i] `, or one JSON object per line with its `index`).

use std::io::Write;

use anyhow::Context;
use clap::Args;
use pd_proto::pb;
use serde_json::json;

#[derive(Debug, Args)]
#[group(id = "input", required = true, multiple = false, args = ["prompt", "chat", "token_ids"])]
pub struct GenerateArgs {
    /// The router's gRPC address (HOST:PORT).
    #[arg(long, env = "PD_ROUTER")]
    router: String,
    #[command(flatten)]
    ca: crate::tls::CaArgs,
    /// Raw text prompt (no chat template).
    #[arg(long)]
    prompt: Option<String>,
    /// A user message, rendered through the model's chat template by the router.
    #[arg(long)]
    chat: Option<String>,
    /// Optional system message for `--chat`.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Function tools for `--chat`: a JSON array of tool objects (OpenAI's shape), rendered
    /// by the model's chat template.
    #[arg(long, requires = "chat")]
    tools: Option<std::path::PathBuf>,
    /// Prompt as token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    #[command(flatten)]
    sampling: crate::run::SamplingArgs,
    /// Prefix-cache isolation salt.
    #[arg(long)]
    cache_salt: Option<String>,
    /// The router's API key (its `--api-keys`), sent as `authorization: Bearer KEY`.
    #[arg(long, env = "PD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Choices: sample this many sequences for the prompt (1 to 16; with --seed, choice i
    /// uses seed + i).
    #[arg(long, default_value_t = 1)]
    n: u32,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Read the answer's `<think>` block out of its text (the router's Qwen3 reasoning
    /// parser): streamed to stderr, or `reasoning` in `--json`.
    #[arg(long)]
    parse_reasoning: bool,
    /// Read the answer's `<tool_call>` blocks out of its text (the router's Hermes parser):
    /// printed as `[call] NAME ARGUMENTS` at the end, or `tool_calls` in `--json`.
    #[arg(long)]
    parse_tool_calls: bool,
    /// The blocks `--parse-tool-calls` reads: `hermes` (JSON; the default) or `qwen3-coder`
    /// (Qwen3-Coder's `<function=…>` blocks, values typed by `--tools`).
    #[arg(long, value_enum, requires = "parse_tool_calls")]
    tool_call_format: Option<ToolCallFormat>,
}

/// `GenerateRequest.tool_call_format`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ToolCallFormat {
    Hermes = pb::ToolCallFormat::Hermes as isize,
    Qwen3Coder = pb::ToolCallFormat::Qwen3Coder as isize,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(generate(args))
}

fn request(args: &GenerateArgs, tools: Vec<String>) -> pb::GenerateRequest {
    use pb::generate_request::Input;
    let input = if let Some(ids) = &args.token_ids {
        Input::TokenIds(pb::TokenIds { ids: ids.clone() })
    } else if let Some(text) = &args.prompt {
        Input::Text(text.clone())
    } else {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(pb::ChatMessage {
                role: "system".into(),
                content: system.clone(),
                ..Default::default()
            });
        }
        messages.push(pb::ChatMessage {
            role: "user".into(),
            content: args.chat.clone().unwrap_or_default(),
            ..Default::default()
        });
        Input::Chat(pb::ChatInput {
            messages,
            enable_thinking: None,
            tools,
        })
    };
    let p = args.sampling.params();
    pb::GenerateRequest {
        model: String::new(),
        input: Some(input),
        sampling: Some(pd_proto::convert::wire_sampling(&p)),
        max_tokens: Some(p.max_tokens),
        stop: p.stop.clone(),
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        include_stop_str_in_output: false,
        cache_salt: args.cache_salt.clone(),
        truncate_prompt_tokens: args.sampling.truncate_prompt_tokens,
        bad_words: args.sampling.bad_words.clone(),
        request_id: None,
        skip_special_tokens: Some(p.skip_special_tokens),
        n: Some(args.n),
        parse_reasoning: args.parse_reasoning,
        parse_tool_calls: args.parse_tool_calls,
        // Unset unless asked for: the router refuses a format without parse_tool_calls.
        tool_call_format: args
            .tool_call_format
            .map_or(pb::ToolCallFormat::Unspecified as i32, |f| f as i32),
    }
}

async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let tools = match &args.tools {
        Some(path) => crate::tools::read(path)?,
        None => Vec::new(),
    };
    let tls = args.ca.client(pd_tls::Alpn::Grpc)?;
    let channel = crate::tls::channel(&args.router, tls.as_ref()).await?;
    let mut client = crate::auth::ApiKey::new(args.api_key.as_deref())?.client(channel);
    let mut stream = client
        .generate(request(&args, tools))
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", code_name(s.code()), s.message()))?
        .into_inner();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut choices: Vec<Choice> = Vec::new();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", code_name(s.code()), s.message()))?
    {
        let index = chunk.index as usize;
        if index >= choices.len() {
            choices.resize_with(index + 1, Choice::default);
        }
        let choice = &mut choices[index];
        choice.token_ids.extend_from_slice(&chunk.token_ids);
        choice.text.push_str(&chunk.text);
        choice.reasoning.push_str(&chunk.reasoning);
        for part in &chunk.tool_calls {
            let at = part.index as usize;
            if at >= choice.calls.len() {
                choice.calls.resize_with(at + 1, Call::default);
            }
            let call = &mut choice.calls[at];
            if let Some(id) = &part.id {
                call.id.clone_from(id);
            }
            if let Some(name) = &part.name {
                call.name.clone_from(name);
            }
            call.arguments.push_str(&part.arguments);
        }
        choice.logprobs.extend(chunk.logprobs.iter().cloned());
        choice
            .prompt_logprobs
            .extend(chunk.prompt_logprobs.iter().cloned());
        let finished = chunk.finish_reason != pb::FinishReason::Unspecified as i32;
        if !args.json {
            if args.n == 1 {
                if !chunk.reasoning.is_empty() {
                    let mut err = std::io::stderr().lock();
                    err.write_all(chunk.reasoning.as_bytes())?;
                    err.flush()?;
                }
                out.write_all(chunk.text.as_bytes())?;
                out.flush()?;
            } else if finished {
                writeln!(out, "[{index}] {}", choice.text)?;
            }
            if finished && !choice.calls.is_empty() {
                if args.n == 1 {
                    // The streamed text's line ends first.
                    writeln!(out)?;
                }
                for call in &choice.calls {
                    writeln!(out, "[call] {} {}", call.name, call.arguments)?;
                }
            }
        }
        if finished {
            choice.last = Some(chunk);
        }
    }
    if choices.len() != args.n as usize || choices.iter().any(|c| c.last.is_none()) {
        anyhow::bail!("the stream ended before every choice had a finish reason");
    }
    if !args.json {
        if args.n == 1 && choices[0].calls.is_empty() {
            writeln!(out)?;
        }
        return Ok(());
    }
    for (index, choice) in choices.iter().enumerate() {
        let object = choice.json(&args, index);
        writeln!(out, "{object}")?;
    }
    Ok(())
}

/// One choice's stream, added up.
#[derive(Default)]
struct Choice {
    token_ids: Vec<u32>,
    text: String,
    reasoning: String,
    calls: Vec<Call>,
    logprobs: Vec<pb::Logprob>,
    prompt_logprobs: Vec<pb::Logprob>,
    /// Its last chunk (finish reason, usage).
    last: Option<pb::GenerateResponse>,
}

/// A tool call's pieces, joined.
#[derive(Default)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

impl Choice {
    /// The `--json` object of a finished choice.
    fn json(&self, args: &GenerateArgs, index: usize) -> serde_json::Value {
        let last = self.last.clone().unwrap_or_default();
        let reason = pd_proto::convert::engine_finish_reason(last.finish_reason())
            .map(|r| r.as_str())
            .unwrap_or("unspecified");
        let usage = last.usage.unwrap_or_default();
        let lp = |l: &pb::Logprob| {
            json!({
                "token_id": l.token_id,
                "logprob": l.logprob,
                "top": l.top.iter().map(|t| json!({"token_id": t.token_id, "logprob": t.logprob})).collect::<Vec<_>>(),
            })
        };
        let mut object = json!({
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": reason,
            "stop_reason": match &last.stop_reason {
                Some(pb::generate_response::StopReason::StopTokenId(id)) => json!(id),
                Some(pb::generate_response::StopReason::StopString(s)) => json!(s),
                None => serde_json::Value::Null,
            },
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.cached_tokens,
                "local_cached_tokens": usage.local_cached_tokens,
                "external_cached_tokens": usage.external_cached_tokens,
                "external_host_cached_tokens": usage.external_host_cached_tokens,
                "external_peer_cached_tokens": usage.external_peer_cached_tokens,
            },
            "logprobs": args.sampling.logprobs.map(|_| self.logprobs.iter().map(lp).collect::<Vec<_>>()),
            "prompt_logprobs": args.sampling.prompt_logprobs.map(|_| self.prompt_logprobs.iter().map(lp).collect::<Vec<_>>()),
        });
        if args.n > 1 {
            object["index"] = json!(index);
        }
        if args.parse_reasoning {
            object["reasoning"] = json!(self.reasoning);
        }
        if args.parse_tool_calls {
            object["tool_calls"] = self
                .calls
                .iter()
                .map(|c| json!({"id": c.id, "name": c.name, "arguments": c.arguments}))
                .collect();
        }
        object
    }
}

/// The status code as gRPC spells it (INVALID_ARGUMENT, ...), for one-line errors.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
