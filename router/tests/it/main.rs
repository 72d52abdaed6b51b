//! The router against scripted fake prefill/decode nodes over real sockets.

mod admission;
mod binary;
mod cache_events;
mod cache_index_live;
mod disagg;
mod discovery;
mod fake;
mod generate;
mod health;
mod limits;
mod tenants;
mod tiers;
mod validation;
