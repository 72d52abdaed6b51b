//! `pdctl bench compare A.json B.json`: two reports side by side with the ratio B / A of each
//! figure (e.g. PD vs one mixed node, prefix-aware vs round-robin routing).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;

use super::report::{Report, SCHEMA, SCHEMA_VERSION};

#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// The baseline report (`pdctl bench --json`).
    pub a: PathBuf,
    /// The report compared with it.
    pub b: PathBuf,
}

pub fn load(path: &Path) -> anyhow::Result<Report> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if value["schema"] != SCHEMA {
        bail!(
            "{} is not a pdctl bench report (no \"schema\": \"{SCHEMA}\")",
            path.display()
        );
    }
    if value["schema_version"] != SCHEMA_VERSION {
        bail!(
            "{} has schema_version {}; this pdctl reads version {SCHEMA_VERSION}",
            path.display(),
            value["schema_version"]
        );
    }
    serde_json::from_value(value).with_context(|| format!("reading the report {}", path.display()))
}

/// (name, value) of every compared figure; None where a report has no such figure.
fn figures(r: &Report) -> Vec<(&'static str, Option<f64>)> {
    let s = &r.summary;
    let hit = |f: fn(&super::report::RouterCache) -> Option<f64>| {
        r.router_prefix_cache.as_ref().and_then(f)
    };
    let kv = |f: fn(&super::report::KvTransferWindow) -> Option<f64>| {
        r.router_kv_transfer.as_ref().and_then(f)
    };
    vec![
        ("successful requests", Some(s.successful as f64)),
        ("failed requests", Some(s.failed as f64)),
        ("duration (s)", Some(s.duration_s)),
        ("request throughput (req/s)", Some(s.request_throughput)),
        (
            "goodput (req/s)",
            s.goodput.as_ref().map(|g| g.request_goodput),
        ),
        ("input tokens/s", Some(s.input_token_throughput)),
        ("output tokens/s", Some(s.output_token_throughput)),
        ("TTFT mean (ms)", Some(s.ttft_ms.mean)),
        ("TTFT p50 (ms)", Some(s.ttft_ms.median)),
        ("TTFT p90 (ms)", Some(s.ttft_ms.p90)),
        ("TTFT p99 (ms)", Some(s.ttft_ms.p99)),
        ("TPOT p50 (ms)", Some(s.tpot_ms.median)),
        ("TPOT p99 (ms)", Some(s.tpot_ms.p99)),
        ("ITL p50 (ms)", Some(s.itl_ms.median)),
        ("ITL p99 (ms)", Some(s.itl_ms.p99)),
        ("E2E p50 (ms)", Some(s.e2el_ms.median)),
        ("E2E p99 (ms)", Some(s.e2el_ms.p99)),
        ("cached share in usage", s.usage_cache.cached_ratio),
        ("router local hit rate", hit(|c| c.local.hit_rate)),
        ("router external hit rate", hit(|c| c.external.hit_rate)),
        ("KV pulled (MB)", kv(|k| Some(k.bytes / 1e6))),
        (
            "KV per transfer (MB)",
            kv(|k| k.mean_bytes_per_transfer.map(|b| b / 1e6)),
        ),
        ("KV transfer mean (ms)", kv(|k| k.mean_transfer_ms)),
    ]
}

fn name_of(r: &Report, path: &Path) -> String {
    r.label.clone().unwrap_or_else(|| {
        path.file_stem()
            .map_or("?".into(), |s| s.to_string_lossy().into())
    })
}

/// The side-by-side table.
pub fn table(a: &Report, a_name: &str, b: &Report, b_name: &str) -> String {
    let mut t = String::new();
    // Columns as wide as the longer run name, so labels never run together.
    let w = a_name.len().max(b_name.len()).max(12) + 2;
    let _ = writeln!(t, "{:<28}{a_name:>w$}{b_name:>w$}{:>10}", "", "B/A");
    for ((name, x), (_, y)) in figures(a).into_iter().zip(figures(b)) {
        let cell = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.3}"));
        let ratio = match (x, y) {
            (Some(x), Some(y)) if x != 0.0 => format!("{:.3}", y / x),
            _ => "n/a".into(),
        };
        let _ = writeln!(t, "{name:<28}{:>w$}{:>w$}{ratio:>10}", cell(x), cell(y));
    }
    for (which, r) in [("A", a), ("B", b)] {
        let c = &r.config;
        let _ = writeln!(
            t,
            "{which}: {} on {}{}, {} (rate {}, concurrency {}, seed {})",
            c.workload,
            c.model,
            c.cluster
                .as_ref()
                .map_or(String::new(), |x| format!(" [{x}]")),
            c.shape,
            c.request_rate,
            c.max_concurrency
                .map_or("unlimited".into(), |n| n.to_string()),
            c.seed
        );
    }
    t
}

pub fn run(args: CompareArgs) -> anyhow::Result<()> {
    let a = load(&args.a)?;
    let b = load(&args.b)?;
    print!(
        "{}",
        table(&a, &name_of(&a, &args.a), &b, &name_of(&b, &args.b))
    );
    Ok(())
}
