//! Writing safetensors checkpoints through the `safetensors` crate: one file, or shards plus
//! `model.safetensors.index.json` as transformers lays them out. Tensor bytes are produced
//! lazily, one tensor at a time, so multi-GiB checkpoints are written without holding them
//! in memory.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use crate::error::EngineError;
use crate::weights::{DType, INDEX_FILE, SINGLE_FILE};

/// A tensor to write: its bytes come from `fill` when the writer reaches it.
pub struct TensorSpec<'a> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub fill: Box<dyn Fn() -> Vec<u8> + Send + Sync + 'a>,
}

impl TensorSpec<'_> {
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_in_bytes()
    }
}

impl safetensors::View for &TensorSpec<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let bytes = (self.fill)();
        assert_eq!(
            bytes.len(),
            self.byte_len(),
            "tensor {} filled with the wrong length",
            self.name
        );
        Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        self.byte_len()
    }
}

/// Write `tensors` into `dir`: one `model.safetensors` if they fit in `max_shard_bytes`,
/// otherwise `model-0000i-of-0000n.safetensors` shards and the index file.
/// `on_tensor` is called after each tensor's bytes are produced (progress reporting).
pub fn write_checkpoint(
    dir: &Path,
    tensors: &[TensorSpec<'_>],
    max_shard_bytes: usize,
    on_tensor: &(dyn Fn(usize) + Sync),
) -> Result<(), EngineError> {
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let mut shards: Vec<Vec<&TensorSpec<'_>>> = vec![Vec::new()];
    let mut size = 0;
    for t in tensors {
        if size > 0 && size + t.byte_len() > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += t.byte_len();
        shards.last_mut().expect("one shard").push(t);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let path = dir.join(&file);
        let views = shard.iter().map(|t| {
            on_tensor(t.byte_len());
            (t.name.clone(), *t)
        });
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| {
            EngineError::Checkpoint {
                path: path.clone(),
                message: format!("writing failed: {e}"),
            }
        })?;
        for t in shard {
            weight_map.insert(t.name.clone(), file.clone());
        }
    }
    if n > 1 {
        let total: usize = tensors.iter().map(TensorSpec::byte_len).sum();
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        std::fs::write(&path, serde_json::to_vec_pretty(&index).expect("json"))
            .map_err(|e| EngineError::io(&path, e))?;
    }
    Ok(())
}
