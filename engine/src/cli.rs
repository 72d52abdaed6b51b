//! Command-line flags every binary that runs an engine shares (`pdctl run`, the nodes), with
//! vLLM's names, and building an engine from them. Behind the `cli` feature so the engine
//! itself does not need clap.

use std::time::Duration;

use clap::Args;

use crate::backend::cpu::CpuBackend;
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::executor::Executor;
use crate::kv::{DEFAULT_BLOCK_SIZE, KvLayout};
use crate::model::{ModelFiles, Qwen3};
use crate::serve::{Engine, EngineConfig, Role};

/// Default KV budget when `--num-gpu-blocks` is not given.
pub const DEFAULT_KV_BYTES: usize = 2 << 30;

/// Engine flags, with vLLM's names.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Engine")]
pub struct EngineArgs {
    /// Tokens per KV block.
    #[arg(long, env = "PD_BLOCK_SIZE", default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// KV blocks in the backend's memory (default: 2 GiB worth, at most 4 full contexts).
    #[arg(long, env = "PD_NUM_GPU_BLOCKS")]
    pub num_gpu_blocks: Option<usize>,
    /// Blocks in the host-memory tier of the prefix cache (0: off).
    #[arg(long, env = "PD_HOST_CACHE_BLOCKS", default_value_t = 0)]
    pub host_cache_blocks: usize,
    /// Reuse cached KV of common prefixes (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Context limit (prompt + generated); defaults to the model's max_position_embeddings.
    #[arg(long, env = "PD_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Token budget of one engine step (prefill chunks + decode tokens).
    #[arg(long, env = "PD_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    #[arg(long, env = "PD_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
}

impl EngineArgs {
    /// The context limit: `--max-model-len`, at most the model's positions.
    pub fn max_model_len(&self, config: &ModelConfig) -> Result<usize, EngineError> {
        let len = self.max_model_len.unwrap_or(config.max_position_embeddings);
        if len == 0 || len > config.max_position_embeddings {
            return Err(EngineError::InvalidRequest(format!(
                "--max-model-len {len} must be between 1 and the model's {} positions",
                config.max_position_embeddings
            )));
        }
        Ok(len)
    }

    /// `--num-gpu-blocks`, or 2 GiB worth of blocks, at most four full contexts.
    pub fn num_blocks(&self, layout: &KvLayout, max_model_len: usize) -> usize {
        self.num_gpu_blocks.unwrap_or_else(|| {
            (DEFAULT_KV_BYTES / layout.block_bytes())
                .min(4 * layout.blocks_for(max_model_len))
                .max(1)
        })
    }

    /// An engine of `role` on the CPU backend for `model`. `lease_timeout` bounds how long a
    /// prefill lease pins its blocks.
    pub fn build(
        &self,
        files: &ModelFiles,
        model: Qwen3<CpuBackend>,
        role: Role,
        seed: u64,
        lease_timeout: Duration,
    ) -> Result<Engine<CpuBackend>, EngineError> {
        let max_model_len = self.max_model_len(&files.config)?;
        let layout = KvLayout::new(&files.config, self.block_size)?;
        let num_blocks = self.num_blocks(&layout, max_model_len);
        let executor = Executor::new(CpuBackend::new(), model, self.block_size, num_blocks)?;
        let config = EngineConfig {
            role,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            host_cache_blocks: self.host_cache_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len,
            lease_timeout,
            seed,
        };
        let vocab_limit = files.tokenizer.vocab_size().min(files.config.vocab_size);
        Engine::new(executor, config, files.eos_token_ids(), vocab_limit)
            .map_err(|e| EngineError::InvalidRequest(e.message))
    }
}
