//! `pdctl up`: a whole local cluster in one command — N prefill nodes, M decode nodes and a
//! router on 127.0.0.1, each a real process started from the binaries beside `pdctl`. Prints
//! one JSON line once every part is healthy and stops everything on Ctrl-C or SIGTERM:
//!
//! ```text
//! {"router": "127.0.0.1:P", "router_metrics": "http://127.0.0.1:P/metrics",
//!  "openai": "http://127.0.0.1:P/v1",
//!  "prefill": [{"addr": "127.0.0.1:P", "kv": "127.0.0.1:P", "metrics": "http://127.0.0.1:P/metrics"}],
//!  "decode": [{"addr": "...", "kv": null, "metrics": "http://..."}],
//!  "prefill_metrics": ["127.0.0.1:P"], "decode_metrics": ["127.0.0.1:P"]}
//! ```
//!
//! Every process serves Prometheus `/metrics` on an ephemeral port (`--metrics-port 0`,
//! unless the node flags after `--` set one): `router_metrics` and each node's `metrics` are
//! the URLs to scrape (`curl` them as they are); `prefill_metrics` / `decode_metrics` list
//! the nodes' HOST:PORT, the form Prometheus targets take. `openai` is the base URL of the
//! router's OpenAI-compatible API (what OpenAI clients take as `base_url`).
//!
//! With `--secure` every port speaks TLS (the URLs are `https://`), the parts authenticate each
//! other with certificates of a fresh cluster CA (mTLS), and the router wants an API key; the
//! ready line adds what a client needs: `"ca"` (the CA file to trust, `--ca`), `"api_key"`
//! (`--api-key`, `Authorization: Bearer`) and `"tenant"` (whose key it is). The files live in
//! a private temporary directory (`"secure_dir"`) removed when the cluster stops.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long a node may take to load its model and print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(900);

/// Passed to every node as `--kv-transport` (docs/transport.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvTransport {
    Tcp,
    /// Every node must open an RDMA device (binaries built with `--features rdma`).
    Rdma,
    /// RDMA where the nodes can, TCP otherwise.
    Auto,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Model directory or `synthetic:NAME`, served by every node.
    #[arg(long, env = "PD_MODEL", default_value = "synthetic:tiny")]
    model: String,
    /// Number of prefill nodes (0: aggregated mode, decode nodes serve whole requests).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=64))]
    prefill: u16,
    /// Number of decode nodes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    decode: u16,
    /// The router's gRPC port (0: ephemeral).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// The router's Prometheus `/metrics` port (0: ephemeral). The nodes' are ephemeral
    /// unless the node flags after `--` set one.
    #[arg(long, default_value_t = 0)]
    metrics_port: u16,
    /// The router's OpenAI-compatible HTTP port (0: ephemeral).
    #[arg(long, default_value_t = 0)]
    http_port: u16,
    /// How KV moves from prefill to decode nodes (`auto`: RDMA where the nodes have a
    /// device and were built with it, TCP otherwise).
    #[arg(long, value_enum, default_value = "auto")]
    kv_transport: KvTransport,
    /// TLS on every port, mTLS between the parts and an API key for clients, from a fresh
    /// cluster CA and key (the ready line prints `ca`, `api_key` and `tenant`).
    #[arg(long)]
    secure: bool,
    /// Where the `router`, `prefill-node` and `decode-node` binaries are (default: beside pdctl).
    #[arg(long, env = "PD_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Flags passed to every node after `--` (e.g. `-- --block-size 32 --max-num-seqs 64`).
    #[arg(last = true)]
    node_args: Vec<String>,
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    // Write a synthetic model once here rather than in every node at the same time.
    crate::load::open(&args.model)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(up(args))
}

fn bin_dir(args: &UpArgs) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &args.bin_dir {
        return Ok(dir.clone());
    }
    let exe = std::env::current_exe().context("locating pdctl")?;
    Ok(exe
        .parent()
        .context("pdctl has no directory")?
        .to_path_buf())
}

/// A started process and the JSON line it printed when ready.
struct Part {
    name: String,
    child: Child,
    ready: Value,
}

async fn start(name: String, bin: PathBuf, args: Vec<String>) -> anyhow::Result<Part> {
    if !bin.exists() {
        bail!(
            "{} not found (build it with `cargo build --release --workspace`, or pass --bin-dir)",
            bin.display()
        );
    }
    let mut child = Command::new(&bin)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(READY_TIMEOUT, lines.next_line())
        .await
        .with_context(|| format!("{name} did not become ready in {READY_TIMEOUT:?}"))?
        .with_context(|| format!("reading {name}'s output"))?
        .with_context(|| format!("{name} exited before it was ready"))?;
    let ready: Value = serde_json::from_str(&line)
        .with_context(|| format!("{name} printed {line:?}, not its ready line"))?;
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Part { name, child, ready })
}

fn field(part: &Part, key: &str) -> anyhow::Result<String> {
    part.ready[key]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("{}'s ready line has no {key:?}: {}", part.name, part.ready))
}

