//! Engine settings: the node's role and the scheduler's limits (the nodes' and `pdctl run`'s
//! flags), checked before an engine starts. Owns no state.

use std::time::Duration;

use crate::error::ErrorKind;

use super::request::RequestError;

/// What a node, or its engine, does with a request: the one role type of the workspace
/// (engine settings, node labels, the router's registry). The wire's `pd.v1.Role` is
/// converted to and from it in `pd-proto` only; labels and logs use [`Role::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefill and decode in one engine (`pdctl run`, and a decode node's engine, which
    /// also computes prompts in the router's aggregated mode).
    Mixed,
    /// Prefill only: stop after the first token and keep the KV blocks under a lease.
    Prefill,
    /// Decode only: every request brings its prompt's KV ([`super::ImportedKv`]).
    Decode,
}

impl Role {
    /// The label value (`role` of metrics, the ready line, logs, command-line flags).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Mixed => "mixed",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Role {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Engine settings (the nodes' and `pdctl run`'s flags).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub role: Role,
    pub enable_prefix_caching: bool,
    /// The block hash function of the prefix cache (`--prefix-caching-hash-algo`).
    pub hash_algo: crate::kv::prefix::hash::HashAlgo,
    /// Blocks in the host tier (0 disables it).
    pub host_cache_blocks: usize,
    /// Token budget of one step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Context limit (prompt + generated).
    pub max_model_len: usize,
    /// How long a prefill lease pins its blocks if never released.
    pub lease_timeout: Duration,
    /// Seed for requests without one (each request gets `seed ^ hash(request id)`).
    pub seed: u64,
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), RequestError> {
        let bad = |m: String| RequestError {
            kind: ErrorKind::InvalidArgument,
            message: m,
        };
        if self.max_num_batched_tokens == 0 {
            return Err(bad("max-num-batched-tokens must be > 0".into()));
        }
        if self.max_num_seqs == 0 {
            return Err(bad("max-num-seqs must be > 0".into()));
        }
        Ok(())
    }
}
