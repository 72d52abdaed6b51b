//! What the soak samples while it runs: every node's cumulative counters (its `Info`, the
//! same report the router reads), per process epoch; and every process's resident memory,
//! per process.
//!
//! Not here: judging the samples (`super::check`).

use std::collections::BTreeMap;
use std::time::Duration;

use pd_proto::pb;
use tokio::time::Instant;

use crate::Counts;

/// The counters one `CounterReport` carries.
pub fn counts(report: &pb::CounterReport) -> Counts {
    Counts {
        queries: report.prefix_cache_queries as f64,
        hits: report.prefix_cache_hits as f64,
        external_queries: report.external_prefix_cache_queries as f64,
        external_hits: report.external_prefix_cache_hits as f64,
        prompt_tokens: report.prompt_tokens as f64,
        generation_tokens: report.generation_tokens as f64,
    }
}

/// One node process as the soak saw it.
#[derive(Debug, Clone)]
pub struct Epoch {
    /// Index of the part (the node) in the cluster.
    pub part: usize,
    /// Its counters over time.
    pub samples: Vec<(Instant, Counts)>,
    /// When it was SIGKILLed (None: it ran to the end).
    pub killed: Option<Instant>,
}

impl Epoch {
    /// The last counters seen.
    pub fn last(&self) -> Counts {
        self.samples.last().map(|s| s.1).unwrap_or_default()
    }

    /// The last counters seen at least `before` before its death.
    pub fn last_before_death(&self, before: Duration) -> Counts {
        let Some(killed) = self.killed else {
            return self.last();
        };
        self.samples
            .iter()
            .rev()
            .find(|(t, _)| *t + before <= killed)
            .map(|s| s.1)
            .unwrap_or_default()
    }
}

/// Resident memory of one process over time.
#[derive(Debug, Clone)]
pub struct Memory {
    pub name: String,
    pub samples: Vec<(Instant, u64)>,
}

/// Everything sampled.
#[derive(Default)]
pub struct Log {
    /// Per (part, epoch).
    pub epochs: BTreeMap<(usize, u64), Epoch>,
    /// Per pid.
    pub memory: BTreeMap<u32, Memory>,
}

impl Log {
    /// Records one `Info` of node `part`.
    pub fn info(&mut self, part: usize, info: &pb::NodeInfo) {
        let Some(report) = &info.counters else {
            return;
        };
        self.epochs
            .entry((part, report.epoch))
            .or_insert_with(|| Epoch {
                part,
                samples: Vec::new(),
                killed: None,
            })
            .samples
            .push((Instant::now(), counts(report)));
    }

    /// Marks epoch `epoch` of node `part` as SIGKILLed now.
    pub fn killed(&mut self, part: usize, epoch: u64) {
        if let Some(e) = self.epochs.get_mut(&(part, epoch)) {
            e.killed = Some(Instant::now());
        }
    }

    /// Records the resident memory of `pid`, if it still runs.
    pub fn memory(&mut self, pid: u32, name: &str) {
        if let Some(kib) = rss_kib(pid) {
            self.memory
                .entry(pid)
                .or_insert_with(|| Memory {
                    name: name.to_string(),
                    samples: Vec::new(),
                })
                .samples
                .push((Instant::now(), kib));
        }
    }
}

/// `VmRSS` of a process, in KiB (Linux `/proc`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
