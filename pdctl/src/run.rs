//! `pdctl run`: generate with one model in this process, through the serving engine (the
//! same continuous-batching engine and prefix cache the nodes run). Text streams to stdout as
//! it is generated; `--json` prints one object per request instead. With `--prompts-file`
//! the prompts go through one engine one after another (so the prefix cache is observable),
//! or all at once with `--concurrent`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use pd_engine::cli::EngineArgs;
use pd_engine::model::ModelFiles;
use pd_engine::sampling::{
    FinishReason, Guide, GuideCache, PromptLogprob, SampledToken, SamplingParams, StopReason,
    StructuredOutput, TokenLogprob, bad_words_token_ids,
};
use pd_engine::serve::{
    EngineHandle, EngineRequest, RequestEvent, RequestId, Role, TierKind, Usage,
};
use pd_engine::serve::{truncate_prompt, validate_prompt};
use pd_engine::text::TextStream;
use pd_engine::tokenizer::{ChatMessage, ChatRole, ChatTemplateOptions, ChatTool};
use serde_json::json;

#[derive(Debug, Args)]
#[group(id = "input", required = true, multiple = false, args = ["prompt", "chat", "token_ids", "prompts_file"])]
pub struct RunArgs {
    /// Model directory (Hugging Face layout) or `synthetic:tiny|tiny-moe|qwen3-0.6b|qwen3-8b|qwen3-30b-a3b`.
    #[arg(long, env = "PD_MODEL", default_value = "synthetic:tiny")]
    model: String,
    /// Raw text prompt (no chat template).
    #[arg(long)]
    prompt: Option<String>,
    /// A user message, rendered through the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// Optional system message for `--chat`.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Function tools for `--chat`: a JSON array of tool objects (OpenAI's shape), rendered
    /// by the model's chat template.
    #[arg(long, requires = "chat")]
    tools: Option<PathBuf>,
    /// Prompt as token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// One JSON object per line: `token_ids` or `prompt`, optional `max_tokens`,
    /// `cache_salt`, `prompt_logprobs`.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Submit every prompt of `--prompts-file` at once instead of one after another.
    #[arg(long, requires = "prompts_file")]
    concurrent: bool,
    /// Prefix-cache isolation salt for every prompt (a line's `cache_salt` overrides it).
    #[arg(long, env = "PD_CACHE_SALT")]
    cache_salt: Option<String>,

    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,

    /// Print one JSON object per request (input order) instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_tokens: u32,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    /// In [-2, 2]: subtracted once from every token already in the output.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// In [-2, 2]: subtracted from every token in the output once per occurrence.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Generate at least this many tokens before EOS, a stop token or a stop string.
    #[arg(long, default_value_t = 0)]
    min_tokens: u32,
    /// Added to token logits before sampling: ID:BIAS pairs, comma separated, each bias in
    /// [-100, 100] (e.g. 151645:-100 all but bans `<|im_end|>`).
    #[arg(long, value_delimiter = ',', value_parser = parse_logit_bias, allow_hyphen_values = true)]
    logit_bias: Vec<(u32, f32)>,
    /// Sample only among these token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    allowed_token_ids: Vec<u32>,
    /// A word the model must not produce (repeatable; tokenized as written and after a
    /// space).
    #[arg(long = "bad-words")]
    pub(crate) bad_words: Vec<String>,
    /// Same seed, same output.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Stop token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Write special tokens (`<|im_start|>`, ...) into the text (vLLM's
    /// `skip_special_tokens=false`); the stop token that ends it stays out.
    #[arg(long)]
    keep_special_tokens: bool,
    /// Top-K logprobs of each generated token.
    #[arg(long)]
    pub(crate) logprobs: Option<u32>,
    /// Top-K logprobs of each prompt position after the first.
    #[arg(long)]
    pub(crate) prompt_logprobs: Option<u32>,
    /// Keep only the last N prompt tokens (after the chat template), 1 to the context length.
    #[arg(long)]
    pub(crate) truncate_prompt_tokens: Option<u32>,
    /// Structured output: the whole output text matches this regex (Rust syntax).
    #[arg(long, group = "structured")]
    regex: Option<String>,
    /// Structured output: the output is exactly one of these strings (repeatable).
    #[arg(long, group = "structured")]
    choice: Vec<String>,
    /// Structured output: the output is JSON this JSON schema (its text) accepts.
    #[arg(long, group = "structured")]
    json_schema: Option<String>,
    /// Structured output: the output is one JSON object, any (OpenAI's `json_object`).
    #[arg(long, group = "structured")]
    json_object: bool,
    /// Structured output: the whole output text matches this GBNF grammar (its text, from
    /// its `root` rule; `--grammar "$(cat file.gbnf)"`).
    #[arg(long, group = "structured")]
    grammar: Option<String>,
}

