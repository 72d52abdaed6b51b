//! The chaos soak (`scripts/soak.sh [MINUTES]`): a secure cluster of two prefill and two
//! decode nodes under steady load from many clients (`load`), a random node SIGKILLed every
//! few seconds and restarted on its port, the router SIGKILLed and restarted once; at the
//! end it checks (`check`) that no client waited past its deadline, that every stream ended
//! with its tokens or a clear error, that no node holds a KV block or lease, that the
//! router's counters equal the nodes' own over all their processes, and that each process's
//! resident memory stayed flat over the second half of its life.
//!
//! Not here: the product. This drives the real binaries from outside, as an operator's
//! chaos tooling would.

mod check;
mod cluster;
mod load;
mod watch;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use pd_proto::pb::generation_client::GenerationClient;
use pd_tls::Alpn;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::Mutex;
use tokio::time::Instant;

use check::Verdict;
use cluster::{Cluster, Kind, LEASE_TIMEOUT_S, node_info};
use load::LoadState;
use watch::Log;

/// Most concurrent clients.
pub const CLIENTS_MAX: usize = 16;

/// How often the watcher samples counters and memory.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// The soak's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long the load and the kills go on.
    pub duration: Duration,
    /// Mean time between two kills.
    pub kill_every: Duration,
    /// Concurrent clients (1 to [`CLIENTS_MAX`]).
    pub clients: usize,
    /// Makes the requests and the kills reproducible (not their timing).
    pub seed: u64,
    /// Where the parts' logs go.
    pub logs: std::path::PathBuf,
}

