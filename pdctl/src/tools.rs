//! `--tools FILE`: the function tools of a `--chat` request, read from a JSON array, each
//! element kept as written (its key order is what the chat template renders).

use std::path::Path;

use anyhow::Context;
use serde_json::value::RawValue;

/// Each element of the JSON array in `path`, as its own JSON text.
pub fn read(path: &Path) -> anyhow::Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let tools: Vec<Box<RawValue>> = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a JSON array of tools", path.display()))?;
    Ok(tools.into_iter().map(|t| t.get().to_string()).collect())
}
