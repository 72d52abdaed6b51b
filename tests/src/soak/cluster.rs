//! The soak's cluster: two prefill nodes, two decode nodes and a router, each a real process
//! started on its own (a part can be killed and restarted on the same port while the others
//! run), with mTLS between the parts, TLS for clients and an API key (what `pdctl up
//! --secure` sets up).
//!
//! Not here: the load (`super::load`), what is sampled while it runs (`super::watch`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use pd_proto::pb;
use pd_tls::{Alpn, ClientTls};
use tokio::time::Instant;

use crate::Process;
use crate::tls::{TlsFiles, channel};

/// Every node serves this model.
pub const MODEL: &str = "synthetic:tiny";

/// KV blocks of every node (16 tokens each).
pub const KV_BLOCKS: u32 = 256;

/// A lease nobody releases (its router died) frees its blocks after this long.
pub const LEASE_TIMEOUT_S: u64 = 10;

/// What a part of the cluster is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Prefill,
    Decode,
    Router,
}

impl Kind {
    fn binary(self) -> &'static str {
        match self {
            Kind::Prefill => "prefill-node",
            Kind::Decode => "decode-node",
            Kind::Router => "router",
        }
    }

    /// The `role` label of the router's per-node series.
    pub fn role(self) -> &'static str {
        match self {
            Kind::Prefill => "prefill",
            Kind::Decode => "decode",
            Kind::Router => "router",
        }
    }
}

/// One part: where it listens (the same port across restarts) and its current process.
pub struct Part {
    pub kind: Kind,
    pub name: String,
    /// The gRPC address (`127.0.0.1:PORT`).
    pub addr: String,
    process: Option<Process>,
    /// When the current process became ready.
    pub started: Instant,
}

impl Part {
    /// The current process's pid, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Process::pid)
    }

    /// The current process's metrics address (HOST:PORT), if it runs.
    pub fn metrics_addr(&self) -> Option<String> {
        self.process.as_ref().map(|p| crate::metrics_addr(&p.ready))
    }
}

/// Certificates, the API keys file and the model cache, in one temporary directory.
pub struct Secrets {
    pub tls: TlsFiles,
    dir: tempfile::TempDir,
    pub api_key: String,
}

impl Secrets {
    pub fn create() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("a temporary directory")?;
        let api_key = format!("soak-{:032x}", rand::random::<u128>());
        std::fs::write(dir.path().join("api-keys"), format!("soak {api_key}\n"))
            .context("writing the API keys file")?;
        Ok(Self {
            tls: TlsFiles::generate(),
            dir,
            api_key,
        })
    }

    pub fn cache(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    fn keys_file(&self) -> PathBuf {
        self.dir.path().join("api-keys")
    }

    /// TLS for the router's clients and for reading every part's metrics and `Info`: trusts
    /// the cluster CA and presents the member certificate where asked.
    pub fn client_tls(&self, alpn: Alpn) -> ClientTls {
        self.tls.client_for(true, alpn)
    }
}

/// The parts, in a fixed order: prefill nodes, decode nodes, the router last.
pub struct Cluster {
    pub parts: Vec<Part>,
    pub secrets: Secrets,
    /// Where each part's log (stderr, all its processes) goes: `NAME.log`.
    pub logs: PathBuf,
}

impl Cluster {
    /// Starts `prefill` + `decode` nodes, then the router over them, and waits until the
    /// router serves.
    pub async fn start(prefill: usize, decode: usize, logs: PathBuf) -> anyhow::Result<Self> {
        let secrets = Secrets::create()?;
        // A fresh set of logs: the previous soak's go.
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let mut cluster = Self {
            parts: Vec::new(),
            secrets,
            logs,
        };
        let kinds = std::iter::repeat_n(Kind::Prefill, prefill)
            .chain(std::iter::repeat_n(Kind::Decode, decode))
            .chain([Kind::Router]);
        for (i, kind) in kinds.enumerate() {
            let process = cluster.spawn(kind, 0).await?;
            cluster.parts.push(Part {
                kind,
                name: format!("{}-{i}", kind.role()),
                addr: process.addr(),
                process: Some(process),
                started: Instant::now(),
            });
        }
        cluster.wait_router().await?;
        Ok(cluster)
    }

