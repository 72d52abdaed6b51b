//! pd-tests: cluster-level tests that start real nodes and a real router on 127.0.0.1.
//!
//! Skeleton: the cluster arrives with the cluster issue, and its tests with it. Single-process
//! end-to-end tests of `pdctl` live in `pdctl/tests/` (cargo builds that binary for them).
