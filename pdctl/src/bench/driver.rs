//! The load generator: warm-up sessions first (left out of every figure), then the measured
//! window — sessions started at Poisson arrival times (or all at once), at most
//! `--max-concurrency` in flight, until `--num-prompts` were started or `--duration` ran out.
//! The router's prefix-cache counters are read right before the window opens, sampled during
//! it, and read again once it closed and they stopped moving.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{Semaphore, mpsc};

use super::args::RequestRate;
use super::client::{RequestRecord, Target, run_session};
use super::scrape::{CacheCounters, MetricsEndpoint, ScrapeError};
use super::workload::Session;

/// How long the counters may keep moving after the last request before the final read
/// gives up waiting for them to settle.
const SETTLE_LIMIT: Duration = Duration::from_secs(5);
const SETTLE_POLL: Duration = Duration::from_millis(250);

#[derive(Debug, Clone)]
pub struct LoadShape {
    pub rate: RequestRate,
    pub max_concurrency: Option<usize>,
    /// Sessions started in the window (None: until `duration`).
    pub sessions: Option<usize>,
    pub duration: Option<Duration>,
    pub warmup: usize,
    pub seed: u64,
}

/// The requests to send: a pool of sessions (cycled when the run needs more) and each
/// turn's resolved `max_tokens`.
#[derive(Debug)]
pub struct Plan {
    pub sessions: Vec<Session>,
    pub max_tokens: Vec<Vec<u32>>,
    pub temperature: f32,
    pub ignore_eos: bool,
}

/// The router's counters at one moment of the window.
#[derive(Debug, Clone)]
pub struct CounterSample {
    pub at: Duration,
    pub counters: CacheCounters,
}

#[derive(Debug)]
pub struct RunOutput {
    pub started_at: SystemTime,
    /// From the window's opening to the last request's end.
    pub duration: Duration,
    pub records: Vec<RequestRecord>,
    pub warmup_failures: usize,
    /// Counters right before the window and after it (when the router's metrics are known).
    pub counters: Option<(CacheCounters, CacheCounters)>,
    pub samples: Vec<CounterSample>,
}

/// Seconds between Poisson arrivals at `rate` per second.
fn next_gap(rng: &mut ChaCha8Rng, rate: RequestRate) -> Duration {
    match rate {
        RequestRate::Infinite => Duration::ZERO,
        RequestRate::PerSecond(r) => {
            let u: f64 = rng.random();
            Duration::from_secs_f64(-(1.0 - u).ln() / r)
        }
    }
}

