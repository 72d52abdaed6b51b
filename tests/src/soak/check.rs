//! The soak's verdicts, once the load has stopped and the cluster has settled: how every
//! request ended, whether the nodes hold any KV, whether the router's counters equal the
//! nodes' own over all their processes, and whether memory stayed flat.
//!
//! Not here: running anything (`super`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::load::{MAX_GENERATED, MAX_PROMPT, Outcome, Record};
use super::watch::{Epoch, Log, Memory};
use crate::Counts;

/// Counts a node makes after its last report reached the router and before it is SIGKILLed
/// can be missed by the router (docs/metrics.md); reports reach it at least this often
/// (`--health-interval-ms 200`, with room for a slow poll on a loaded machine).
pub const REPORT_WINDOW: Duration = Duration::from_secs(2);

/// Memory is judged on processes that ran at least this warm-up...
pub const WARM_UP: Duration = Duration::from_secs(60);
/// ...and this long after it: a process killed within a minute or two shows its allocator
/// and caches settling, not a leak.
pub const MEMORY_SPAN: Duration = Duration::from_secs(300);
/// Most growth of resident memory allowed over the second half of a process's life.
pub const MEMORY_GROWTH: f64 = 0.05;

/// One verdict: what was checked and what was found.
#[derive(Debug)]
pub struct Verdict {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

impl Verdict {
    fn new(name: &str, ok: bool, detail: String) -> Self {
        Self {
            name: name.to_string(),
            ok,
            detail,
        }
    }
}

/// How the requests ended: every one with its tokens or a clear error, none past its
/// deadline.
pub fn requests(records: &[Record]) -> Vec<Verdict> {
    let mut by_outcome: BTreeMap<String, usize> = BTreeMap::new();
    let mut violations: BTreeMap<String, usize> = BTreeMap::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for r in records {
        let key = match &r.outcome {
            Outcome::Completed => "completed".to_string(),
            Outcome::Aborted => "aborted".to_string(),
            Outcome::Disconnected => "disconnected".to_string(),
            Outcome::Refused(code, message) => {
                *errors
                    .entry(format!("{code}: {}", shape(message)))
                    .or_default() += 1;
                format!("error {code}")
            }
            Outcome::Violation(v) => {
                *violations.entry(v.clone()).or_default() += 1;
                "violation".to_string()
            }
        };
        *by_outcome
            .entry(format!("{:?}: {key}", r.action))
            .or_default() += 1;
    }
    let completed = records
        .iter()
        .filter(|r| r.outcome == Outcome::Completed)
        .count();
    let latest = records.iter().map(|r| r.late).max().unwrap_or_default();
    vec![
        Verdict::new(
            "requests ended with their tokens or a clear error",
            violations.is_empty() && completed > 0,
            format!(
                "{} requests: {by_outcome:?}; errors: {errors:?}; violations: {violations:?}",
                records.len()
            ),
        ),
        Verdict::new(
            "no client waited past its deadline",
            latest <= super::load::GRACE,
            format!("latest end past a deadline: {latest:?}"),
        ),
    ]
}

/// A message with its numbers and addresses blanked, so that alike errors count together.
fn shape(message: &str) -> String {
    let mut out = String::new();
    let mut in_number = false;
    for c in message.chars().take(160) {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    out
}

/// Expected router counters of one node: what its processes counted, as bounds (exact for
/// processes that were not killed).
#[derive(Debug, Default, Clone, Copy)]
pub struct Expected {
    pub low: Counts,
    pub high: Counts,
    pub kills: usize,
}

/// The counters the final router must hold for node `part`: every epoch it saw (alive after
/// `router_since`), exact for the live one, within the crash window for killed ones.
pub fn expected(log: &Log, part: usize, router_since: Instant) -> Expected {
    let mut e = Expected::default();
    let epochs = log
        .epochs
        .values()
        .filter(|ep| ep.part == part)
        .filter(|ep| ep.killed.is_none_or(|k| k > router_since));
    for ep in epochs {
        add(&mut e, ep);
    }
    e
}

fn add(e: &mut Expected, ep: &Epoch) {
    e.high = e.high.plus(&ep.last());
    match ep.killed {
        None => e.low = e.low.plus(&ep.last()),
        Some(_) => {
            e.kills += 1;
            e.low = e.low.plus(&ep.last_before_death(REPORT_WINDOW));
            // What may have been counted between the last sample and the kill: every
            // client's request once.
            let slack = |c: u32| f64::from(c) * super::CLIENTS_MAX as f64;
            e.high = e.high.plus(&Counts {
                queries: slack(MAX_PROMPT),
                hits: slack(MAX_PROMPT),
                external_queries: slack(MAX_PROMPT),
                external_hits: slack(MAX_PROMPT),
                prompt_tokens: slack(MAX_PROMPT),
                generation_tokens: slack(MAX_GENERATED),
            });
        }
    }
}

fn fields(c: &Counts) -> [(&'static str, f64); 6] {
    [
        ("queries", c.queries),
        ("hits", c.hits),
        ("external_queries", c.external_queries),
        ("external_hits", c.external_hits),
        ("prompt_tokens", c.prompt_tokens),
        ("generation_tokens", c.generation_tokens),
    ]
}

/// The router's counts of one node against the bounds.
pub fn counters(name: &str, router: &Counts, expected: &Expected) -> Verdict {
    let mut wrong = Vec::new();
    for ((field, r), ((_, low), (_, high))) in fields(router).into_iter().zip(
        fields(&expected.low)
            .into_iter()
            .zip(fields(&expected.high)),
    ) {
        if r < low || r > high {
            wrong.push(format!("{field} {r} outside [{low}, {high}]"));
        }
    }
    let exact = expected.kills == 0;
    Verdict::new(
        &format!("router counters of {name} = its processes' counters"),
        wrong.is_empty(),
        if wrong.is_empty() {
            format!(
                "{} ({}; {} killed processes)",
                if exact {
                    "exact"
                } else {
                    "within the crash window"
                },
                summary(router),
                expected.kills
            )
        } else {
            wrong.join("; ")
        },
    )
}

fn summary(c: &Counts) -> String {
    format!(
        "queries {} hits {} ext {}/{} prompt {} gen {}",
        c.queries,
        c.hits,
        c.external_hits,
        c.external_queries,
        c.prompt_tokens,
        c.generation_tokens
    )
}

/// Resident memory over the second half of the life of every process that ran long enough.
///
/// Judged from halfway through a process's life, not from the end of the warm-up: the
/// router's allocator (mimalloc) takes a few more pages the first time each rare failure
/// path runs (a retry, a release to a dead node), which under node kills every few seconds
/// goes on for a couple of minutes while its live heap stays flat (docs/operations.md,
/// "Chaos soak"). A leak keeps growing through the second half; that settling does not.
pub fn memory(log: &Log) -> Verdict {
    let mut checked = Vec::new();
    let mut grown = Vec::new();
    for (pid, m) in &log.memory {
        if let Some(g) = growth(m) {
            let growth = g.last as f64 / g.half as f64 - 1.0;
            let mib = |kib: u64| kib as f64 / 1024.0;
            let line = format!(
                "{} (pid {pid}) {:.1} → {:.1} MiB, {:+.1}% (from {:.1} MiB after warm-up)",
                m.name,
                mib(g.half),
                mib(g.last),
                growth * 100.0,
                mib(g.warm),
            );
            if growth > MEMORY_GROWTH {
                grown.push(line.clone());
            }
            checked.push(line);
        }
    }
    Verdict::new(
        "resident memory flat over the second half of each process's life (growth under 5 %)",
        grown.is_empty(),
        if checked.is_empty() {
            "no process ran long enough to judge".into()
        } else {
            checked.join(", ")
        },
    )
}

/// A process's resident memory (KiB, the median of a 10 s window) at three points.
struct Growth {
    /// Just after warm-up (shown, not judged).
    warm: u64,
    /// Halfway through its life.
    half: u64,
    /// Over its last 10 s.
    last: u64,
}

/// [`Growth`] of a process that ran long enough.
fn growth(m: &Memory) -> Option<Growth> {
    let (start, _) = *m.samples.first()?;
    let (end, _) = *m.samples.last()?;
    let life = end.duration_since(start);
    if life < WARM_UP + MEMORY_SPAN {
        return None;
    }
    let window = Duration::from_secs(10);
    let median = |from: Instant, to: Instant| {
        let mut v: Vec<u64> = m
            .samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|s| s.1)
            .collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    };
    let half = start + life / 2;
    Some(Growth {
        warm: median(start + WARM_UP, start + WARM_UP + window)?,
        half: median(half, half + window)?,
        last: median(end - window, end)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process sampled every second for 8 minutes, `kib(seconds since start)` each time.
    fn log_of(kib: impl Fn(u64) -> u64) -> Log {
        let start = Instant::now();
        let samples = (0..=480)
            .map(|s| (start + Duration::from_secs(s), kib(s)))
            .collect();
        let mut log = Log::default();
        log.memory.insert(
            1,
            Memory {
                name: "router-4".into(),
                samples,
            },
        );
        log
    }

    #[test]
    fn settling_before_halfway_passes_and_a_steady_leak_fails() {
        // 75 MiB at start, +12 MiB in steps until minute 3, flat after (the router's
        // allocator in a soak).
        let settling = log_of(|s| (75 + (s.min(180) / 15)) * 1024);
        let v = memory(&settling);
        assert!(v.ok, "{}", v.detail);
        assert!(v.detail.contains("87.0 → 87.0 MiB"), "{}", v.detail);
        // 75 → 90 MiB at a steady rate: +9 % over the second half.
        let leak = log_of(|s| 75 * 1024 + s * 32);
        let v = memory(&leak);
        assert!(!v.ok, "{}", v.detail);
    }

    #[test]
    fn short_lives_are_not_judged() {
        let mut log = log_of(|_| 1024);
        for m in log.memory.values_mut() {
            m.samples.truncate(300);
        }
        let v = memory(&log);
        assert!(
            v.ok && v.detail.contains("no process ran long enough"),
            "{}",
            v.detail
        );
    }
}
