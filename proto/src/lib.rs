//! pd-proto: the wire contract of the cluster (package `pd.v1`) and the one place where wire
//! values become engine values: every `TryFrom`/validation of what a client or a node sends
//! lives here, and every engine error maps to one gRPC code here.
//!
//! Does not own: serving (the router and node binaries), text (the router).

pub mod cache_events;
pub mod convert;
pub mod failure;
pub mod health;

/// Generated messages and services.
#[allow(clippy::all, missing_docs, unreachable_pub)]
pub mod pb {
    tonic::include_proto!("pd.v1");
}

/// The encoded file descriptor set of pd.v1, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("pd_v1_descriptor");
