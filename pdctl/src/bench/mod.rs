//! `pdctl bench`: the serving benchmark — a load generator against a cluster's router (or a
//! local cluster it starts with `--up`), reporting what `vllm bench serve` reports (throughput,
//! TTFT / TPOT / ITL / E2E percentiles, goodput) plus the router's local and external
//! prefix-cache hit rates over exactly the benchmark's window; `--json` writes the report,
//! `--plot` draws it, `pdctl bench compare` sets two reports side by side.
//!
//! - `args`: the command line; `workload` / `dataset`: what is sent; `client`: one timed
//!   request; `driver`: the load shape and the window; `scrape`: the router's counters;
//!   `stats`, `report`, `plot`, `compare`: the figures; `cluster`: `--up`.

mod args;
mod client;
mod cluster;
mod compare;
mod dataset;
mod driver;
mod openai;
mod plot;
mod report;
/// Also what `pdctl metrics` reads the router's `/metrics` with.
pub(crate) mod scrape;
mod stats;
mod workload;

use std::collections::HashMap;
use std::time::Duration;

use crate::auth::ApiKey;
use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use pd_proto::pb;
use tonic::transport::Channel;

pub use args::BenchArgs;
use args::{PromptFormat, WorkloadKind};
use workload::{ModelLimits, OutputLen, Prompt, Session};

/// Pool of distinct sessions a `--duration` run cycles through when `--num-prompts` is unset.
const DURATION_POOL: usize = 1000;
/// Measured requests when neither `--num-prompts` nor `--duration` is given.
const DEFAULT_PROMPTS: usize = 100;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchCommand {
    #[command(subcommand)]
    command: Option<BenchSubcommand>,
    #[command(flatten)]
    args: Box<BenchArgs>,
}

