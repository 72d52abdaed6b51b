//! `pdctl run`: generate with one model in this process. Text streams to stdout as it is
//! generated; `--json` prints one object at the end instead.

use std::io::Write;

use anyhow::{Context, bail};
use clap::Args;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::generate::{Generation, Runner};
use pd_engine::kv::DEFAULT_BLOCK_SIZE;
use pd_engine::sampling::SamplingParams;
use pd_engine::tokenizer::{ChatMessage, ChatRole};
use serde_json::json;

#[derive(Debug, Args)]
#[group(id = "input", required = true, multiple = false, args = ["prompt", "chat", "token_ids"])]
pub struct RunArgs {
    /// Model directory (Hugging Face layout) or `synthetic:tiny|qwen3-0.6b|qwen3-8b`.
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
    /// Prompt as token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,

    #[command(flatten)]
    sampling: SamplingArgs,

    /// Tokens per KV block.
    #[arg(long, env = "PD_BLOCK_SIZE", default_value_t = DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Context limit (prompt + generated); defaults to the model's max_position_embeddings.
    #[arg(long, env = "PD_MAX_MODEL_LEN")]
    max_model_len: Option<usize>,
    /// Prefill chunk: at most this many prompt tokens per forward pass.
    #[arg(long, env = "PD_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
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
    /// Top-K logprobs of each generated token.
    #[arg(long)]
    logprobs: Option<u32>,
    /// Top-K logprobs of each prompt position after the first.
    #[arg(long)]
    prompt_logprobs: Option<u32>,
}

impl SamplingArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            include_stop_str_in_output: false,
        }
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let params = args.sampling.params();
    let files = crate::load::open(&args.model)?;
    let config = &files.config;
    params.validate(config.vocab_size, u32::MAX)?;
    let max_model_len = args.max_model_len.unwrap_or(config.max_position_embeddings);

    let prompt: Vec<u32> = if let Some(ids) = &args.token_ids {
        ids.clone()
    } else if let Some(text) = &args.prompt {
        files.tokenizer.encode(text)?
    } else if let Some(text) = &args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage { role: ChatRole::System, content: system.clone() });
        }
        messages.push(ChatMessage { role: ChatRole::User, content: text.clone() });
        let rendered = files.tokenizer.apply_chat_template(&messages, true)?;
        files.tokenizer.encode(&rendered)?
    } else {
        bail!("one of --prompt, --chat or --token-ids is required");
    };
    pd_engine::generate::validate_prompt(
        &prompt,
        config.vocab_size,
        max_model_len.min(config.max_position_embeddings),
        params.max_tokens,
    )?;

    let model = crate::load::weights(&files)?;
    // KV for exactly this request: no more memory than it can use.
    let blocks = (prompt.len() + params.max_tokens as usize).div_ceil(args.block_size);
    let mut runner = Runner::new(CpuBackend::new(), model, args.block_size, blocks)?;
    runner.set_max_model_len(max_model_len)?;
    let seed = params.seed.unwrap_or(0);
    let eos = files.eos_token_ids();

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let json = args.json;
    let mut write_error = None;
    let generation = runner
        .generate(
            &prompt,
            &params,
            seed,
            &eos,
            &files.tokenizer,
            args.max_num_batched_tokens,
            &mut |event| {
                if !json && !event.text.is_empty() && write_error.is_none() {
                    if let Err(e) = out.write_all(event.text.as_bytes()).and_then(|_| out.flush()) {
                        write_error = Some(e);
                    }
                }
            },
        )
        .context("generation failed")?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    if json {
        writeln!(out, "{}", to_json(&generation))?;
    } else {
        writeln!(out)?;
    }
    Ok(())
}

fn to_json(g: &Generation) -> serde_json::Value {
    let top = |top: &[pd_engine::sampling::TokenLogprob]| -> serde_json::Value {
        top.iter()
            .map(|t| json!({"token_id": t.token_id, "logprob": t.logprob}))
            .collect()
    };
    json!({
        "token_ids": g.token_ids,
        "text": g.text,
        "finish_reason": g.finish_reason.as_str(),
        "usage": {
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.token_ids.len(),
        },
        "logprobs": g.logprobs.as_ref().map(|lps| lps.iter().map(|s| json!({
            "token_id": s.token_id,
            "logprob": s.logprob,
            "top": top(&s.top),
        })).collect::<Vec<_>>()),
        "prompt_logprobs": g.prompt_logprobs.as_ref().map(|lps| lps.iter().map(|p| json!({
            "token_id": p.token_id,
            "logprob": p.logprob,
            "top": top(&p.top),
        })).collect::<Vec<_>>()),
    })
}
