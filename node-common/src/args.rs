//! Flags both node binaries take (each also from a `PD_...` environment variable).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use pd_engine::cli::EngineArgs;

/// How KV moves between the nodes. The prefill node runs its TCP export server in every
/// mode, so TCP is always there to fall back on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvTransport {
    /// A TCP export server on the prefill node; decode nodes pull from it.
    Tcp,
    /// One-sided RDMA READs (a build with `--features rdma` and an RDMA device are required:
    /// the node does not start otherwise); a failed read is retried once over TCP.
    Rdma,
    /// RDMA where this node has a usable device and the other end offers a common fabric,
    /// TCP otherwise.
    Auto,
}

impl KvTransport {
    /// The transport crate's view of it.
    pub fn mode(self) -> pd_transport::rdma::KvTransportMode {
        use pd_transport::rdma::KvTransportMode;
        match self {
            Self::Tcp => KvTransportMode::Tcp,
            Self::Rdma => KvTransportMode::Rdma,
            Self::Auto => KvTransportMode::Auto,
        }
    }
}

/// Which RDMA device, port and GID a node uses (with `--kv-transport rdma|auto`).
#[derive(Debug, Clone, Default, Args)]
pub struct RdmaArgs {
    /// RDMA device name (`ibv_devices` lists them, e.g. `mlx5_0`, `rxe0`). Default: the first
    /// device with an active port.
    #[arg(long, env = "PD_RDMA_DEVICE", help_heading = "KV transfer")]
    pub rdma_device: Option<String>,
    /// HCA port number (from 1). Default: the device's first active port.
    #[arg(long, env = "PD_RDMA_PORT", help_heading = "KV transfer",
          value_parser = clap::value_parser!(u8).range(1..))]
    pub rdma_port: Option<u8>,
    /// GID table index (`show_gids` lists them). Default: 0 on InfiniBand; on RoCE the first
    /// RoCE v2 GID of an IPv4 address.
    #[arg(long, env = "PD_RDMA_GID_INDEX", help_heading = "KV transfer")]
    pub rdma_gid_index: Option<u32>,
}

impl RdmaArgs {
    pub fn config(&self) -> pd_transport::rdma::RdmaConfig {
        pd_transport::rdma::RdmaConfig {
            device: self.rdma_device.clone(),
            port: self.rdma_port,
            gid_index: self.rdma_gid_index,
            ..Default::default()
        }
    }
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
    /// Model directory (Hugging Face layout) or `synthetic:tiny|tiny-moe|qwen3-0.6b|qwen3-8b|qwen3-30b-a3b`.
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
    /// The IP address other processes dial to reach this node's KV (in the KV handles a
    /// prefill node hands out). Needed when `--host` is a wildcard such as 0.0.0.0: on
    /// Kubernetes, the pod IP (`status.podIP`). Default: the bound address.
    #[arg(long, env = "PD_ADVERTISE_HOST")]
    pub advertise_host: Option<std::net::IpAddr>,
    /// Parse and validate every flag and `PD_*` variable, print the effective configuration
    /// and exit (0, or non-zero with the problem) without loading a model.
    #[arg(long)]
    pub check_config: bool,
    /// How KV moves between prefill and decode nodes: `tcp`, `rdma` (required: the node does
    /// not start without RDMA) or `auto` (RDMA where both ends can, TCP otherwise).
    #[arg(long, env = "PD_KV_TRANSPORT", value_enum, default_value_t = KvTransport::Auto)]
    pub kv_transport: KvTransport,
    #[command(flatten)]
    pub rdma: RdmaArgs,
    /// Seconds in-flight requests get to finish after SIGTERM / Ctrl-C before they are
    /// aborted.
    #[arg(long, env = "PD_DRAIN_TIMEOUT", value_name = "SECONDS", default_value = "30",
          value_parser = parse_seconds)]
    pub drain_timeout: Duration,
    /// Requests that may wait on this node beyond the --max-num-seqs it runs at once
    /// (counting those still receiving their KV); one more is refused with
    /// RESOURCE_EXHAUSTED, which the router answers by trying another node.
    #[arg(long, env = "PD_MAX_WAITING", default_value_t = 256)]
    pub max_waiting: usize,
    /// Seed of requests that bring none (each request gets `seed ^ hash(request id)`).
    #[arg(long, env = "PD_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Log format on stderr (`RUST_LOG` sets the level; default info).
    #[arg(long, env = "PD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub engine: EngineArgs,

    #[command(flatten)]
    pub tls: pd_tls::TlsArgs,

    /// Where `synthetic:` models are written (not a flag: `PD_CACHE_DIR` sets it for the
    /// binaries; in-process callers such as tests set it here).
    #[arg(skip)]
    pub synthetic_cache_dir: Option<PathBuf>,
}

impl NodeArgs {
    /// The most requests this node holds open at once: --max-num-seqs running plus
    /// --max-waiting waiting.
    pub fn max_open_requests(&self) -> usize {
        self.engine.max_num_seqs.saturating_add(self.max_waiting)
    }
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
