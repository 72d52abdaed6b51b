//! The prefix cache: block hashes and the tiers that hold blocks by hash.
//!
//! - [`hash`]: the chained block hash, a wire format every process computes alike.
//! - [`device`]: the device tier's `hash ↔ block` map, kept by the block pool
//!   ([`crate::kv::pool`]).
//! - [`tier`]: the contract of a tier outside the device; [`host_tier`]: the host-memory tier
//!   evicted device blocks spill to.
//! - [`events`]: the cache's changes as the router sees them; [`journal`]: where a tier
//!   records them until the engine publishes them.
//!
//! Not here: allocating and freeing blocks (the pool), the lookups' accounting and the
//! scheduling around them (`crate::serve`), KV that arrives from another node
//! ([`crate::kv::handoff`]).

pub mod device;
pub mod events;
pub mod hash;
pub mod host_tier;
pub mod journal;
pub mod tier;
