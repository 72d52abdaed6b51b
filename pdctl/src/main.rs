//! pdctl: the user's tool. Thin: argument parsing, terminal output and progress; everything
//! it runs lives in `pd-engine`.
//!
//! - `pdctl run`: one model in one process, no cluster.
//! - `pdctl certs`: a cluster CA and member certificate for mTLS.
//! - `pdctl tokenize`: token ids of raw text.
//! - `pdctl metrics`: a live summary of a cluster from its router's `/metrics`.
//! - `pdctl bench-model`: prefill / decode speed beside the machine's memory bandwidth.
//! - `pdctl bench`: the serving benchmark against a cluster (`pdctl bench compare` for two
//!   reports).

mod auth;
mod bench;
mod bench_model;
mod certs;
mod generate;
mod load;
mod metrics;
mod run;
mod tls;
mod tokenize;
mod tools;
mod up;
mod up_secure;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pdctl",
    version,
    about = "Run, inspect and benchmark the Qwen3 PD cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate with one model in this process (no cluster).
    Run(Box<run::RunArgs>),
    /// Print the token ids of raw text (no template, no special tokens added).
    Tokenize(tokenize::TokenizeArgs),
    /// Start a local cluster: prefill nodes, decode nodes and a router on 127.0.0.1.
    Up(up::UpArgs),
    /// Send one request to a running cluster's router.
    Generate(Box<generate::GenerateArgs>),
    /// Live summary of a cluster from its router's /metrics: hit rates, throughput, latency.
    Metrics(metrics::MetricsArgs),
    /// Measure prefill and decode speed against the machine's memory-read bandwidth, on the
    /// CPU kernels `PD_CPU_ISA` selects (avx512, avx2, portable; unset: the best the host has).
    BenchModel(bench_model::BenchModelArgs),
    /// Write a cluster CA and a member certificate (ca.crt, ca.key, node.crt, node.key) for
    /// TLS and mTLS between the parts.
    Certs(certs::CertsArgs),
    /// Benchmark a running cluster (or one started with --up): throughput, latencies,
    /// goodput and the router's prefix-cache hit rates; `bench compare A.json B.json`.
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(*args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Up(args) => up::run(args),
        Command::Generate(args) => generate::run(*args),
        Command::Metrics(args) => metrics::run(args),
        Command::BenchModel(args) => bench_model::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Certs(args) => certs::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line a person can act on; the chain of causes joined with ": ".
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