    fn flags(&self, kind: Kind, port: u16) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--model".into(),
            MODEL.into(),
            "--port".into(),
            port.to_string(),
        ];
        let p = |p: &Path| p.display().to_string();
        let tls = &self.secrets.tls;
        match kind {
            Kind::Prefill | Kind::Decode => {
                args.extend(tls.member_flags());
                // A pool small enough that the load has used every block (and the OS has
                // backed its pages) within the memory check's warm-up: growth after it is
                // then the process's own, not first touches of the KV memory.
                args.extend(["--num-gpu-blocks".into(), KV_BLOCKS.to_string()]);
                if kind == Kind::Prefill {
                    args.extend(["--kv-lease-timeout".into(), LEASE_TIMEOUT_S.to_string()]);
                }
            }
            Kind::Router => {
                // Clients bring an API key, not a certificate; the nodes are dialled with mTLS.
                args.extend(tls.identity_flags());
                args.extend([
                    "--api-keys".into(),
                    p(&self.secrets.keys_file()),
                    "--health-interval-ms".into(),
                    "200".into(),
                ]);
                for part in &self.parts {
                    let flag = match part.kind {
                        Kind::Prefill => "--prefill",
                        Kind::Decode => "--decode",
                        Kind::Router => continue,
                    };
                    args.extend([flag.into(), part.addr.clone()]);
                }
            }
        }
        args
    }

    async fn spawn(&self, kind: Kind, port: u16) -> anyhow::Result<Process> {
        let args = self.flags(kind, port);
        let cache = self.secrets.cache();
        // Every process of a part appends to one log: kills make their warnings expected.
        let name = match self
            .parts
            .iter()
            .find(|p| p.addr.ends_with(&format!(":{port}")))
        {
            Some(p) if port != 0 => p.name.clone(),
            _ => format!("{}-{}", kind.role(), self.parts.len()),
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("{name}.log")))
            .context("opening a part's log")?;
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Process::start_logging(kind.binary(), &cache, &args, log)
        })
        .await
        .context("starting a part")?
    }

    /// The router's part.
    pub fn router(&self) -> &Part {
        self.parts.last().expect("the router is the last part")
    }

    /// The indices of the nodes (every part but the router).
    pub fn nodes(&self) -> std::ops::Range<usize> {
        0..self.parts.len() - 1
    }

    /// SIGKILL part `i`, as a crash would.
    pub fn kill(&mut self, i: usize) {
        if let Some(process) = self.parts[i].process.take() {
            process.kill();
        }
    }

    /// Starts part `i` again on its port; for the router, waits until it serves.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let part = &self.parts[i];
        let port: u16 = part
            .addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .context("a part's address has a port")?;
        // The port may still be held for a moment by the killed process's socket.
        let mut tries = 0;
        let process = loop {
            match self.spawn(part.kind, port).await {
                Ok(p) => break p,
                Err(e) if tries < 20 => {
                    tries += 1;
                    eprintln!("soak: restarting {} failed ({e:#}); again", part.name);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e),
            }
        };
        let part = &mut self.parts[i];
        part.process = Some(process);
        part.started = Instant::now();
        if part.kind == Kind::Router {
            self.wait_router().await?;
        }
        Ok(())
    }

    async fn wait_router(&self) -> anyhow::Result<()> {
        let tls = self.secrets.client_tls(Alpn::Grpc);
        crate::tls::wait_serving(&self.router().addr, Some(&tls)).await
    }
}

/// A node's `Info` over mTLS, within `limit`.
pub async fn node_info(
    addr: &str,
    kind: Kind,
    tls: &ClientTls,
    limit: Duration,
) -> anyhow::Result<pb::NodeInfo> {
    tokio::time::timeout(limit, async {
        let ch = channel(addr, Some(tls)).await?;
        let info = match kind {
            Kind::Prefill => pb::prefill_service_client::PrefillServiceClient::new(ch)
                .info(pb::InfoRequest {})
                .await?
                .into_inner(),
            Kind::Decode => pb::decode_service_client::DecodeServiceClient::new(ch)
                .info(pb::InfoRequest {})
                .await?
                .into_inner(),
            Kind::Router => anyhow::bail!("the router has no node Info"),
        };
        Ok(info)
    })
    .await
    .with_context(|| format!("{addr} did not answer Info in {limit:?}"))?
}
