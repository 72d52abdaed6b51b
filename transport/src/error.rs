//! Why a KV pull failed.

use std::io;
use std::net::SocketAddr;

use crate::fingerprint::LayoutFingerprint;
use crate::stats::FailureReason;

/// A failed KV pull. Each variant has a stable metric label ([`TransportError::reason`]).
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The exporter could not be reached (refused, unreachable, reset during connect).
    #[error("cannot connect to the KV exporter at {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// The transfer did not complete before its deadline; whatever arrived is dropped.
    #[error("KV transfer from {addr} missed its deadline while {stage}")]
    Deadline {
        addr: SocketAddr,
        /// `"connecting"` or `"transferring"`.
        stage: &'static str,
    },
    /// The two nodes disagree on the model or the KV layout: no KV was sent.
    #[error(
        "KV layout fingerprint mismatch: this node has {ours}, the exporter has {theirs} \
         (model, dtype, block size, layers, KV heads or head dim differ); no KV was moved"
    )]
    FingerprintMismatch {
        ours: LayoutFingerprint,
        theirs: LayoutFingerprint,
    },
    /// The exporter holds no such lease (released, expired, never existed), the secret
    /// presented is not the lease's, or the lease does not cover the requested blocks: the
    /// exporter does not say which.
    #[error(
        "the exporter has no lease {lease_id} covering blocks {first_block}..{} for the \
         secret presented (released, expired, shorter, or a wrong secret): {message}",
        first_block + count
    )]
    UnknownLease {
        lease_id: u64,
        first_block: u64,
        count: u64,
        message: String,
    },
    /// A length disagreed: block length, block count, chunk length, or a stream that ended
    /// early.
    #[error("KV transfer length mismatch: {0}")]
    Length(String),
    /// A block's bytes do not hash to the checksum sent with them (`block`: its index in
    /// the lease).
    #[error(
        "KV transfer checksum mismatch in lease block {block}: computed {computed:016x}, \
         the exporter sent {sent:016x}"
    )]
    Checksum {
        block: u64,
        computed: u64,
        sent: u64,
    },
    /// The connection failed after it was established.
    #[error("I/O error during the KV transfer: {0}")]
    Io(#[from] io::Error),
    /// The peer does not speak this protocol (bad magic, version, frame or echo).
    #[error("KV transport protocol error: {0}")]
    Protocol(String),
    /// The exporter refused the request for another reason (malformed or oversized request,
    /// shutting down, internal failure).
    #[error("the KV exporter refused the pull: {0}")]
    Refused(String),
    /// An RDMA read failed (its reason is the RDMA error's).
    #[error("RDMA: {0}")]
    Rdma(#[from] crate::rdma::RdmaError),
}

impl TransportError {
    /// A stable, low-cardinality label for a failures-by-reason metric.
    pub fn reason(&self) -> FailureReason {
        match self {
            Self::Connect { .. } | Self::Io(_) => FailureReason::Connection,
            Self::Deadline { .. } => FailureReason::Timeout,
            Self::FingerprintMismatch { .. } => FailureReason::LayoutMismatch,
            Self::UnknownLease { .. } => FailureReason::LeaseGone,
            Self::Length(_) => FailureReason::Length,
            Self::Checksum { .. } => FailureReason::Checksum,
            Self::Protocol(_) => FailureReason::Protocol,
            Self::Refused(_) => FailureReason::Refused,
            Self::Rdma(e) => e.reason(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_its_reason() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let all = [
            TransportError::Connect {
                addr,
                source: io::Error::from(io::ErrorKind::ConnectionRefused),
            },
            TransportError::Deadline {
                addr,
                stage: "connecting",
            },
            TransportError::FingerprintMismatch {
                ours: LayoutFingerprint(1),
                theirs: LayoutFingerprint(2),
            },
            TransportError::UnknownLease {
                lease_id: 7,
                first_block: 2,
                count: 3,
                message: String::new(),
            },
            TransportError::Length("x".into()),
            TransportError::Checksum {
                block: 0,
                computed: 1,
                sent: 2,
            },
            TransportError::Io(io::Error::other("x")),
            TransportError::Protocol("x".into()),
            TransportError::Refused("x".into()),
        ];
        let reasons: Vec<_> = all.iter().map(|e| e.reason()).collect();
        use FailureReason::*;
        assert_eq!(
            reasons,
            [
                Connection,
                Timeout,
                LayoutMismatch,
                LeaseGone,
                Length,
                Checksum,
                Connection,
                Protocol,
                Refused
            ]
        );
        let msg = all[3].to_string();
        assert!(
            msg.contains("lease 7") && msg.contains("blocks 2..5"),
            "{msg}"
        );
        let msg = all[2].to_string();
        assert!(msg.contains("0000000000000001") && msg.contains("0000000000000002"));
    }
}
