//! Command-line flags every binary that runs an engine shares (`pdctl run`, the nodes), with
//! vLLM's names, and building an engine from them. Behind the `cli` feature so the engine
//! itself does not need clap.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::Args;

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::graph::DecodeGraphs;
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::executor::Executor;
use crate::kv::prefix::hash::HashAlgo;
use crate::kv::{DEFAULT_BLOCK_SIZE, KvLayout};
use crate::model::{ModelFiles, Qwen3};
use crate::serve::{Engine, EngineConfig, Role};
use crate::weights::DType;

/// Default KV budget on the CPU when `--num-gpu-blocks` is not given.
pub const DEFAULT_KV_BYTES: usize = 2 << 30;

/// Default `--gpu-memory-utilization` (vLLM's).
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// Where the model runs (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU backend of this crate.
    #[default]
    Cpu,
    /// CUDA device `ordinal` (the `pd-kernels` backend; needs a build with `cuda`).
    Cuda { ordinal: usize },
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda { ordinal: 0 }),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| Device::Cuda { ordinal })
                .ok_or_else(|| format!("unknown device `{other}`: expected cpu, cuda or cuda:N")),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Whether pure decode steps replay CUDA graphs (`--cuda-graphs on|off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaGraphs {
    On,
    /// The default until a GPU run has measured graphs (docs/cuda.md).
    #[default]
    Off,
}

impl FromStr for CudaGraphs {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on" => Ok(CudaGraphs::On),
            "off" => Ok(CudaGraphs::Off),
            other => Err(format!("unknown value `{other}`: expected on or off")),
        }
    }
}

impl fmt::Display for CudaGraphs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaGraphs::On => "on",
            CudaGraphs::Off => "off",
        })
    }
}

/// How a device stores its KV cache (`--kv-cache-dtype`, vLLM's flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The dtype of the model's weight matrices on a GPU (bf16 for Qwen3 checkpoints); f32
    /// on the CPU.
    #[default]
    Auto,
    F32,
    Bf16,
    F16,
}

impl KvCacheDtype {
    /// The storage type a CUDA device is asked for; `None` leaves it to the model (auto).
    pub fn on_device(self) -> Option<DType> {
        match self {
            KvCacheDtype::Auto => None,
            KvCacheDtype::F32 => Some(DType::F32),
            KvCacheDtype::Bf16 => Some(DType::BF16),
            KvCacheDtype::F16 => Some(DType::F16),
        }
    }

    /// The storage type on the CPU: `auto` keeps f32 there (the reference backend's
    /// precision); bf16 and f16 are taken as asked.
    pub fn on_cpu(self) -> DType {
        match self {
            KvCacheDtype::Auto | KvCacheDtype::F32 => DType::F32,
            KvCacheDtype::Bf16 => DType::BF16,
            KvCacheDtype::F16 => DType::F16,
        }
    }
}

impl FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvCacheDtype::Auto),
            "f32" | "float32" => Ok(KvCacheDtype::F32),
            "bf16" | "bfloat16" => Ok(KvCacheDtype::Bf16),
            "f16" | "float16" | "half" => Ok(KvCacheDtype::F16),
            other => Err(format!(
                "unknown value `{other}`: expected auto, f32, bf16 or f16"
            )),
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::F32 => "f32",
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::F16 => "f16",
        })
    }
}

/// A fraction in (0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("{v} must be in (0, 1]"))
    }
}

/// Upper bound of the device memory one engine step of `tokens` tokens works in: the live
/// activations of one layer (residual, normed input, q/k/v, attention output, the MLP's
/// gate/up/product and a 16-bit GEMM input copy; for Qwen3-MoE also the router's logits, an
/// expert's rows, no wider than a dense MLP's, and what routing on the device keeps per
/// (token, chosen expert): the input row, gate / up, the activation and the output, as f32 at
/// most), logits for every token (prompt logprobs) and 256 MiB for the GEMM library's
/// workspace and attention partials.
pub fn step_activation_bytes(config: &ModelConfig, tokens: usize) -> usize {
    let h = config.hidden_size;
    let q = config.num_attention_heads * config.head_dim;
    let kv = config.num_key_value_heads * config.head_dim;
    let (i, moe) = match &config.moe {
        Some(m) => (
            config.intermediate_size.max(m.intermediate_size),
            4 * (m.num_experts + 2 * h) + m.top_k * (8 * h + 12 * m.intermediate_size + 12),
        ),
        None => (config.intermediate_size, 0),
    };
    let per_token =
        4 * (3 * h + 2 * q + 2 * kv + 3 * i) + 2 * i.max(h) + 4 * config.vocab_size + moe;
    tokens * per_token + (256 << 20)
}

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
    /// The prefix cache's block hash: xxhash (XXH3-128, fast; also `xxh3`) or sha256 (the
    /// first 128 bits of SHA-256: for operators who fear crafted hash collisions). The
    /// router and every node of a cluster must use the same (the router refuses a node that
    /// differs).
    #[arg(long, env = "PD_PREFIX_CACHING_HASH_ALGO", default_value_t = HashAlgo::Xxhash)]
    pub prefix_caching_hash_algo: HashAlgo,
    /// Context limit (prompt + generated); defaults to the model's max_position_embeddings.
    #[arg(long, env = "PD_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Token budget of one engine step (prefill chunks + decode tokens).
    #[arg(long, env = "PD_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    #[arg(long, env = "PD_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Where the model runs: cpu, cuda (device 0) or cuda:N (needs a build with `--features cuda`).
    #[arg(long, env = "PD_DEVICE", default_value_t = Device::Cpu)]
    pub device: Device,
    /// Fraction of the GPU's memory this node may use for weights, activations and KV
    /// together; the KV cache gets what the rest leaves (vLLM's meaning). CUDA only.
    #[arg(long, env = "PD_GPU_MEMORY_UTILIZATION", default_value_t = DEFAULT_GPU_MEMORY_UTILIZATION, value_parser = parse_fraction)]
    pub gpu_memory_utilization: f64,
    /// Replay pure decode steps from CUDA graphs captured per batch-size bucket (1, 2, 4, 8,
    /// 16, ... 128 sequences): on or off. A failed capture logs once and falls back to
    /// eager launches. CUDA only (ignored on the CPU).
    #[arg(long, env = "PD_CUDA_GRAPHS", default_value_t = CudaGraphs::Off)]
    pub cuda_graphs: CudaGraphs,
    /// How the KV cache is stored: auto (on a GPU the model's dtype, bf16 for Qwen3; on the
    /// CPU f32), f32, bf16 or f16. 16-bit types halve KV memory and attention's KV reads.
    /// Blocks move between nodes as stored, so nodes that exchange KV must store it alike.
    #[arg(long, env = "PD_KV_CACHE_DTYPE", default_value_t = KvCacheDtype::Auto)]
    pub kv_cache_dtype: KvCacheDtype,
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

    /// The CPU backend these flags ask for (its KV cache type from `--kv-cache-dtype`), its
    /// kernels on the instruction set `PD_CPU_ISA` asks for (unset: the best the host has);
    /// one the host lacks is refused.
    pub fn cpu_backend(&self) -> Result<CpuBackend, EngineError> {
        Ok(CpuBackend::from_env(self.kv_cache_dtype.on_cpu())?)
    }

    /// `--num-gpu-blocks`, or 2 GiB worth of blocks of `layout` (the CPU backend's: twice as
    /// many with a 16-bit `--kv-cache-dtype`), at most four full contexts.
    pub fn num_blocks(&self, layout: &KvLayout, max_model_len: usize) -> usize {
        self.num_gpu_blocks.unwrap_or_else(|| {
            (DEFAULT_KV_BYTES / layout.block_bytes())
                .min(4 * layout.blocks_for(max_model_len))
                .max(1)
        })
    }

    /// Device memory an engine built from these flags works in besides its weights and KV:
    /// one step of `max(--max-num-batched-tokens, --max-num-seqs)` tokens
    /// ([`step_activation_bytes`]) and, with `--cuda-graphs on`, the graphs' own buffers,
    /// which stay allocated beside the eager ones: at most one step of the largest bucket
    /// (the graphs replay one at a time and share them).
    pub fn activation_reserve_bytes(&self, config: &ModelConfig, max_model_len: usize) -> usize {
        let step =
            step_activation_bytes(config, self.max_num_batched_tokens.max(self.max_num_seqs));
        let graphs = match self.cuda_graphs {
            CudaGraphs::Off => 0,
            CudaGraphs::On => {
                let graphs = DecodeGraphs::new(self.max_num_seqs, max_model_len, self.block_size);
                step_activation_bytes(config, graphs.max_batch)
            }
        };
        step + graphs
    }

    /// KV blocks on `backend`, whose weights are already loaded: `--num-gpu-blocks` if given;
    /// else on a device what `--gpu-memory-utilization` leaves after the weights and the
    /// working memory ([`EngineArgs::activation_reserve_bytes`]), refused if that cannot
    /// hold one `max_model_len` sequence (as vLLM refuses); else (the CPU)
    /// [`EngineArgs::num_blocks`].
    pub fn num_blocks_on<B: Backend>(
        &self,
        backend: &B,
        config: &ModelConfig,
        layout: &KvLayout,
        max_model_len: usize,
    ) -> Result<usize, EngineError> {
        if let Some(n) = self.num_gpu_blocks {
            return Ok(n);
        }
        let reserve = self.activation_reserve_bytes(config, max_model_len);
        match backend.kv_memory_budget(reserve)? {
            None => Ok(self.num_blocks(layout, max_model_len)),
            Some(bytes) => {
                let blocks = bytes / layout.block_bytes();
                let needed = layout.blocks_for(max_model_len);
                if blocks < needed {
                    return Err(EngineError::OutOfBlocks(format!(
                        "{} has room for {blocks} KV blocks ({} MiB) but one sequence of \
                         --max-model-len {max_model_len} needs {needed}; raise \
                         --gpu-memory-utilization or lower --max-model-len",
                        backend.name(),
                        bytes >> 20
                    )));
                }
                Ok(blocks)
            }
        }
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
        let layout = KvLayout::new(&files.config, self.block_size, self.kv_cache_dtype.on_cpu())?;
        let num_blocks = self.num_blocks(&layout, max_model_len);
        self.build_on(
            files,
            self.cpu_backend()?,
            model,
            num_blocks,
            role,
            seed,
            lease_timeout,
        )
    }

    /// An engine of `role` on `backend` (holding `model`'s weights) with `num_blocks` KV
    /// blocks (from [`EngineArgs::num_blocks_on`]).
    #[allow(clippy::too_many_arguments)]
    pub fn build_on<B: Backend>(
        &self,
        files: &ModelFiles,
        backend: B,
        model: Qwen3<B>,
        num_blocks: usize,
        role: Role,
        seed: u64,
        lease_timeout: Duration,
    ) -> Result<Engine<B>, EngineError> {
        let max_model_len = self.max_model_len(&files.config)?;
        let mut executor = Executor::new(backend, model, self.block_size, num_blocks)?;
        if self.cuda_graphs == CudaGraphs::On {
            executor.set_decode_graphs(Some(DecodeGraphs::new(
                self.max_num_seqs,
                max_model_len,
                self.block_size,
            )));
        }
        let config = EngineConfig {
            role,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            hash_algo: self.prefix_caching_hash_algo,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda { ordinal: 0 }));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda { ordinal: 3 }));
        assert_eq!(Device::Cuda { ordinal: 3 }.to_string(), "cuda:3");
        let err = "gpu".parse::<Device>().unwrap_err();
        assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
        assert!("cuda:x".parse::<Device>().is_err());
    }

    #[test]
    fn cuda_graphs_parse_and_print() {
        assert_eq!("on".parse::<CudaGraphs>(), Ok(CudaGraphs::On));
        assert_eq!("off".parse::<CudaGraphs>(), Ok(CudaGraphs::Off));
        assert_eq!(CudaGraphs::default(), CudaGraphs::Off);
        assert_eq!(CudaGraphs::On.to_string(), "on");
        let err = "yes".parse::<CudaGraphs>().unwrap_err();
        assert!(err.contains("expected on or off"), "{err}");
    }

    #[test]
    fn kv_cache_dtypes_parse_print_and_map_to_storage_types() {
        assert_eq!("auto".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Auto));
        assert_eq!("bfloat16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Bf16));
        assert_eq!("f16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::F16));
        assert_eq!(KvCacheDtype::Bf16.to_string(), "bf16");
        assert_eq!(KvCacheDtype::Auto.on_device(), None);
        assert_eq!(KvCacheDtype::F16.on_device(), Some(DType::F16));
        let err = "fp8".parse::<KvCacheDtype>().unwrap_err();
        assert!(err.contains("expected auto, f32, bf16 or f16"), "{err}");
        assert_eq!(KvCacheDtype::Auto.on_cpu(), DType::F32);
        assert_eq!(KvCacheDtype::Bf16.on_cpu(), DType::BF16);
        assert_eq!(KvCacheDtype::F16.on_cpu(), DType::F16);
    }

    /// The engine flags of a command line of `flags`.
    fn parse(flags: &[&str]) -> EngineArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        <Cli as clap::Parser>::try_parse_from(["test"].iter().chain(flags))
            .expect("flags")
            .engine
    }

    #[test]
    fn decode_graphs_reserve_device_memory_for_their_largest_bucket() {
        let config = crate::model::ModelSource::parse("synthetic:qwen3-0.6b")
            .and_then(|m| m.open_metadata())
            .expect("preset")
            .config;
        let step = step_activation_bytes(&config, 2048);
        assert_eq!(parse(&[]).activation_reserve_bytes(&config, 4096), step);
        // The graphs' buffers sit beside the eager step's: the largest bucket (128 rows of
        // the default 256 sequences; 16 of 20) is set aside on top.
        assert_eq!(
            parse(&["--cuda-graphs", "on"]).activation_reserve_bytes(&config, 4096),
            step + step_activation_bytes(&config, 128)
        );
        assert_eq!(
            parse(&["--cuda-graphs", "on", "--max-num-seqs", "20"])
                .activation_reserve_bytes(&config, 4096),
            step + step_activation_bytes(&config, 16)
        );
        // A step of more sequences than batched tokens is sized by the sequences.
        assert_eq!(
            parse(&["--max-num-seqs", "4096"]).activation_reserve_bytes(&config, 4096),
            step_activation_bytes(&config, 4096)
        );
    }

    #[test]
    fn a_16_bit_kv_cache_on_the_cpu_holds_twice_the_blocks_by_default() {
        let layout = |dtype| KvLayout {
            num_layers: 28,
            num_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            dtype,
        };
        let args = |dtype: &str| parse(&["--kv-cache-dtype", dtype]);
        // The layout of the backend the flags ask for, as the nodes build it.
        let blocks = |dtype: &str| {
            let a = args(dtype);
            a.num_blocks(&layout(a.cpu_backend().unwrap().kv_dtype()), 1 << 20)
        };
        let f32_blocks = blocks("auto");
        assert_eq!(
            f32_blocks,
            DEFAULT_KV_BYTES / layout(DType::F32).block_bytes()
        );
        assert_eq!(blocks("f16"), 2 * f32_blocks);
        assert_eq!(blocks("bf16"), 2 * f32_blocks);
        assert_eq!(args("bf16").cpu_backend().unwrap().kv_dtype(), DType::BF16);
    }

    #[test]
    fn memory_utilization_is_a_fraction() {
        assert_eq!(parse_fraction("0.9"), Ok(0.9));
        assert_eq!(parse_fraction("1"), Ok(1.0));
        assert!(parse_fraction("0").is_err());
        assert!(parse_fraction("1.5").is_err());
        assert!(parse_fraction("lots").is_err());
    }
}