impl SamplingArgs {
    pub(crate) fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_tokens: self.max_tokens,
            min_tokens: self.min_tokens,
            logit_bias: self.logit_bias.clone(),
            allowed_token_ids: self.allowed_token_ids.clone(),
            // Tokenized where the tokenizer is (`run`, or the router for `generate`).
            bad_words_token_ids: Vec::new(),
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            include_stop_str_in_output: false,
            skip_special_tokens: !self.keep_special_tokens,
            structured_output: if let Some(regex) = &self.regex {
                Some(StructuredOutput::Regex(regex.clone()))
            } else if let Some(schema) = &self.json_schema {
                Some(StructuredOutput::JsonSchema(schema.clone()))
            } else if !self.choice.is_empty() {
                Some(StructuredOutput::Choice(self.choice.clone()))
            } else if self.json_object {
                Some(StructuredOutput::JsonObject)
            } else {
                self.grammar.clone().map(StructuredOutput::Grammar)
            },
        }
    }
}

/// One `--logit-bias` entry, `ID:BIAS` (the range is checked with the other sampling values).
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}` is not ID:BIAS"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|e| format!("`{id}` is not a token id: {e}"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|e| format!("`{bias}` is not a number: {e}"))?;
    Ok((id, bias))
}

/// One prompt to run.
struct Job {
    prompt: Vec<u32>,
    params: SamplingParams,
    cache_salt: Option<String>,
    /// The compiled structured output, if the request has one.
    guide: Option<Arc<Guide>>,
}

/// What a request produced, as printed.
struct Outcome {
    token_ids: Vec<u32>,
    text: String,
    finish_reason: FinishReason,
    /// The stop token id or stop string that ended the request, if one did.
    stop_reason: Option<StopReason>,
    usage: Usage,
    /// `None` when logprobs were not asked for.
    logprobs: Option<Vec<SampledToken>>,
    prompt_logprobs: Option<Vec<PromptLogprob>>,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let files = crate::load::open(&args.model)?;
    let config = &files.config;
    let max_model_len = args.engine.max_model_len(config)?;
    let mut jobs = jobs(&args, &files)?;
    let bad_words = bad_words_token_ids(&files.tokenizer, &args.sampling.bad_words)?;
    let guides = GuideCache::new(files.tokenizer.clone(), files.eos_token_ids());
    let many = jobs.len() > 1;
    for (i, job) in jobs.iter_mut().enumerate() {
        job.params.bad_words_token_ids = bad_words.clone();
        let at = |e: anyhow::Error| {
            if many {
                e.context(format!("prompt {}", i + 1))
            } else {
                e
            }
        };
        job.params
            .validate(config.vocab_size, max_model_len as u32)
            .map_err(|e| at(e.into()))?;
        if let Some(spec) = &job.params.structured_output {
            job.guide = Some(guides.get(spec).map_err(|e| at(e.into()))?);
        }
        if let Some(keep) = args.sampling.truncate_prompt_tokens {
            truncate_prompt(&mut job.prompt, keep, max_model_len).map_err(|e| at(e.into()))?;
        }
        validate_prompt(
            &job.prompt,
            config.vocab_size,
            max_model_len,
            job.params.max_tokens,
        )
        .map_err(|e| at(e.into()))?;
    }

    let eos = files.eos_token_ids();
    let thread = crate::load::start_engine(
        &files,
        &args.engine,
        Role::Mixed,
        args.sampling.seed.unwrap_or(0),
        Duration::from_secs(30),
    )?;
    let handle = thread.handle();

    let stream_text = !args.json && jobs.len() == 1;
    let submit = |i: usize, job: &Job| {
        handle.submit(EngineRequest {
            id: RequestId(format!("pdctl-{i}")),
            prompt: job.prompt.clone(),
            params: job.params.clone(),
            cache_salt: job.cache_salt.clone(),
            imported: None,
            lease_kv: false,
            guide: job.guide.clone(),
            resumed: 0,
        })
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let print = |i: usize, o: &Outcome, out: &mut std::io::StdoutLock<'_>| -> anyhow::Result<()> {
        if args.json {
            writeln!(out, "{}", to_json(o))?;
        } else if !stream_text {
            writeln!(out, "[{}] {}", i + 1, o.text)?;
        } else {
            writeln!(out)?;
        }
        Ok(())
    };
    if args.concurrent {
        let receivers: Vec<_> = jobs.iter().enumerate().map(|(i, j)| submit(i, j)).collect();
        for (i, (job, rx)) in jobs.iter().zip(receivers).enumerate() {
            let o = collect(&handle, &files, &eos, job, i, rx, None)?;
            print(i, &o, &mut out)?;
        }
    } else {
        for (i, job) in jobs.iter().enumerate() {
            let rx = submit(i, job);
            let live = stream_text.then_some(&mut out as &mut dyn Write);
            let o = collect(&handle, &files, &eos, job, i, rx, live)?;
            print(i, &o, &mut out)?;
        }
    }
    Ok(())
}

/// Read one request's events to the end, running the text side (detokenization, stop
/// strings) and aborting the engine request when a stop string ends it.
fn collect(
    handle: &EngineHandle,
    files: &ModelFiles,
    eos: &[u32],
    job: &Job,
    index: usize,
    rx: Receiver<RequestEvent>,
    mut live: Option<&mut dyn Write>,
) -> anyhow::Result<Outcome> {
    let mut text = TextStream::new(&files.tokenizer, &job.params, eos.to_vec());
    let mut token_ids = Vec::new();
    let mut logprobs = Vec::new();
    let mut prompt_logprobs = None;
    let mut text_finish: Option<FinishReason> = None;
    loop {
        let event = rx
            .recv()
            .context("the engine stopped without finishing the request")?;
        match event {
            RequestEvent::PromptLogprobs(scores) => prompt_logprobs = Some(scores),
            RequestEvent::Token(t) => {
                if text_finish.is_some() {
                    continue; // generated before the abort reached the engine
                }
                let decision = text.push(t.token_id)?;
                token_ids.push(t.token_id);
                logprobs.push(t);
                if let Some(w) = live.as_mut() {
                    w.write_all(decision.text.as_bytes())?;
                    w.flush()?;
                }
                if let Some(reason) = decision.finished {
                    text_finish = Some(reason);
                    handle.abort(RequestId(format!("pdctl-{index}")));
                }
            }
            RequestEvent::Finished(f) => {
                let rest = text.flush();
                if let Some(w) = live.as_mut() {
                    w.write_all(rest.as_bytes())?;
                }
                let mut usage = f.usage;
                usage.completion_tokens = token_ids.len();
                return Ok(Outcome {
                    token_ids,
                    text: text.text().to_string(),
                    finish_reason: text_finish.unwrap_or(f.reason),
                    stop_reason: text.stop_reason().cloned(),
                    usage,
                    logprobs: job.params.logprobs.map(|_| logprobs),
                    prompt_logprobs,
                });
            }
            RequestEvent::Failed(e) => bail!("request {} failed: {e}", index + 1),
        }
    }
}

fn jobs(args: &RunArgs, files: &ModelFiles) -> anyhow::Result<Vec<Job>> {
    let params = args.sampling.params();
    let tokenizer = &files.tokenizer;
    let one = |prompt: Vec<u32>| Job {
        prompt,
        params: params.clone(),
        cache_salt: args.cache_salt.clone(),
        guide: None,
    };
    if let Some(ids) = &args.token_ids {
        return Ok(vec![one(ids.clone())]);
    }
    if let Some(text) = &args.prompt {
        return Ok(vec![one(tokenizer.encode(text)?)]);
    }
    if let Some(text) = &args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new(ChatRole::System, system.clone()));
        }
        messages.push(ChatMessage::new(ChatRole::User, text.clone()));
        let tools = match &args.tools {
            Some(path) => crate::tools::read(path)?
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    ChatTool::from_json(t)
                        .map_err(|e| anyhow::anyhow!("{}: tool {i}: {e}", path.display()))
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let options = ChatTemplateOptions {
            add_generation_prompt: true,
            tools,
            ..ChatTemplateOptions::default()
        };
        let rendered = tokenizer.apply_chat_template_with(&messages, &options)?;
        return Ok(vec![one(tokenizer.encode(&rendered)?)]);
    }
    let path = args.prompts_file.as_ref().expect("clap requires one input");
    let body =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut jobs = Vec::new();
    for (n, line) in body.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), n + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{at}: not a JSON object"))?;
        let obj = v
            .as_object()
            .with_context(|| format!("{at}: not a JSON object"))?;
        for key in obj.keys() {
            if ![
                "token_ids",
                "prompt",
                "max_tokens",
                "cache_salt",
                "prompt_logprobs",
            ]
            .contains(&key.as_str())
            {
                bail!("{at}: unknown field {key:?}");
            }
        }
        let prompt = match (obj.get("token_ids"), obj.get("prompt")) {
            (Some(ids), None) => {
                serde_json::from_value::<Vec<u32>>(ids.clone()).with_context(|| {
                    format!("{at}: token_ids must be a list of non-negative integers")
                })?
            }
            (None, Some(serde_json::Value::String(text))) => tokenizer.encode(text)?,
            (None, Some(_)) => bail!("{at}: prompt must be a string"),
            _ => bail!("{at}: exactly one of token_ids or prompt is required"),
        };
        let mut p = params.clone();
        if let Some(m) = obj.get("max_tokens") {
            p.max_tokens = m
                .as_u64()
                .and_then(|m| u32::try_from(m).ok())
                .with_context(|| format!("{at}: max_tokens must be a positive integer"))?;
        }
        if let Some(k) = obj.get("prompt_logprobs") {
            p.prompt_logprobs = Some(
                k.as_u64()
                    .and_then(|k| u32::try_from(k).ok())
                    .with_context(|| {
                        format!("{at}: prompt_logprobs must be a non-negative integer")
                    })?,
            );
        }
        let cache_salt = match obj.get("cache_salt") {
            None => args.cache_salt.clone(),
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(_) => bail!("{at}: cache_salt must be a string"),
        };
        jobs.push(Job {
            prompt,
            params: p,
            cache_salt,
            guide: None,
        });
    }
    anyhow::ensure!(!jobs.is_empty(), "{}: no prompts", path.display());
    Ok(jobs)
}

fn to_json(o: &Outcome) -> serde_json::Value {
    let top = |top: &[TokenLogprob]| -> serde_json::Value {
        top.iter()
            .map(|t| json!({"token_id": t.token_id, "logprob": t.logprob}))
            .collect()
    };
    let u = &o.usage;
    json!({
        "token_ids": o.token_ids,
        "text": o.text,
        "finish_reason": o.finish_reason.as_str(),
        "stop_reason": match &o.stop_reason {
            Some(StopReason::TokenId(id)) => json!(id),
            Some(StopReason::Text(s)) => json!(s),
            None => serde_json::Value::Null,
        },
        "usage": {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "cached_tokens": u.cached_tokens(),
            "local_cached_tokens": u.local_cached_tokens,
            "external_cached_tokens": u.external_cached_tokens,
            "external_host_cached_tokens": u.external_cached_by_source[TierKind::Host],
            "external_peer_cached_tokens": u.external_cached_by_source[TierKind::Peer],
        },
        "logprobs": o.logprobs.as_ref().map(|lps| lps.iter().map(|s| json!({
                "token_id": s.token_id,
                "logprob": s.logprob,
                "top": top(&s.top),
            })).collect::<Vec<_>>()),
        "prompt_logprobs": o.prompt_logprobs.as_ref().map(|lps| lps.iter().map(|p| json!({
            "token_id": p.token_id,
            "logprob": p.logprob,
            "top": top(&p.top),
        })).collect::<Vec<_>>()),
    })
}
