//! `pdctl bench`'s command line: where the cluster is (or how to start one), the workload, the
//! load shape and what to write. Values with a small grammar (`inf`, `64:256`, `ttft:500`)
//! have their own parsers here so a typo is refused before anything starts.

use std::path::PathBuf;
use std::str::FromStr;

use clap::{Args, ValueEnum};

/// Which requests the benchmark sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Random prompts of `--input-len` tokens asking for `--output-len` tokens.
    Random,
    /// `--num-prefixes` shared prefixes of `--prefix-len` tokens, each prompt one of them plus
    /// a random suffix of `--suffix-len` tokens: prefix-cache behaviour under control.
    PrefixRepetition,
    /// The first user turn of each conversation of a ShareGPT JSON file (`--dataset`).
    Sharegpt,
    /// One request a line (`--dataset`): `prompt`, `messages` or `token_ids`, optional
    /// `max_tokens`.
    Jsonl,
    /// Multi-turn: every user turn of each conversation, sent after the previous turn finished
    /// with the whole history (ShareGPT format; the built-in file unless `--dataset`).
    Conversation,
}

/// How random prompts are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// Token ids (exact lengths).
    Tokens,
    /// Raw text of random words (lengths approximate: about one token per word).
    Text,
}

/// Which of the router's APIs the requests go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// `pd.v1.Generation` over gRPC.
    Grpc,
    /// The OpenAI-compatible HTTP API: streamed `/v1/completions` and `/v1/chat/completions`.
    Openai,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Grpc => "grpc",
            Backend::Openai => "openai",
        }
    }
}

/// The router's prefill-node policy for `--up` (passed to it as `PD_POLICY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    RoundRobin,
    LeastLoaded,
    PrefixAware,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::PrefixAware => "prefix-aware",
        }
    }
}

/// Requests per second with Poisson arrivals, or all at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RequestRate {
    Infinite,
    PerSecond(f64),
}

impl FromStr for RequestRate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("inf") {
            return Ok(Self::Infinite);
        }
        match s.parse::<f64>() {
            Ok(r) if r > 0.0 && r.is_finite() => Ok(Self::PerSecond(r)),
            _ => Err(format!(
                "`{s}` is not a request rate (a positive number of requests per second, or inf)"
            )),
        }
    }
}

impl std::fmt::Display for RequestRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Infinite => f.write_str("inf"),
            Self::PerSecond(r) => write!(f, "{r}"),
        }
    }
}

/// A length, or an inclusive range drawn uniformly: `128` or `64:256`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LenRange {
    pub min: u32,
    pub max: u32,
}

impl FromStr for LenRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a length (N, or MIN:MAX with 1 <= MIN <= MAX)");
        let (min, max) = match s.split_once(':') {
            Some((a, b)) => (
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            ),
            None => {
                let n: u32 = s.trim().parse().map_err(|_| bad())?;
                (n, n)
            }
        };
        if min == 0 || min > max {
            return Err(bad());
        }
        Ok(Self { min, max })
    }
}

impl std::fmt::Display for LenRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}:{}", self.min, self.max)
        }
    }
}

/// One service-level objective of `--goodput`: a request is good when it meets all of them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Slo {
    /// Time to first token at most this many milliseconds.
    #[serde(rename = "ttft_ms")]
    Ttft(f64),
    /// Time per output token (after the first) at most this many milliseconds.
    #[serde(rename = "tpot_ms")]
    Tpot(f64),
    /// End-to-end latency at most this many milliseconds.
    #[serde(rename = "e2el_ms")]
    E2el(f64),
}

impl FromStr for Slo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a goodput objective (ttft:MS, tpot:MS or e2el:MS)");
        let (name, value) = s.split_once(':').ok_or_else(bad)?;
        let ms: f64 = value.trim().parse().map_err(|_| bad())?;
        if !(ms > 0.0 && ms.is_finite()) {
            return Err(bad());
        }
        match name.trim() {
            "ttft" => Ok(Self::Ttft(ms)),
            "tpot" => Ok(Self::Tpot(ms)),
            "e2el" => Ok(Self::E2el(ms)),
            _ => Err(bad()),
        }
    }
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.trim_end_matches('s').parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