fn progress(hidden: bool, total: Option<u64>) -> ProgressBar {
    let bar = match total {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} requests ({per_sec})",
            )
            .expect("a valid template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {pos} requests ({per_sec})",
            )
            .expect("a valid template"),
        ),
    };
    if hidden {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Run sessions `indices` of the plan, starting each when `arrivals` says, and return their
/// records. Shared by the warm-up and the measured window.
#[allow(clippy::too_many_arguments)]
async fn run_sessions(
    target: &Target,
    plan: &Arc<Plan>,
    shape: &LoadShape,
    first: usize,
    count: Option<usize>,
    deadline: Option<Instant>,
    window_start: Instant,
    bar: &ProgressBar,
) -> Vec<RequestRecord> {
    let permits = shape
        .max_concurrency
        .unwrap_or(Semaphore::MAX_PERMITS)
        .min(Semaphore::MAX_PERMITS);
    let semaphore = Arc::new(Semaphore::new(permits));
    let (tx, mut rx) = mpsc::unbounded_channel::<RequestRecord>();
    let mut rng = ChaCha8Rng::seed_from_u64(shape.seed ^ 0x5eed_a771_4a1e);
    let mut next_at = window_start;
    let mut tasks = tokio::task::JoinSet::new();
    let mut started = 0usize;
    let mut records = Vec::new();
    loop {
        if count.is_some_and(|c| started >= c) {
            break;
        }
        next_at += next_gap(&mut rng, shape.rate);
        if deadline.is_some_and(|d| next_at >= d) {
            break;
        }
        tokio::time::sleep_until(next_at.into()).await;
        let permit = semaphore
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let index = (first + started) % plan.sessions.len();
        let plan = plan.clone();
        let client = target.client();
        let tx = tx.clone();
        let bar = bar.clone();
        let session_no = started;
        tasks.spawn(async move {
            let _permit = permit;
            run_session(
                client,
                &plan.sessions[index],
                &plan.max_tokens[index],
                plan.temperature,
                plan.ignore_eos,
                window_start,
                session_no,
                |r| {
                    bar.inc(1);
                    let _ = tx.send(r);
                },
            )
            .await;
        });
        started += 1;
    }
    drop(tx);
    while let Some(r) = rx.recv().await {
        records.push(r);
    }
    while tasks.join_next().await.is_some() {}
    records
}

/// Read the counters until two reads agree (the last reports reach the router right after
/// the last request), at most [`SETTLE_LIMIT`].
async fn settled(endpoint: &MetricsEndpoint) -> Result<CacheCounters, ScrapeError> {
    let limit = Instant::now() + SETTLE_LIMIT;
    let mut last = endpoint.cache_counters().await?;
    loop {
        tokio::time::sleep(SETTLE_POLL).await;
        let now = endpoint.cache_counters().await?;
        if now == last || Instant::now() >= limit {
            return Ok(now);
        }
        last = now;
    }
}

/// Warm up, then run the measured window.
pub async fn run(
    target: Target,
    plan: Plan,
    shape: LoadShape,
    metrics: Option<MetricsEndpoint>,
    sample_every: Duration,
    hide_progress: bool,
) -> Result<RunOutput, ScrapeError> {
    let plan = Arc::new(plan);
    let mut warmup_failures = 0;
    if shape.warmup > 0 {
        let bar = progress(hide_progress, None);
        bar.set_message("warm-up");
        let warm = run_sessions(
            &target,
            &plan,
            &LoadShape {
                rate: RequestRate::Infinite,
                ..shape.clone()
            },
            0,
            Some(shape.warmup),
            None,
            Instant::now(),
            &bar,
        )
        .await;
        bar.finish_and_clear();
        warmup_failures = warm.iter().filter(|r| !r.outcome.is_success()).count();
    }

    let before = match &metrics {
        Some(m) => Some(settled(m).await?),
        None => None,
    };
    let total = shape.sessions.map(|n| {
        (0..n)
            .map(|i| {
                plan.sessions[(shape.warmup + i) % plan.sessions.len()]
                    .turns
                    .len() as u64
            })
            .sum()
    });
    let bar = progress(
        hide_progress,
        if shape.duration.is_some() {
            None
        } else {
            total
        },
    );
    let started_at = SystemTime::now();
    let window_start = Instant::now();

    // Sample the counters through the window for the hit rate over time.
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sampler = metrics.clone().map(|m| {
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(sample_every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        // A missed sample only thins the chart; the window's figures come
                        // from the reads before and after.
                        if let Ok(counters) = m.cache_counters().await {
                            samples.push(CounterSample { at: window_start.elapsed(), counters });
                        }
                    }
                    _ = &mut stop_rx => break,
                }
            }
            samples
        })
    });

    let records = run_sessions(
        &target,
        &plan,
        &shape,
        shape.warmup,
        shape.sessions,
        shape.duration.map(|d| window_start + d),
        window_start,
        &bar,
    )
    .await;
    bar.finish_and_clear();
    let duration = records
        .iter()
        .map(|r| r.start + r.e2e)
        .max()
        .unwrap_or_default();
    let _ = stop_tx.send(());
    let mut samples = match sampler {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    let counters = match (&metrics, before) {
        (Some(m), Some(before)) => {
            let after = settled(m).await?;
            samples.push(CounterSample {
                at: duration,
                counters: after.clone(),
            });
            samples.insert(
                0,
                CounterSample {
                    at: Duration::ZERO,
                    counters: before.clone(),
                },
            );
            Some((before, after))
        }
        _ => None,
    };
    Ok(RunOutput {
        started_at,
        duration,
        records,
        warmup_failures,
        counters,
        samples,
    })
}
