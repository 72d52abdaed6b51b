//! The serving engine both node roles run: continuous batching over a paged KV pool with a
//! prefix cache (device and host tiers), exact prefix-cache accounting, and a driver thread.

pub mod cache_feed;
pub mod config;
pub mod counters;
pub mod driver;
pub mod engine;
pub mod external;
pub mod lease_secret;
pub mod lease_store;
pub mod panic_hook;
pub mod prompt;
pub mod request;

/// The tiers outside the device, by which external hits are split.
pub use crate::kv::tier::TierKind;
pub use cache_feed::{CacheEventStream, CacheUpdate, FeedEnded};
pub use config::{EngineConfig, Role};
pub use counters::{EngineCounters, PrefixOutcome};
pub use driver::{EngineHandle, EngineThread, FailureObserver, FinishedObserver, StepObserver};
pub use engine::{Engine, StepStats};
pub use external::PerTier;
pub use lease_secret::{LEASE_SECRET_LEN, LeaseSecret};
pub use lease_store::{LeaseStore, LeasedKv};
pub use prompt::{truncate_prompt, validate_prompt};
pub use request::{
    EngineRequest, Finished, ImportedBlocks, ImportedKv, KvLease, RequestError, RequestEvent,
    RequestId, RequestTimings, Usage,
};
