//! pd-transport: moving KV blocks between nodes, shaped like one-sided RDMA (register
//! regions, read batches of block descriptors, complete asynchronously, release).
//!
//! Skeleton: the TCP backend arrives with the cluster issue, RDMA (ibverbs) after it.