#[derive(Debug, Subcommand)]
enum BenchSubcommand {
    /// Print two reports side by side with the ratio B / A of each figure.
    Compare(compare::CompareArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd.command {
        Some(BenchSubcommand::Compare(c)) => compare::run(c),
        None => bench(*cmd.args),
    }
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if args.router.is_none() && !args.up {
        bail!("pass --router HOST:PORT (a running cluster) or --up (start a local one)");
    }
    if args.duration.is_some()
        && args.num_prompts.is_none()
        && args.request_rate == args::RequestRate::Infinite
        && args.max_concurrency.is_none()
    {
        bail!(
            "--duration with --request-rate inf would start requests without end: \
             give --max-concurrency, a --request-rate or --num-prompts"
        );
    }
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!("--temperature must be a number >= 0");
    }
    // Fail on an unwritable destination before the run, not after it.
    if let Some(path) = &args.json {
        std::fs::write(path, b"").with_context(|| format!("cannot write {}", path.display()))?;
    }
    let cluster = if args.up {
        Some(cluster::LocalCluster::start(&args)?)
    } else {
        None
    };
    let router = match &cluster {
        Some(c) => c.router.clone(),
        None => args.router.clone().unwrap_or_default(),
    };
    let metrics_addr = args
        .router_metrics
        .clone()
        .or_else(|| cluster.as_ref().and_then(|c| c.router_metrics.clone()));
    let http_tls = args.ca.client(pd_tls::Alpn::Http1)?;
    let metrics = metrics_addr
        .as_deref()
        .map(scrape::MetricsEndpoint::parse)
        .transpose()?
        .map(|m| m.with_tls(http_tls.clone()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(bench_async(&args, &router, metrics, cluster.as_ref()));
    drop(cluster);
    result
}

async fn connect(router: &str, tls: Option<&pd_tls::ClientTls>) -> anyhow::Result<Channel> {
    crate::tls::channel(router, tls).await
}

/// Name and limits of the served model.
async fn model_card(channel: &Channel, key: &ApiKey) -> anyhow::Result<pb::ModelCard> {
    let models = key
        .client(channel.clone())
        .list_models(pb::ListModelsRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("ListModels: {}: {}", s.code(), s.message()))?
        .into_inner();
    models
        .models
        .into_iter()
        .next()
        .context("the router serves no model")
}

fn pool(args: &BenchArgs, limits: &ModelLimits, count: usize) -> anyhow::Result<Vec<Session>> {
    let read = || -> anyhow::Result<String> {
        let path = args.dataset.as_ref().with_context(|| {
            format!(
                "--workload {} needs --dataset FILE",
                workload_name(args.workload)
            )
        })?;
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    let output = args.output_len;
    let sessions = match args.workload {
        WorkloadKind::Random => workload::random(
            args.seed,
            count,
            limits,
            args.prompt_format,
            args.input_len,
            output.unwrap_or(args::LenRange { min: 32, max: 32 }),
        ),
        WorkloadKind::PrefixRepetition => workload::prefix_repetition(
            args.seed,
            count,
            limits,
            args.prompt_format,
            workload::PrefixRepetition {
                num_prefixes: args.num_prefixes,
                prefix_len: args.prefix_len,
                suffix_len: args.suffix_len,
            },
            output.unwrap_or(args::LenRange { min: 32, max: 32 }),
        ),
        WorkloadKind::Sharegpt => dataset::sharegpt(&read()?, args.seed, false, output)?,
        WorkloadKind::Jsonl => dataset::jsonl(&read()?, args.seed, output)?,
        WorkloadKind::Conversation => {
            let text = match &args.dataset {
                Some(_) => read()?,
                None => dataset::BUILTIN_CONVERSATIONS.to_string(),
            };
            dataset::sharegpt(&text, args.seed, true, output)?
        }
    };
    Ok(sessions)
}

/// Each turn's `max_tokens`: fixed lengths as they are, reference replies measured with the
/// router's tokenizer. Token-id prompts that cannot fit the context are refused here.
async fn resolve_output(
    channel: &Channel,
    key: &ApiKey,
    sessions: &[Session],
    limits: &ModelLimits,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut client = key.client(channel.clone());
    let mut measured: HashMap<&str, u32> = HashMap::new();
    let mut all = Vec::with_capacity(sessions.len());
    for s in sessions {
        let mut lens = Vec::with_capacity(s.turns.len());
        for t in &s.turns {
            let n = match &t.output {
                OutputLen::Tokens(n) => *n,
                OutputLen::LikeReply(text) => match measured.get(text.as_str()) {
                    Some(n) => *n,
                    None => {
                        let ids = client
                            .tokenize(pb::TokenizeRequest {
                                model: String::new(),
                                text: text.clone(),
                            })
                            .await
                            .map_err(|s| {
                                anyhow::anyhow!("Tokenize: {}: {}", s.code(), s.message())
                            })?
                            .into_inner()
                            .ids;
                        let n = (ids.len() as u32).max(1);
                        measured.insert(text, n);
                        n
                    }
                },
            };
            if let Prompt::TokenIds(ids) = &t.prompt
                && ids.len() as u64 + u64::from(n) > u64::from(limits.max_model_len)
            {
                bail!(
                    "a prompt of {} tokens plus {n} output tokens exceeds the model's context of {} \
                     tokens: lower --input-len / --prefix-len / --output-len",
                    ids.len(),
                    limits.max_model_len
                );
            }
            lens.push(n);
        }
        all.push(lens);
    }
    Ok(all)
}

/// The workload's name as typed on the command line.
fn workload_name(kind: WorkloadKind) -> String {
    use clap::ValueEnum;
    kind.to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

fn shape_words(args: &BenchArgs) -> String {
    let out = args
        .output_len
        .map_or("from the file".to_string(), |o| o.to_string());
    match args.workload {
        WorkloadKind::Random => format!(
            "input {} output {} {}",
            args.input_len,
            args.output_len.map_or("32".into(), |o| o.to_string()),
            match args.prompt_format {
                PromptFormat::Tokens => "tokens",
                PromptFormat::Text => "text",
            }
        ),
        WorkloadKind::PrefixRepetition => format!(
            "{} prefixes x {} + suffix {}, output {}",
            args.num_prefixes,
            args.prefix_len,
            args.suffix_len,
            args.output_len.map_or("32".into(), |o| o.to_string())
        ),
        WorkloadKind::Sharegpt | WorkloadKind::Jsonl | WorkloadKind::Conversation => {
            format!("output {out}")
        }
    }
}

async fn bench_async(
    args: &BenchArgs,
    router: &str,
    metrics: Option<scrape::MetricsEndpoint>,
    cluster: Option<&cluster::LocalCluster>,
) -> anyhow::Result<()> {
    let channel = connect(router, args.ca.client(pd_tls::Alpn::Grpc)?.as_ref()).await?;
    let key = ApiKey::new(args.api_key.as_deref())?;
    let card = model_card(&channel, &key).await?;
    let limits = ModelLimits {
        vocab_size: card.vocab_size,
        max_model_len: card.max_model_len,
    };
    let warmup = usize::try_from(args.warmup).context("--warmup is too large")?;
    let measured = args
        .num_prompts
        .map(|n| usize::try_from(n).context("--num-prompts is too large"))
        .transpose()?;
    let sessions_in_window = match (measured, args.duration) {
        (Some(n), _) => Some(n),
        (None, Some(_)) => None,
        (None, None) => Some(DEFAULT_PROMPTS),
    };
    let sessions = pool(
        args,
        &limits,
        warmup + sessions_in_window.unwrap_or(DURATION_POOL),
    )?;
    let max_tokens = resolve_output(&channel, &key, &sessions, &limits).await?;
    if let Some(m) = &metrics {
        // A wrong metrics address is found now, not after the run.
        m.cache_counters().await?;
    }
    let plan = driver::Plan {
        sessions,
        max_tokens,
        temperature: args.temperature,
        ignore_eos: !args.respect_eos,
    };
    let shape = driver::LoadShape {
        rate: args.request_rate,
        max_concurrency: args
            .max_concurrency
            .map(|c| usize::try_from(c).unwrap_or(usize::MAX)),
        sessions: sessions_in_window,
        duration: args.duration.map(Duration::from_secs_f64),
        warmup,
        seed: args.seed,
    };
    let metrics_url = metrics.as_ref().map(|m| m.url().to_string());
    let target = match args.backend {
        args::Backend::Grpc => client::Target::Grpc(channel.clone(), key.clone()),
        args::Backend::Openai => client::Target::Openai(
            cluster
                .and_then(|c| c.openai.clone())
                .or_else(|| args.openai_url.clone())
                .context("--backend openai needs --openai-url http://HOST:PORT/v1 (or --up)")?,
            key.clone(),
            args.ca.client(pd_tls::Alpn::Http1)?,
        ),
    };
    let out = driver::run(
        target,
        plan,
        shape,
        metrics,
        Duration::from_secs_f64(args.scrape_interval),
        args.no_progress,
    )
    .await?;
    let config = report::RunConfig {
        router: router.to_string(),
        backend: args.backend.as_str().to_string(),
        model: card.name.clone(),
        workload: workload_name(args.workload),
        dataset: args.dataset.as_ref().map(|p| p.display().to_string()),
        seed: args.seed,
        shape: shape_words(args),
        request_rate: args.request_rate.to_string(),
        max_concurrency: args.max_concurrency,
        num_prompts: args.num_prompts,
        duration_s: args.duration,
        warmup: args.warmup,
        cluster: cluster.map(|c| c.description.clone()),
    };
    let report = report::build(
        &out,
        config,
        args.label.clone(),
        &args.goodput,
        metrics_url.as_deref(),
    );
    print!("{}", report::table(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).context("encoding the report")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plot {
        for file in plot::write_all(dir, &out, &report)? {
            eprintln!("wrote {}", file.display());
        }
    }
    Ok(())
}
