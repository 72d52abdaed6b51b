//! Why RDMA could not start or a read failed.

use super::endpoint::EndpointError;
use super::plan::PlanError;
use super::scatter::ScatterError;
use super::window::CompletionError;
use crate::stats::FailureReason;

/// A failed RDMA step. Every ibverbs error is turned into text here, so no verbs type leaves
/// the crate.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No usable device: libibverbs missing, no device, or the kernel has no RDMA support.
    #[error("{0}")]
    Unavailable(String),
    /// This binary was built without the `rdma` feature.
    #[error("this binary was built without RDMA support")]
    NotBuilt,
    /// The device, port or GID asked for (or found) cannot be used.
    #[error("RDMA device {device}: {message}")]
    Device { device: String, message: String },
    /// A verbs call failed.
    #[error("{op} failed: {message}")]
    Verbs { op: &'static str, message: String },
    /// The endpoint exchange over gRPC failed.
    #[error("RDMA connection set-up with {addr} failed: {message}")]
    Connect { addr: String, message: String },
    /// A peer's endpoint or offer is unusable.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The blocks asked for are not in the offer.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The READs do not fit the KV memory reserved for them.
    #[error(transparent)]
    Scatter(#[from] ScatterError),
    /// A READ completed with an error status (the queue pair is then unusable).
    #[error("RDMA READ {op} of the transfer completed with status {status}")]
    Completion {
        op: u32,
        status: String,
        /// The exporter refused the access: the region was deregistered (lease released or
        /// expired) or the rkey is wrong.
        remote_access: bool,
    },
    /// A completion did not match the transfer.
    #[error("RDMA completion bookkeeping: {0}")]
    Bookkeeping(#[from] CompletionError),
    /// The deadline passed with READs outstanding.
    #[error("RDMA transfer missed its deadline ({done} of {total} READs completed)")]
    Deadline { done: usize, total: usize },
    /// The pull was abandoned (its caller went away) with READs outstanding; the queue pair
    /// was destroyed so none of them can still land.
    #[error("RDMA transfer abandoned by its caller ({done} of {total} READs completed)")]
    Abandoned { done: usize, total: usize },
    /// A block read does not hash to the checksum the exporter published.
    #[error("RDMA block {block} does not match the exporter's checksum")]
    Checksum { block: u64 },
    /// The offer's block size is not this node's.
    #[error("the exporter's blocks have {theirs} bytes, this node's {ours}")]
    BlockSize { theirs: u64, ours: u64 },
}

impl RdmaError {
    /// The failure label this error counts under.
    pub fn reason(&self) -> FailureReason {
        match self {
            Self::Unavailable(_)
            | Self::NotBuilt
            | Self::Device { .. }
            | Self::Verbs { .. }
            | Self::Connect { .. } => FailureReason::Connection,
            Self::Completion {
                remote_access: true,
                ..
            } => FailureReason::LeaseGone,
            Self::Completion { .. } => FailureReason::Connection,
            Self::Endpoint(_) | Self::Bookkeeping(_) => FailureReason::Protocol,
            Self::Plan(_) | Self::Scatter(_) | Self::BlockSize { .. } => FailureReason::Length,
            Self::Deadline { .. } | Self::Abandoned { .. } => FailureReason::Timeout,
            Self::Checksum { .. } => FailureReason::Checksum,
        }
    }
}

/// Why a node could not start with the KV transport it was asked for. Each message is one
/// sentence that names the fix.
#[derive(Debug, thiserror::Error)]
pub enum RdmaStartError {
    #[error(
        "--kv-transport rdma needs a build with RDMA support: rebuild the node binaries with \
         `--features rdma`, or start with --kv-transport auto or tcp"
    )]
    NotBuilt,
    #[error(
        "--kv-transport rdma found no usable RDMA device ({0}): install the NIC's RDMA driver \
         and rdma-core's libibverbs.so.1, or create a Soft-RoCE device with `rdma link add rxe0 \
         type rxe netdev eth0`, or pick one with --rdma-device, or start with --kv-transport \
         auto or tcp"
    )]
    NoDevice(RdmaError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_errors_are_one_sentence_that_names_the_fix() {
        let no_device = RdmaStartError::NoDevice(RdmaError::Unavailable(
            "libibverbs: Operation not supported (os error 95)".into(),
        ));
        for e in [RdmaStartError::NotBuilt, no_device] {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "{msg}");
            // One sentence: no full stop before the end (the os error's parentheses aside).
            assert!(!msg.trim_end_matches('.').contains(". "), "{msg}");
            assert!(msg.contains("--kv-transport auto or tcp"), "{msg}");
        }
        assert!(
            RdmaStartError::NotBuilt
                .to_string()
                .contains("--features rdma")
        );
    }

    #[test]
    fn a_refused_remote_access_means_the_lease_is_gone() {
        let e = RdmaError::Completion {
            op: 3,
            status: "remote access error".into(),
            remote_access: true,
        };
        assert_eq!(e.reason(), FailureReason::LeaseGone);
        assert_eq!(
            RdmaError::Deadline { done: 1, total: 4 }.reason(),
            FailureReason::Timeout
        );
    }
}
