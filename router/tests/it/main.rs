//! The router against scripted fake prefill/decode nodes over real sockets.

mod binary;
mod fake;
mod generate;
mod health;
mod validation;
