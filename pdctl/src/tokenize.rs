//! `pdctl tokenize`: token ids of raw text as JSON, one object per input.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use pd_engine::model::ModelSource;
use pd_engine::tokenizer::Tokenizer;

#[derive(Debug, Args)]
#[group(id = "input", required = true, multiple = false, args = ["text", "jsonl"])]
pub struct TokenizeArgs {
    /// Model directory or `synthetic:NAME` (only its tokenizer is loaded).
    #[arg(long, env = "PD_MODEL", default_value = "synthetic:tiny")]
    model: String,
    /// Text to tokenize.
    #[arg(long)]
    text: Option<String>,
    /// A file of `{"text": ...}` objects, one per line, answered line by line.
    #[arg(long)]
    jsonl: Option<PathBuf>,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let tokenizer = match ModelSource::parse(&args.model)? {
        // Synthetic models all use the embedded Qwen3 tokenizer: no need to write weights.
        ModelSource::Synthetic { .. } => Tokenizer::qwen3()?,
        ModelSource::Dir(dir) => Tokenizer::from_dir(&dir)
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))?,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if let Some(text) = args.text {
        let ids = tokenizer.encode(&text)?;
        writeln!(out, "{}", serde_json::json!({ "ids": ids }))?;
        return Ok(());
    }
    let path = args.jsonl.expect("clap requires one input");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a JSON object", path.display(), n + 1))?;
        let text = value
            .get("text")
            .and_then(|t| t.as_str())
            .with_context(|| {
                format!(
                    "{}:{}: missing string field \"text\"",
                    path.display(),
                    n + 1
                )
            })?;
        let ids = tokenizer.encode(text)?;
        writeln!(out, "{}", serde_json::json!({ "ids": ids }))?;
        out.flush()?;
    }
    Ok(())
}
