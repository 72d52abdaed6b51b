//! `soak`: the chaos soak of a local secure cluster (see `pd_tests::soak`); run it with
//! `scripts/soak.sh [MINUTES]`. Prints one line per check and exits non-zero if any fails.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "soak", about = "Chaos soak of a local secure PD cluster")]
struct Args {
    /// How long the load and the kills go on, in minutes.
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// Mean seconds between two kills of a node.
    #[arg(long, default_value_t = 5.0)]
    kill_every: f64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// Seed of the requests and of which part is killed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where each part's log goes (default: target/soak-logs).
    #[arg(long, default_value = "target/soak-logs")]
    logs: std::path::PathBuf,
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let duration = Duration::try_from_secs_f64(args.minutes * 60.0)
        .map_err(|_| anyhow::anyhow!("--minutes must be a non-negative number"))?;
    let kill_every = Duration::try_from_secs_f64(args.kill_every)
        .ok()
        .filter(|d| *d >= Duration::from_secs(2))
        .ok_or_else(|| anyhow::anyhow!("--kill-every must be at least 2 seconds"))?;
    let settings = pd_tests::soak::Settings {
        duration,
        kill_every,
        clients: args.clients,
        seed: args.seed,
        logs: args.logs,
    };
    let rt = tokio::runtime::Runtime::new()?;
    let verdicts = rt.block_on(pd_tests::soak::run(settings))?;
    let mut ok = true;
    println!(
        "soak: {:.1} minutes, {} clients",
        args.minutes, args.clients
    );
    for v in &verdicts {
        ok &= v.ok;
        println!(
            "{} {}: {}",
            if v.ok { "PASS" } else { "FAIL" },
            v.name,
            v.detail
        );
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
