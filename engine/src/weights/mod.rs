//! Checkpoint weights: memory-mapped safetensors files (single or sharded through
//! `model.safetensors.index.json`), read in place. A [`TensorView`] keeps its file mapped and
//! points at the tensor's bytes; nothing is copied or converted here. Writing checkpoints
//! (for `synthetic:` models and tests) lives in [`writer`].

mod dtype;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::SafeTensors;

pub use dtype::DType;

use crate::error::EngineError;

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One memory-mapped safetensors file.
#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
struct TensorEntry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A tensor's bytes inside a mapped file, in its stored dtype. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TensorView {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    file: Arc<MappedFile>,
    start: usize,
    end: usize,
}

impl TensorView {
    /// The raw little-endian bytes (not necessarily aligned).
    pub fn bytes(&self) -> &[u8] {
        &self.file.map[self.start..self.end]
    }

    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The file this tensor was read from.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// Every element as `f32` (tests and small vectors only).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let bytes = self.bytes();
        (0..self.num_elements())
            .map(|i| self.dtype.read_f32(bytes, i))
            .collect()
    }
}

/// All tensors of a checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<Arc<MappedFile>>,
    tensors: HashMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Map `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        let (file_names, weight_map) = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| EngineError::io(&index_path, e))?;
            let map = parse_index(&text).map_err(|message| EngineError::Checkpoint {
                path: index_path.clone(),
                message,
            })?;
            let mut files: Vec<String> = map.values().cloned().collect();
            files.sort();
            files.dedup();
            (files, Some(map))
        } else if single_path.exists() {
            (vec![SINGLE_FILE.to_string()], None)
        } else {
            return Err(EngineError::Checkpoint {
                path: dir.to_path_buf(),
                message: format!("no {SINGLE_FILE} or {INDEX_FILE} in this directory"),
            });
        };

        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for (file_idx, name) in file_names.iter().enumerate() {
            if name.contains('/') || name.contains("..") {
                return Err(EngineError::Checkpoint {
                    path: index_path.clone(),
                    message: format!("shard name {name:?} must be a file in the model directory"),
                });
            }
            let path = dir.join(name);
            let file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
            // SAFETY: the mapping is read-only and lives as long as every view into it (Arc).
            // A checkpoint modified on disk while being served is outside what we support,
            // as for every engine that mmaps weights.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
            let parsed = SafeTensors::deserialize(&map).map_err(|e| EngineError::Checkpoint {
                path: path.clone(),
                message: format!("not a valid safetensors file: {e}"),
            })?;
            let base = map.as_ptr() as usize;
            for (tensor_name, view) in parsed.iter() {
                let dtype = match view.dtype() {
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::BF16 => DType::BF16,
                    other => {
                        return Err(EngineError::Tensor {
                            path: path.clone(),
                            tensor: tensor_name.to_string(),
                            message: format!(
                                "dtype {other:?} is not supported (use bf16, f16 or f32)"
                            ),
                        });
                    }
                };
                if let Some(map) = &weight_map
                    && map.get(tensor_name) != Some(name)
                {
                    // A tensor the index does not assign to this shard is ignored, as
                    // transformers does; the index is the source of truth.
                    continue;
                }
                let start = view.data().as_ptr() as usize - base;
                let entry = TensorEntry {
                    file: file_idx,
                    dtype,
                    shape: view.shape().to_vec(),
                    start,
                    end: start + view.data().len(),
                };
                tensors.insert(tensor_name.to_string(), entry);
            }
            files.push(Arc::new(MappedFile { path, map }));
        }
        if let Some(map) = &weight_map {
            for (tensor, file) in map {
                if !tensors.contains_key(tensor) {
                    return Err(EngineError::Tensor {
                        path: dir.join(file),
                        tensor: tensor.clone(),
                        message: format!("listed in {INDEX_FILE} but missing from the shard"),
                    });
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            tensors,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorView, EngineError> {
        let entry = self.tensors.get(name).ok_or_else(|| EngineError::Tensor {
            path: self.describe_files(),
            tensor: name.to_string(),
            message: "missing from the checkpoint".into(),
        })?;
        let file = &self.files[entry.file];
        if entry.shape != shape {
            return Err(EngineError::Tensor {
                path: file.path.clone(),
                tensor: name.to_string(),
                message: format!("has shape {:?}, expected {:?}", entry.shape, shape),
            });
        }
        Ok(TensorView {
            name: name.to_string(),
            dtype: entry.dtype,
            shape: entry.shape.clone(),
            file: Arc::clone(file),
            start: entry.start,
            end: entry.end,
        })
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.end - t.start).sum()
    }

    fn describe_files(&self) -> PathBuf {
        if self.files.len() == 1 {
            self.files[0].path.clone()
        } else {
            self.dir.join(INDEX_FILE)
        }
    }
}

/// `{"weight_map": {"tensor": "shard-file", ...}}`.
fn parse_index(text: &str) -> Result<BTreeMap<String, String>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("missing object `weight_map`")?;
    map.iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|f| (k.clone(), f.to_string()))
                .ok_or_else(|| format!("weight_map[{k:?}] is not a file name"))
        })
        .collect()
}