/// Runs the soak; returns its verdicts (all must pass).
pub async fn run(settings: Settings) -> anyhow::Result<Vec<Verdict>> {
    anyhow::ensure!(
        (1..=CLIENTS_MAX).contains(&settings.clients),
        "clients must be 1 to {CLIENTS_MAX}"
    );
    let started = Instant::now();
    let cluster = Cluster::start(2, 2, settings.logs.clone())
        .await
        .context("starting the cluster")?;
    eprintln!(
        "soak: cluster up in {:.1?} (logs in {}): router {}, nodes {}",
        started.elapsed(),
        settings.logs.display(),
        cluster.router().addr,
        cluster
            .nodes()
            .map(|i| cluster.parts[i].addr.clone())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let grpc_tls = cluster.secrets.client_tls(Alpn::Grpc);
    let http_tls = cluster.secrets.client_tls(Alpn::Http1);
    let key = cluster.secrets.api_key.clone();
    let router_addr = cluster.router().addr.clone();
    let cluster = Arc::new(Mutex::new(cluster));
    let log = Arc::new(std::sync::Mutex::new(Log::default()));
    let state = Arc::new(LoadState {
        stop: Default::default(),
        router_down: Default::default(),
    });

    // The watcher: counters and memory of every part, until the load stops.
    let watcher = {
        let (cluster, log, state, tls) = (
            cluster.clone(),
            log.clone(),
            state.clone(),
            grpc_tls.clone(),
        );
        tokio::spawn(async move {
            while !state.stop.load(Ordering::Relaxed) {
                sample(&cluster, &log, &tls).await;
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
        })
    };

    // The clients: one channel each (a connection per client, as separate callers have).
    let mut clients = Vec::new();
    for n in 0..settings.clients {
        let channel = crate::tls::channel(&router_addr, Some(&grpc_tls)).await?;
        clients.push(tokio::spawn(load::client(
            n,
            settings.seed,
            GenerationClient::new(channel),
            key.clone(),
            state.clone(),
        )));
    }

    // Steady load from `pdctl bench` beside the clients: shared prefixes at a fixed rate.
    let bench = {
        let c = cluster.lock().await;
        bench(&c, &settings)?
    };

    // The chaos, in this task.
    let router_since = chaos(&settings, &cluster, &log, &state, &grpc_tls).await?;
    // Let the last restarted parts take traffic before the load stops.
    tokio::time::sleep(Duration::from_secs(5)).await;
    state.stop.store(true, Ordering::Relaxed);
    let mut records = Vec::new();
    let mut hung = 0;
    let limit = load::DEADLINE + load::GRACE + Duration::from_secs(10);
    for c in clients {
        match tokio::time::timeout(limit, c).await {
            Ok(r) => records.extend(r.context("a client task")?),
            Err(_) => hung += 1,
        }
    }
    let _ = watcher.await;
    let mut verdicts = check::requests(&records);
    verdicts.push(bench_verdict(bench, &settings.logs).await);
    verdicts.push(Verdict {
        name: "every client stopped".into(),
        ok: hung == 0,
        detail: format!(
            "{hung} of {} clients still waiting after {limit:?}",
            settings.clients
        ),
    });

    let cluster = cluster.lock().await;
    verdicts.extend(settle(&cluster, &grpc_tls).await);
    // A few router polls after the last count, then the final samples.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let router_metrics = cluster.router().metrics_addr().context("the router runs")?;
    let exposition =
        crate::Exposition::parse(&crate::tls::scrape(&router_metrics, &http_tls).await?)?;
    for i in cluster.nodes() {
        let part = &cluster.parts[i];
        match node_info(&part.addr, part.kind, &grpc_tls, Duration::from_secs(5)).await {
            Ok(info) => log.lock().expect("the log lock").info(i, &info),
            Err(e) => verdicts.push(Verdict {
                name: format!("{} answers at the end", part.name),
                ok: false,
                detail: format!("{e:#}"),
            }),
        }
        let router = crate::Counts::of_router(&exposition, part.kind.role(), &part.addr);
        let expected = check::expected(&log.lock().expect("the log lock"), i, router_since);
        verdicts.push(check::counters(&part.name, &router, &expected));
    }
    verdicts.push(check::memory(&log.lock().expect("the log lock")));
    Ok(verdicts)
}

/// `pdctl bench` against the router for the soak's duration, its report to `bench.txt`
/// in the logs directory.
fn bench(cluster: &Cluster, settings: &Settings) -> anyhow::Result<tokio::process::Child> {
    let report = std::fs::File::create(settings.logs.join("bench.txt"))?;
    let log = std::fs::File::create(settings.logs.join("bench.log"))?;
    let ca = cluster.secrets.tls.ca.display().to_string();
    let duration = format!("{:.1}", settings.duration.as_secs_f64().max(1.0));
    let seed = settings.seed.to_string();
    tokio::process::Command::new(crate::bin_dir().join("pdctl"))
        .args(["bench", "--router", &cluster.router().addr, "--ca", &ca])
        .args(["--workload", "prefix-repetition"])
        .args([
            "--num-prefixes",
            "4",
            "--prefix-len",
            "64",
            "--suffix-len",
            "16",
        ])
        .args([
            "--output-len",
            "8",
            "--request-rate",
            "2",
            "--max-concurrency",
            "2",
        ])
        .args(["--duration", &duration, "--seed", &seed])
        .env("PD_API_KEY", &cluster.secrets.api_key)
        .env("PD_CACHE_DIR", cluster.secrets.cache())
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(report)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting pdctl bench")
}

/// `pdctl bench` ran to its end, with how many of its requests succeeded.
async fn bench_verdict(mut bench: tokio::process::Child, logs: &std::path::Path) -> Verdict {
    let status = tokio::time::timeout(load::DEADLINE + Duration::from_secs(60), bench.wait()).await;
    let report = std::fs::read_to_string(logs.join("bench.txt")).unwrap_or_default();
    let figures: Vec<String> = report
        .lines()
        .filter(|l| l.starts_with("Successful requests") || l.starts_with("Failed requests"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let (ok, how) = match status {
        Ok(Ok(s)) if s.success() => (!figures.is_empty(), "ended".to_string()),
        Ok(Ok(s)) => (false, format!("exited with {s} (see bench.log)")),
        Ok(Err(e)) => (false, format!("could not be waited for: {e}")),
        Err(_) => (false, "still running past its duration".into()),
    };
    Verdict {
        name: "pdctl bench load ran to its end".into(),
        ok,
        detail: format!("{how}; {}", figures.join(", ")),
    }
}

/// One round of samples: every node's `Info`, every process's memory.
async fn sample(cluster: &Mutex<Cluster>, log: &std::sync::Mutex<Log>, tls: &pd_tls::ClientTls) {
    let parts: Vec<_> = {
        let c = cluster.lock().await;
        c.parts
            .iter()
            .map(|p| (p.kind, p.addr.clone(), p.pid(), p.name.clone()))
            .collect()
    };
    for (i, (kind, addr, pid, name)) in parts.into_iter().enumerate() {
        let Some(pid) = pid else { continue };
        log.lock().expect("the log lock").memory(pid, &name);
        if kind != Kind::Router
            && let Ok(info) = node_info(&addr, kind, tls, Duration::from_secs(1)).await
        {
            log.lock().expect("the log lock").info(i, &info);
        }
    }
}

/// Kills a random node every `kill_every` (± half) and restarts it, and the router once,
/// until the duration is over. Returns when the final router became ready.
async fn chaos(
    settings: &Settings,
    cluster: &Mutex<Cluster>,
    log: &std::sync::Mutex<Log>,
    state: &LoadState,
    tls: &pd_tls::ClientTls,
) -> anyhow::Result<Instant> {
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed ^ 0xc4a05);
    let start = Instant::now();
    let end = start + settings.duration;
    let router_kill_at = start + settings.duration.mul_f64(0.45);
    let mut router_since = start;
    let mut router_killed = false;
    let mut kills = 0;
    loop {
        let pause = settings.kill_every.mul_f64(rng.random_range(0.5..1.5));
        if Instant::now() + pause >= end {
            break;
        }
        tokio::time::sleep(pause).await;
        let mut c = cluster.lock().await;
        if !router_killed && Instant::now() >= router_kill_at {
            router_killed = true;
            state.router_down.store(true, Ordering::Relaxed);
            let router = c.parts.len() - 1;
            c.kill(router);
            eprintln!("soak: {:>6.1?} killed the router", start.elapsed());
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.restart(router).await.context("restarting the router")?;
            router_since = Instant::now();
            eprintln!("soak: {:>6.1?} router back", start.elapsed());
            drop(c);
            // Streams cut by the kill may end with a transport error a moment later.
            tokio::time::sleep(Duration::from_secs(2)).await;
            state.router_down.store(false, Ordering::Relaxed);
            continue;
        }
        let victim = rng.random_range(c.nodes());
        let part = &c.parts[victim];
        // Its counters right before the kill: the last any reader can see.
        let epoch = match node_info(&part.addr, part.kind, tls, Duration::from_secs(2)).await {
            Ok(info) => {
                let mut l = log.lock().expect("the log lock");
                l.info(victim, &info);
                info.counters.map(|r| r.epoch)
            }
            Err(_) => None,
        };
        c.kill(victim);
        kills += 1;
        if let Some(epoch) = epoch {
            log.lock().expect("the log lock").killed(victim, epoch);
        }
        eprintln!(
            "soak: {:>6.1?} killed {} (kill {kills})",
            start.elapsed(),
            c.parts[victim].name
        );
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
        c.restart(victim)
            .await
            .with_context(|| format!("restarting {}", c.parts[victim].name))?;
    }
    Ok(router_since)
}

/// Waits until no node runs a request or holds a KV block (a lease holds its blocks, so
/// free blocks also mean no lease outstanding); a lease whose router died is released by
/// its deadline.
async fn settle(cluster: &Cluster, tls: &pd_tls::ClientTls) -> Vec<Verdict> {
    let deadline = Instant::now() + Duration::from_secs(LEASE_TIMEOUT_S + 30);
    let mut verdicts = Vec::new();
    for i in cluster.nodes() {
        let part = &cluster.parts[i];
        let detail = loop {
            match node_info(&part.addr, part.kind, tls, Duration::from_secs(2)).await {
                Ok(info)
                    if info.free_blocks == info.num_blocks
                        && info.num_running == 0
                        && info.num_waiting == 0 =>
                {
                    break Ok(format!(
                        "{} of {} blocks free",
                        info.free_blocks, info.num_blocks
                    ));
                }
                Ok(info) if Instant::now() >= deadline => {
                    break Err(format!(
                        "{} of {} blocks free, {} running, {} waiting",
                        info.free_blocks, info.num_blocks, info.num_running, info.num_waiting
                    ));
                }
                Err(e) if Instant::now() >= deadline => break Err(format!("{e:#}")),
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        verdicts.push(Verdict {
            name: format!(
                "{}: every KV block free, no request or lease left",
                part.name
            ),
            ok: detail.is_ok(),
            detail: detail.unwrap_or_else(|e| e),
        });
    }
    verdicts
}