async fn up(args: UpArgs) -> anyhow::Result<()> {
    let dir = bin_dir(&args)?;
    let secure = args
        .secure
        .then(crate::up_secure::Secure::create)
        .transpose()?;
    let client_tls = secure.as_ref().map(|s| s.client_tls()).transpose()?;
    let transport = match args.kv_transport {
        KvTransport::Tcp => "tcp",
        KvTransport::Rdma => "rdma",
        KvTransport::Auto => "auto",
    };
    let mut node_args = vec![
        "--model".to_string(),
        args.model.clone(),
        "--kv-transport".into(),
        transport.into(),
    ];
    if !args
        .node_args
        .iter()
        .any(|a| a == "--metrics-port" || a.starts_with("--metrics-port="))
    {
        node_args.extend(["--metrics-port".into(), "0".into()]);
    }
    if let Some(secure) = &secure {
        node_args.extend(secure.node_flags());
    }
    node_args.extend(args.node_args.iter().cloned());

    let mut starting = Vec::new();
    for i in 0..args.prefill {
        starting.push(start(
            format!("prefill-{i}"),
            dir.join("prefill-node"),
            node_args.clone(),
        ));
    }
    for i in 0..args.decode {
        starting.push(start(
            format!("decode-{i}"),
            dir.join("decode-node"),
            node_args.clone(),
        ));
    }
    let mut parts = Vec::new();
    let mut failure = None;
    for result in futures_join(starting).await {
        match result {
            Ok(p) => parts.push(p),
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        stop(&mut parts).await;
        return Err(e);
    }
    let mut router_args = vec![
        "--model".to_string(),
        args.model.clone(),
        "--port".into(),
        args.port.to_string(),
        "--metrics-port".into(),
        args.metrics_port.to_string(),
        "--http-port".into(),
        args.http_port.to_string(),
    ];
    if let Some(secure) = &secure {
        router_args.extend(secure.router_flags());
    }
    let scheme = if secure.is_some() { "https" } else { "http" };
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut prefill_metrics = Vec::new();
    let mut decode_metrics = Vec::new();
    for p in &parts {
        let addr = field(p, "grpc")?;
        let flag = if p.name.starts_with("prefill") {
            "--prefill"
        } else {
            "--decode"
        };
        router_args.push(flag.into());
        router_args.push(addr.clone());
        let metrics = field(p, "metrics_addr")?;
        let entry = json!({"addr": addr, "kv": p.ready.get("kv"), "metrics": metrics_url(scheme, &metrics)});
        if p.name.starts_with("prefill") {
            prefill.push(entry);
            prefill_metrics.push(metrics);
        } else {
            decode.push(entry);
            decode_metrics.push(metrics);
        }
    }
    let router = match start("router".into(), dir.join("router"), router_args).await {
        Ok(r) => r,
        Err(e) => {
            stop(&mut parts).await;
            return Err(e);
        }
    };
    let router_addr = field(&router, "grpc")?;
    let router_metrics = field(&router, "metrics_addr")?;
    let router_http = field(&router, "http")?;
    parts.push(router);
    if let Err(e) = wait_serving(&router_addr, client_tls.as_ref()).await {
        stop(&mut parts).await;
        return Err(e);
    }
    let mut ready = json!({
        "router": router_addr,
        "router_metrics": metrics_url(scheme, &router_metrics),
        "openai": format!("{scheme}://{router_http}/v1"),
        "prefill": prefill,
        "decode": decode,
        "prefill_metrics": prefill_metrics,
        "decode_metrics": decode_metrics,
    });
    if let Some(secure) = &secure {
        ready["ca"] = json!(secure.ca());
        ready["api_key"] = json!(secure.api_key);
        ready["tenant"] = json!(crate::up_secure::TENANT);
        ready["secure_dir"] = json!(secure.dir());
    }
    println!("{ready}");

    // Run until told to stop, or until a part dies.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let died = async {
        loop {
            for p in parts.iter_mut() {
                if let Ok(Some(status)) = p.child.try_wait() {
                    return (p.name.clone(), status);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let outcome = tokio::select! {
        _ = tokio::signal::ctrl_c() => None,
        _ = term.recv() => None,
        (name, status) = died => Some((name, status)),
    };
    stop(&mut parts).await;
    if let Some((name, status)) = outcome {
        bail!("{name} exited unexpectedly ({status}); the cluster was stopped");
    }
    Ok(())
}

/// Join futures concurrently, keeping their order.
async fn futures_join<F, T>(futures: Vec<F>) -> Vec<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("a start task panicked"));
    }
    out
}

/// Poll the router's gRPC health check until it reports SERVING, over TLS when `tls` is given
/// (a router started with `--tls-cert`).
async fn wait_serving(addr: &str, tls: Option<&pd_tls::ClientTls>) -> anyhow::Result<()> {
    let Some(tls) = tls else {
        return pd_proto::health::wait_serving(
            addr,
            Duration::from_secs(60),
            Duration::from_millis(100),
        )
        .await
        .context("the router");
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(channel) = crate::tls::channel(addr, Some(tls)).await
            && pd_proto::health::is_serving(channel).await
        {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("the router at {addr} did not report SERVING within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SIGTERM every part (router first, so no new work reaches the nodes), then wait; SIGKILL
/// whatever has not exited after its drain.
async fn stop(parts: &mut [Part]) {
    for p in parts.iter_mut().rev() {
        if let Some(pid) = p.child.id() {
            // SAFETY: kill(2) with a pid of a child we own (not yet reaped) and a valid signal.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    for p in parts.iter_mut().rev() {
        if tokio::time::timeout(Duration::from_secs(40), p.child.wait())
            .await
            .is_err()
        {
            let _ = p.child.kill().await;
        }
    }
}

/// The URL of the `/metrics` page served at `addr` (HOST:PORT).
fn metrics_url(scheme: &str, addr: &str) -> String {
    format!("{scheme}://{addr}/metrics")
}
