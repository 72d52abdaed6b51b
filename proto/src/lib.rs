//! pd-proto: the wire contract of the cluster (package `pd.v1`).
//!
//! Skeleton: the gRPC services (`pd.v1.Generation` on the router; `Prefill`, `Decode`,
//! `ReleaseKv`, `Abort`, `Info` on the nodes) and the `TryFrom<wire>` validation into engine
//! types arrive with the cluster issue. Nothing here is usable yet, and nothing pretends to be.
