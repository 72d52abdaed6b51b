//! Which model to serve and loading it: a `--model` value (a Hugging Face directory or a
//! `synthetic:` preset) resolved to a directory, its configs, tokenizer and weights.

mod qwen3;

use std::path::{Path, PathBuf};

pub use qwen3::Qwen3;

use crate::backend::Backend;
use crate::config::{GenerationConfig, ModelConfig};
use crate::error::EngineError;
use crate::synthetic::{self, Preset};
use crate::tokenizer::Tokenizer;
use crate::weights::Checkpoint;

pub const SYNTHETIC_PREFIX: &str = "synthetic:";

/// A `--model` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Dir(PathBuf),
    Synthetic { preset: Preset, seed: u64 },
}

impl ModelSource {
    /// `synthetic:NAME` or a directory path. Unknown presets are refused here.
    pub fn parse(value: &str) -> Result<Self, EngineError> {
        match value.strip_prefix(SYNTHETIC_PREFIX) {
            Some(name) => Ok(ModelSource::Synthetic {
                preset: Preset::from_name(name)?,
                seed: synthetic::DEFAULT_SEED,
            }),
            None => Ok(ModelSource::Dir(PathBuf::from(value))),
        }
    }

    /// The name models are served under (`model_name` in metrics and the API).
    pub fn served_name(&self) -> String {
        match self {
            ModelSource::Dir(dir) => dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| dir.display().to_string()),
            ModelSource::Synthetic { preset, .. } => format!("{SYNTHETIC_PREFIX}{}", preset.name()),
        }
    }

    /// The model directory, materialising a synthetic model if needed.
    pub fn resolve(
        &self,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<PathBuf, EngineError> {
        match self {
            ModelSource::Dir(dir) => {
                if !dir.is_dir() {
                    return Err(EngineError::Checkpoint {
                        path: dir.clone(),
                        message: "model directory does not exist".into(),
                    });
                }
                Ok(dir.clone())
            }
            ModelSource::Synthetic { preset, seed } => {
                synthetic::materialize(*preset, *seed, &synthetic::cache_dir(), progress)
            }
        }
    }
}

impl ModelSource {
    /// Config, generation config and tokenizer without the weights: what the router needs.
    /// A synthetic preset is described from memory (nothing written); a directory is read.
    pub fn open_metadata(&self) -> Result<ModelFiles, EngineError> {
        match self {
            ModelSource::Dir(dir) => ModelFiles::open(dir),
            ModelSource::Synthetic { preset, .. } => {
                let name = format!("{SYNTHETIC_PREFIX}{}", preset.name());
                let config =
                    ModelConfig::from_json(&preset.config_json().to_string(), Path::new(&name))?;
                let tokenizer = Tokenizer::qwen3()?;
                Ok(ModelFiles {
                    dir: PathBuf::from(name),
                    generation: GenerationConfig {
                        eos_token_ids: synthetic::GENERATION_EOS.to_vec(),
                    },
                    config,
                    tokenizer,
                })
            }
        }
    }
}

/// A model directory's metadata, validated: config, generation config and tokenizer.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub generation: GenerationConfig,
    pub tokenizer: Tokenizer,
}

impl ModelFiles {
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let generation = GenerationConfig::from_dir(dir, config.vocab_size)?;
        if !dir.join("tokenizer.json").exists() {
            return Err(EngineError::Checkpoint {
                path: dir.join("tokenizer.json"),
                message: "missing: the model directory needs its tokenizer".into(),
            });
        }
        let tokenizer = Tokenizer::from_dir(dir)?;
        if tokenizer.vocab_size() > config.vocab_size {
            return Err(EngineError::Config {
                path: dir.join("config.json"),
                field: "vocab_size".into(),
                message: format!(
                    "{} is smaller than the tokenizer's {} tokens",
                    config.vocab_size,
                    tokenizer.vocab_size()
                ),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            generation,
            tokenizer,
        })
    }

    /// Token ids that end generation: generation_config.json's, else config.json's, else the
    /// tokenizer's EOS token.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        if !self.generation.eos_token_ids.is_empty() {
            return self.generation.eos_token_ids.clone();
        }
        if !self.config.eos_token_ids.is_empty() {
            return self.config.eos_token_ids.clone();
        }
        self.tokenizer.eos_token_id().into_iter().collect()
    }

    /// Map the checkpoint and load the weights onto `backend`.
    pub fn load_weights<B: Backend>(
        &self,
        backend: &B,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Qwen3<B>, EngineError> {
        let ckpt = Checkpoint::open(&self.dir)?;
        Qwen3::load(backend, &ckpt, &self.config, progress)
    }
}