/// `pdctl bench` (the run itself; `pdctl bench compare` has its own arguments).
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The router's gRPC address (HOST:PORT) of a running cluster.
    #[arg(
        long,
        env = "PD_ROUTER",
        conflicts_with = "up",
        help_heading = "Cluster"
    )]
    pub router: Option<String>,
    /// The router's API key (its `--api-keys`), sent as `authorization: Bearer KEY` over
    /// gRPC and HTTP alike.
    #[arg(
        long,
        env = "PD_API_KEY",
        hide_env_values = true,
        help_heading = "Cluster"
    )]
    pub api_key: Option<String>,
    /// The router's metrics endpoint (HOST:PORT or URL), for the prefix-cache hit rates over
    /// the benchmark's window. With --up it is found in `pdctl up`'s ready line.
    #[arg(long, help_heading = "Cluster")]
    pub router_metrics: Option<String>,
    /// `--ca FILE`: the router's gRPC, HTTP API and metrics over TLS.
    #[command(flatten, next_help_heading = "Cluster")]
    pub ca: crate::tls::CaArgs,
    /// Start a local cluster with `pdctl up` for the benchmark and stop it afterwards.
    #[arg(long, help_heading = "Cluster")]
    pub up: bool,
    /// Which API the requests go through: `grpc`, or `openai` (the router's OpenAI-compatible
    /// HTTP API, streamed; the model card still comes over gRPC).
    #[arg(long, value_enum, default_value = "grpc", help_heading = "Cluster")]
    pub backend: Backend,
    /// --backend openai against a running cluster: the API's base URL
    /// (`http://HOST:PORT/v1`, `openai` in `pdctl up`'s ready line). With --up it is found
    /// there.
    #[arg(long, conflicts_with = "up", help_heading = "Cluster")]
    pub openai_url: Option<String>,
    /// --up: model directory or `synthetic:NAME`.
    #[arg(
        long,
        env = "PD_MODEL",
        default_value = "synthetic:tiny",
        help_heading = "Cluster"
    )]
    pub model: String,
    /// --up: number of prefill nodes.
    #[arg(long, default_value_t = 1, help_heading = "Cluster")]
    pub prefill: u16,
    /// --up: number of decode nodes.
    #[arg(long, default_value_t = 1, help_heading = "Cluster")]
    pub decode: u16,
    /// --up: how the router picks prefill nodes (default: the router's own).
    #[arg(long, value_enum, help_heading = "Cluster")]
    pub policy: Option<Policy>,
    /// --up: one more argument for `pdctl up`, repeatable (e.g. `--up-arg=--port --up-arg=50051`).
    #[arg(long, allow_hyphen_values = true, help_heading = "Cluster")]
    pub up_arg: Vec<String>,
    /// --up: where the cluster's binaries are (default: beside pdctl).
    #[arg(long, env = "PD_BIN_DIR", help_heading = "Cluster")]
    pub bin_dir: Option<PathBuf>,
    /// --up: flags for every node after `--` (e.g. `-- --block-size 16`).
    #[arg(last = true, help_heading = "Cluster")]
    pub node_args: Vec<String>,

    /// Which requests to send.
    #[arg(long, value_enum, default_value = "random", help_heading = "Workload")]
    pub workload: WorkloadKind,
    /// The file of sharegpt / jsonl / conversation workloads.
    #[arg(long, help_heading = "Workload")]
    pub dataset: Option<PathBuf>,
    /// Makes every workload, and the arrival times, reproducible.
    #[arg(long, default_value_t = 0, help_heading = "Workload")]
    pub seed: u64,
    /// Prompt length in tokens (random): N or MIN:MAX.
    #[arg(long, default_value = "128", help_heading = "Workload")]
    pub input_len: LenRange,
    /// Tokens to generate per request: N or MIN:MAX (datasets: overrides the lengths taken
    /// from the file).
    #[arg(long, help_heading = "Workload")]
    pub output_len: Option<LenRange>,
    /// How random and prefix-repetition prompts are written.
    #[arg(long, value_enum, default_value = "tokens", help_heading = "Workload")]
    pub prompt_format: PromptFormat,
    /// prefix-repetition: number of distinct shared prefixes.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Workload")]
    pub num_prefixes: u32,
    /// prefix-repetition: length of each shared prefix in tokens.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Workload")]
    pub prefix_len: u32,
    /// prefix-repetition: length of each prompt's own suffix in tokens.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Workload")]
    pub suffix_len: u32,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0, help_heading = "Workload")]
    pub temperature: f32,
    /// Stop at the end-of-sequence token (default: generate exactly the asked lengths).
    #[arg(long, help_heading = "Workload")]
    pub respect_eos: bool,

    /// Requests (conversations for `conversation`) measured; default 100 unless --duration.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Load")]
    pub num_prompts: Option<u64>,
    /// Stop starting new requests after this many seconds (the workload repeats if needed).
    #[arg(long, value_parser = positive_seconds, help_heading = "Load")]
    pub duration: Option<f64>,
    /// Requests per second, Poisson arrivals; `inf` sends them all at once.
    #[arg(long, default_value = "inf", help_heading = "Load")]
    pub request_rate: RequestRate,
    /// At most this many requests (conversations) in flight.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Load")]
    pub max_concurrency: Option<u64>,
    /// Requests sent first and left out of every figure (they warm the caches).
    #[arg(long, default_value_t = 0, help_heading = "Load")]
    pub warmup: u64,

    /// Goodput objectives, e.g. `--goodput ttft:500 tpot:50` (milliseconds).
    #[arg(long, num_args = 1.., help_heading = "Report")]
    pub goodput: Vec<Slo>,
    /// Write the report as JSON to this file.
    #[arg(long, help_heading = "Report")]
    pub json: Option<PathBuf>,
    /// Write SVG charts (latency CDFs, throughput and hit rate over time) into this directory.
    #[arg(long, help_heading = "Report")]
    pub plot: Option<PathBuf>,
    /// A name for this run in the report (shown by `pdctl bench compare`).
    #[arg(long, help_heading = "Report")]
    pub label: Option<String>,
    /// How often the router's metrics are sampled for the hit rate over time, in seconds.
    #[arg(long, default_value = "1", value_parser = positive_seconds, help_heading = "Report")]
    pub scrape_interval: f64,
    /// No progress bar.
    #[arg(long, help_heading = "Report")]
    pub no_progress: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar() {
        assert_eq!("inf".parse::<RequestRate>(), Ok(RequestRate::Infinite));
        assert_eq!(
            "2.5".parse::<RequestRate>(),
            Ok(RequestRate::PerSecond(2.5))
        );
        assert!("0".parse::<RequestRate>().is_err());
        assert!("-1".parse::<RequestRate>().is_err());
        assert_eq!(
            "64:256".parse::<LenRange>(),
            Ok(LenRange { min: 64, max: 256 })
        );
        assert_eq!("7".parse::<LenRange>(), Ok(LenRange { min: 7, max: 7 }));
        assert!("0".parse::<LenRange>().is_err());
        assert!("9:3".parse::<LenRange>().is_err());
        assert_eq!("ttft:500".parse::<Slo>(), Ok(Slo::Ttft(500.0)));
        assert_eq!("tpot:12.5".parse::<Slo>(), Ok(Slo::Tpot(12.5)));
        assert!("itl:5".parse::<Slo>().is_err());
        assert!("ttft:-5".parse::<Slo>().is_err());
    }
}
