//! pd-engine: the core that both node roles run.
//!
//! Owns: Qwen3 written once over the op-level [`backend::Backend`] trait, the CPU backend,
//! model loading (config.json, safetensors, tokenizer), `synthetic:` models, the paged KV
//! layout, sampling, and a single-request generation loop.
//! Does not own: gRPC, CUDA or RDMA (those crates depend on this one, never the reverse).

pub mod backend;
#[cfg(feature = "cli")]
pub mod cli;
pub mod config;
pub mod error;
pub mod executor;
pub mod generate;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod serve;
pub mod synthetic;
pub mod text;
pub mod tokenizer;
pub mod weights;

pub use error::{EngineError, ErrorKind};
