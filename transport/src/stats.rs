//! Cumulative KV-transfer counters of one node, for its metrics: bytes moved, completed
//! transfers with a latency histogram, and failures by [`FailureReason`].
//!
//! Counted where transfers happen: the [`crate::KvPuller`] on a decode node (what it
//! received) and the [`crate::KvExportServer`] on a prefill node (what it served). Plain
//! atomics: recording never blocks a transfer, and a snapshot never blocks a recording.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::rdma::ExportMode;
use crate::wire::Status;

/// Why a transfer failed: the `reason` label of the failure counters. Low cardinality and
/// stable: dashboards and alerts select on these values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureReason {
    /// The deadline passed (connecting or transferring).
    Timeout,
    /// The peer could not be reached, or the connection broke mid-transfer.
    Connection,
    /// The two nodes' KV layouts (fingerprints) differ: nothing was moved.
    LayoutMismatch,
    /// The lease was released or expired before the blocks were read.
    LeaseGone,
    /// A block, chunk or stream length disagreed.
    Length,
    /// A chunk's checksum did not match its bytes.
    Checksum,
    /// The peer does not speak this protocol.
    Protocol,
    /// The exporter refused for another reason (bad request, shutting down, internal).
    Refused,
}

impl FailureReason {
    /// Every reason, in label order.
    pub const ALL: [FailureReason; 8] = [
        Self::Timeout,
        Self::Connection,
        Self::LayoutMismatch,
        Self::LeaseGone,
        Self::Length,
        Self::Checksum,
        Self::Protocol,
        Self::Refused,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::LayoutMismatch => "layout_mismatch",
            Self::LeaseGone => "lease_gone",
            Self::Length => "length",
            Self::Checksum => "checksum",
            Self::Protocol => "protocol",
            Self::Refused => "refused",
        }
    }

    /// The reason an exporter refuses or aborts a pull with `status` (never `Ok`).
    pub(crate) fn of_status(status: Status) -> Self {
        match status {
            Status::UnknownLease => Self::LeaseGone,
            Status::FingerprintMismatch => Self::LayoutMismatch,
            Status::Length => Self::Length,
            Status::UnsupportedVersion => Self::Protocol,
            Status::Ok | Status::BadRequest | Status::Unavailable => Self::Refused,
        }
    }
}

impl std::fmt::Display for FailureReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Upper bounds (seconds) of the transfer latency histogram: from a few blocks on a local
/// link (milliseconds) to a long prompt on a slow one (tens of seconds).
pub const TRANSFER_SECONDS_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// A node's live transfer counters (share it in an `Arc`).
#[derive(Debug, Default)]
pub struct TransferStats {
    bytes: AtomicU64,
    transfers: AtomicU64,
    nanos: AtomicU64,
    /// Per bucket, not cumulative; the last one is `+Inf`.
    buckets: [AtomicU64; TRANSFER_SECONDS_BUCKETS.len() + 1],
    failures: [AtomicU64; FailureReason::ALL.len()],
    failovers: AtomicU64,
    /// Leases offered for RDMA reads, in [`ExportMode::ALL`] order.
    rdma_offers: [AtomicU64; ExportMode::ALL.len()],
}

/// A snapshot of [`TransferStats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransferCounts {
    /// Payload bytes of completed transfers.
    pub bytes: u64,
    /// Completed transfers.
    pub transfers: u64,
    /// Their summed duration.
    pub seconds_sum: f64,
    /// Completed transfers per latency bucket ([`TRANSFER_SECONDS_BUCKETS`], then `+Inf`),
    /// not cumulative.
    pub bucket_counts: Vec<u64>,
    /// Failed transfers per reason, in [`FailureReason::ALL`] order.
    pub failures: Vec<(FailureReason, u64)>,
    /// Transfers whose RDMA read failed and that were retried over TCP (the retry's outcome
    /// is counted as any transfer's).
    pub failovers: u64,
    /// Prefill nodes: leases offered for RDMA reads, per [`ExportMode`].
    pub rdma_offers: Vec<(ExportMode, u64)>,
}

impl TransferStats {
    /// A transfer of `bytes` payload bytes completed in `elapsed`.
    pub fn record_ok(&self, bytes: u64, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let secs = elapsed.as_secs_f64();
        let bucket = TRANSFER_SECONDS_BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(TRANSFER_SECONDS_BUCKETS.len());
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        // Last: a reader that sees the count also sees the rest (close enough for metrics;
        // the counts only grow).
        self.transfers.fetch_add(1, Ordering::Release);
    }

    /// A transfer failed.
    pub fn record_failure(&self, reason: FailureReason) {
        let i = FailureReason::ALL
            .iter()
            .position(|&r| r == reason)
            .expect("ALL lists every reason");
        self.failures[i].fetch_add(1, Ordering::Relaxed);
    }

    /// An RDMA read failed and the transfer is retried over TCP.
    pub fn record_failover(&self) {
        self.failovers.fetch_add(1, Ordering::Relaxed);
    }

    /// A lease was offered for RDMA reads, exported `mode`.
    pub fn record_rdma_offer(&self, mode: ExportMode) {
        let i = ExportMode::ALL
            .iter()
            .position(|&m| m == mode)
            .expect("ALL lists every mode");
        self.rdma_offers[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> TransferCounts {
        let transfers = self.transfers.load(Ordering::Acquire);
        TransferCounts {
            bytes: self.bytes.load(Ordering::Relaxed),
            transfers,
            seconds_sum: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            bucket_counts: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            failures: FailureReason::ALL
                .iter()
                .zip(&self.failures)
                .map(|(&r, c)| (r, c.load(Ordering::Relaxed)))
                .collect(),
            failovers: self.failovers.load(Ordering::Relaxed),
            rdma_offers: ExportMode::ALL
                .iter()
                .zip(&self.rdma_offers)
                .map(|(&m, c)| (m, c.load(Ordering::Relaxed)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_land_in_their_bucket_and_failures_by_reason() {
        let s = TransferStats::default();
        s.record_ok(100, Duration::from_millis(3));
        s.record_ok(50, Duration::from_secs(500));
        s.record_failure(FailureReason::LeaseGone);
        s.record_failure(FailureReason::LeaseGone);
        let c = s.snapshot();
        assert_eq!((c.bytes, c.transfers), (150, 2));
        assert!((c.seconds_sum - 500.003).abs() < 1e-9);
        assert_eq!(c.bucket_counts[2], 1, "3 ms is in the 5 ms bucket");
        assert_eq!(c.bucket_counts[TRANSFER_SECONDS_BUCKETS.len()], 1, "+Inf");
        assert_eq!(c.bucket_counts.iter().sum::<u64>(), 2);
        let gone = c
            .failures
            .iter()
            .find(|(r, _)| *r == FailureReason::LeaseGone);
        assert_eq!(gone, Some(&(FailureReason::LeaseGone, 2)));
        assert_eq!(c.failures.iter().map(|(_, n)| n).sum::<u64>(), 2);
    }

    #[test]
    fn labels_are_distinct() {
        let mut labels: Vec<_> = FailureReason::ALL.iter().map(|r| r.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), FailureReason::ALL.len());
    }
}
