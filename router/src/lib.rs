//! pd-router: the client-facing gRPC service, request validation and tokenization, the
//! routing policy, the node registry and the aggregation of node metrics.
//!
//! Skeleton: it arrives with the cluster issue. It depends on `pd-engine` only for shared
//! types (block hashing, counter ids), never on kernels or transport.
