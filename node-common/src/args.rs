//! Flags both node binaries take (each also from a `PD_...` environment variable).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use pd_engine::cli::EngineArgs;

/// How KV moves between the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvTransport {
    /// A TCP export server on the prefill node; decode nodes pull from it.
    Tcp,
}

/// Log line format on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The flags of both node roles.
#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// Model directory (Hugging Face layout) or `synthetic:tiny|qwen3-0.6b|qwen3-8b`.
    #[arg(long, env = "PD_MODEL", default_value = "synthetic:tiny")]
    pub model: String,
    /// Address the gRPC server listens on.
    #[arg(long, env = "PD_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// gRPC port (0: an ephemeral port, printed in the ready line).
    #[arg(long, env = "PD_PORT", default_value_t = 0)]
    pub port: u16,
    /// Port of the Prometheus `/metrics` endpoint, on `--host` (0: an ephemeral port, printed
    /// in the ready line as `metrics_addr`).
    #[arg(long, env = "PD_METRICS_PORT", default_value_t = 0)]
    pub metrics_port: u16,
    /// How KV moves between prefill and decode nodes.
    #[arg(long, env = "PD_KV_TRANSPORT", value_enum, default_value_t = KvTransport::Tcp)]
    pub kv_transport: KvTransport,
    /// Seconds in-flight requests get to finish after SIGTERM / Ctrl-C before they are
    /// aborted.
    #[arg(long, env = "PD_DRAIN_TIMEOUT", value_name = "SECONDS", default_value = "30",
          value_parser = parse_seconds)]
    pub drain_timeout: Duration,
    /// Seed of requests that bring none (each request gets `seed ^ hash(request id)`).
    #[arg(long, env = "PD_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Log format on stderr (`RUST_LOG` sets the level; default info).
    #[arg(long, env = "PD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub engine: EngineArgs,

    /// Where `synthetic:` models are written (not a flag: `PD_CACHE_DIR` sets it for the
    /// binaries; in-process callers such as tests set it here).
    #[arg(skip)]
    pub synthetic_cache_dir: Option<PathBuf>,
}

/// A non-negative, finite number of seconds (fractions allowed).
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(v)
        .map_err(|_| format!("{s:?} must be a finite, non-negative number of seconds"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_accept_fractions_and_refuse_negative_or_nan() {
        assert_eq!(parse_seconds("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_seconds("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("NaN").is_err());
        assert!(parse_seconds("soon").is_err());
    }
}
