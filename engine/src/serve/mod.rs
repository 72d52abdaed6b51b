//! The serving engine both node roles run: continuous batching over a paged KV pool with a
//! prefix cache (device and host tiers), exact prefix-cache accounting, and a driver thread.

pub mod cache_feed;
pub mod config;
pub mod counters;
pub mod driver;
pub mod engine;
pub mod external;
pub mod panic_hook;
pub mod prompt;
pub mod request;

/// Leases are the KV handoff's ([`crate::kv::handoff`]); the engine hands them out.
pub use crate::kv::handoff::lease_secret::{LEASE_SECRET_LEN, LeaseSecret};
pub use crate::kv::handoff::lease_store::{LeaseStore, LeasedKv};
/// The tiers outside the device, by which external hits are split.
pub use crate::kv::prefix::tier::TierKind;
pub use cache_feed::{CacheEventStream, CacheUpdate, FeedEnded};
pub use config::{EngineConfig, Role};
pub use counters::{EngineCounters, PrefixOutcome};
pub use driver::{EngineHandle, EngineThread, FailureObserver, FinishedObserver, StepObserver};
pub use engine::{Engine, StepStats};
pub use external::PerTier;
pub use prompt::{truncate_prompt, validate_prompt};
pub use request::{
    EngineRequest, Finished, ImportedBlocks, ImportedKv, KvLease, RequestError, RequestEvent,
    RequestId, RequestTimings, Usage,
};
