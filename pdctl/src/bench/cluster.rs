//! `--up`: the benchmark starts its own local cluster by running `pdctl up` (the same code
//! and flags as a user's `pdctl up`) as a child process, reads its ready line for the
//! router's gRPC and metrics addresses, and stops it (SIGTERM, then wait) when done.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};
use serde_json::Value;

use super::args::BenchArgs;

/// A running `pdctl up`; dropping it stops the cluster.
#[derive(Debug)]
pub struct LocalCluster {
    child: Child,
    pub router: String,
    pub router_metrics: Option<String>,
    /// The OpenAI-compatible API's base URL.
    pub openai: Option<String>,
    /// `1P+1D prefix-aware` (for the report).
    pub description: String,
}

impl LocalCluster {
    pub fn start(args: &BenchArgs) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating pdctl")?;
        let mut cmd = Command::new(exe);
        cmd.arg("up")
            .args(["--model", &args.model])
            .args(["--prefill", &args.prefill.to_string()])
            .args(["--decode", &args.decode.to_string()])
            .args(&args.up_arg);
        if let Some(dir) = &args.bin_dir {
            cmd.arg("--bin-dir").arg(dir);
        }
        if !args.node_args.is_empty() {
            cmd.arg("--").args(&args.node_args);
        }
        // The router reads its policy from the environment (`PD_POLICY`); `pdctl up` passes
        // its environment on.
        // The cluster's own logs would drown the progress bar and the table: warnings only,
        // unless the user chose a level.
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        if let Some(p) = args.policy {
            cmd.env("PD_POLICY", p.as_str());
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .stdin(Stdio::null())
            .spawn()
            .context("starting `pdctl up`")?;
        let mut line = String::new();
        let read =
            BufReader::new(child.stdout.take().context("pdctl up's stdout")?).read_line(&mut line);
        if read.is_err() || line.trim().is_empty() {
            let status = child.wait().context("waiting for pdctl up")?;
            bail!(
                "`pdctl up` exited before the cluster was ready ({status}); see its errors above"
            );
        }
        let ready: Value = serde_json::from_str(&line)
            .with_context(|| format!("`pdctl up` printed {line:?}, not its ready line"))?;
        let router = ready["router"]
            .as_str()
            .with_context(|| format!("`pdctl up`'s ready line has no router: {ready}"))?
            .to_string();
        let description = format!(
            "{}P+{}D {}",
            args.prefill,
            args.decode,
            args.policy.map_or("router default policy", |p| p.as_str())
        );
        Ok(Self {
            child,
            router,
            router_metrics: ready["router_metrics"].as_str().map(str::to_string),
            openai: ready["openai"].as_str().map(str::to_string),
            description,
        })
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid (not yet reaped) with a valid signal.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}
