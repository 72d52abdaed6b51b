//! The `router` binary: parses flags, loads the model's metadata, binds, prints the ready
//! line `{"role":"router","grpc":"HOST:PORT","metrics_addr":"HOST:PORT","http":"HOST:PORT"}`
//! on stdout, serves until SIGTERM or Ctrl-C.

use std::io::Write as _;

use anyhow::Context as _;
use clap::Parser;
use pd_router::{Router, RouterArgs};

/// mimalloc, not the system allocator: a request allocates and frees many small buffers
/// (HTTP/2 frames, protobuf messages, tonic's bodies) on both of the router's connections, and
/// with it the router added ~20 us less latency at p50 to a 1-token request (six runs of the
/// router_overhead benchmark, both builds in the same rounds; docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Parser)]
#[command(
    name = "router",
    version,
    about = "The PD cluster's router: the client gRPC API in front of prefill and decode nodes."
)]
struct Cli {
    #[command(flatten)]
    router: RouterArgs,

    /// How logs (stderr) are written: `text` or `json` (one object per line). The same flag
    /// and variable as the nodes', so one `PD_LOG_FORMAT` configures a whole deployment.
    #[arg(
        long,
        env = "PD_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text,
        help_heading = "Logging"
    )]
    log_format: LogFormat,

    /// Parse and validate every flag and `PD_*` variable, print the effective configuration
    /// and exit (0, or non-zero with the problem) without serving.
    #[arg(long)]
    check_config: bool,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line a person can act on: the chain of causes joined with ": ".
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }

    let mut config = cli.router.to_config()?;
    config.tls = cli.router.tls.settings()?;
    // A router reachable from other hosts needs TLS or API keys (or --insecure).
    pd_tls::check_exposure(
        &cli.router.host,
        &config.tls,
        pd_tls::Exposure::Router {
            keys_configured: config.api_keys.is_some(),
        },
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.router.runtime_threads())
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    // Node channels start their connection tasks on the runtime.
    let entered = runtime.enter();
    if cli.check_config {
        for note in Router::check_config(&config).context("invalid configuration")? {
            eprintln!("note: {note}");
        }
        println!("{config:#?}");
        return Ok(());
    }
    let router = Router::new(config).context("cannot start the router")?;
    drop(entered);
    runtime.block_on(async move {
        let (host, port) = (cli.router.host.as_str(), cli.router.port);
        // A (host, port) pair: IPv6 hosts need no brackets.
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .with_context(|| format!("cannot listen on {host} port {port}"))?;
        let bound = listener.local_addr().context("listener address")?;
        let metrics_port = cli.router.metrics_port;
        let metrics_listener = tokio::net::TcpListener::bind((host, metrics_port))
            .await
            .with_context(|| format!("cannot listen on {host} port {metrics_port} (/metrics)"))?;
        let metrics_bound = metrics_listener
            .local_addr()
            .context("metrics listener address")?;
        let http_port = cli.router.http_port;
        let http_listener = tokio::net::TcpListener::bind((host, http_port))
            .await
            .with_context(|| format!("cannot listen on {host} port {http_port} (HTTP API)"))?;
        let http_bound = http_listener
            .local_addr()
            .context("HTTP listener address")?;
        let shutdown = shutdown_signal().context("installing the SIGTERM / Ctrl-C handlers")?;
        let ready = serde_json::json!({
            "role": "router",
            "grpc": bound.to_string(),
            "metrics_addr": metrics_bound.to_string(),
            "http": http_bound.to_string(),
        });
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{ready}").context("writing the ready line")?;
        stdout.flush().context("writing the ready line")?;
        drop(stdout);
        router
            .serve_with_http(
                listener,
                Some(metrics_listener),
                Some(http_listener),
                shutdown,
            )
            .await
            .context("router failed")
    })
}

/// SIGTERM or Ctrl-C: drain and exit; a second signal exits at once. The handlers are
/// installed when this is called (inside the runtime, before the ready line), so a signal
/// that arrives before the returned future is first polled is not lost: with the handler
/// installed on first poll, a SIGTERM right after readiness killed the router undrained.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut signals = Signals::install()?;
    Ok(async move {
        signals.next().await;
        tokio::spawn(async move {
            signals.next().await;
            tracing::warn!("second signal: exiting without draining");
            std::process::exit(130);
        });
    })
}

/// The signals that stop the router, watched from the moment they are installed.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next SIGTERM or Ctrl-C.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
