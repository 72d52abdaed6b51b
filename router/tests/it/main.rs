//! The router against scripted fake prefill/decode nodes over real sockets.

mod admission;
mod binary;
mod discovery;
mod fake;
mod generate;
mod health;
mod limits;
mod tenants;
mod validation;
