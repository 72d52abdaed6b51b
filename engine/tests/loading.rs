//! Loading checkpoints the way they come: single or sharded safetensors, bf16 / f16 / f32,
//! and refusals that name the file and tensor at fault. Checkpoints are written through the
//! product's writer from the transformers golden fixture and must give its logits.

use std::path::{Path, PathBuf};

use pd_engine::EngineError;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::generate::{Runner, Sequence, StepItem};
use pd_engine::model::{ModelFiles, ModelSource, Qwen3};
use pd_engine::synthetic::{self, Preset};
use pd_engine::weights::writer::{TensorSpec, write_checkpoint};
use pd_engine::weights::{Checkpoint, DType};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa")
}

/// Every tensor of the golden checkpoint, re-encoded as `dtype`.
fn specs(dtype: DType) -> Vec<TensorSpec<'static>> {
    specs_rounded(dtype, dtype)
}

/// Every tensor of the golden checkpoint rounded through `round` and stored as `dtype`.
fn specs_rounded(round: DType, dtype: DType) -> Vec<TensorSpec<'static>> {
    let ckpt = Checkpoint::open(&golden_dir()).unwrap();
    let bytes = std::fs::read(golden_dir().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let shape = st.tensor(&name).unwrap().shape().to_vec();
            let values: Vec<f32> = ckpt
                .tensor(&name, &shape)
                .unwrap()
                .to_f32_vec()
                .into_iter()
                .map(|v| match round {
                    DType::F32 => v,
                    DType::F16 => half::f16::from_f32(v).to_f32(),
                    DType::BF16 => half::bf16::from_f32(v).to_f32(),
                })
                .collect();
            TensorSpec {
                name,
                dtype,
                shape,
                fill: Box::new(move || {
                    values
                        .iter()
                        .flat_map(|&v| match dtype {
                            DType::F32 => v.to_le_bytes().to_vec(),
                            DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                            DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                        })
                        .collect()
                }),
            }
        })
        .collect()
}

fn write(dir: &Path, dtype: DType, shard_bytes: usize) {
    write_specs(dir, &specs(dtype), dtype, shard_bytes);
}

fn write_specs(dir: &Path, specs: &[TensorSpec<'_>], dtype: DType, shard_bytes: usize) {
    write_checkpoint(dir, specs, shard_bytes, &|_| {}).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden_dir().join("config.json")).unwrap()).unwrap();
    config["dtype"] = serde_json::json!(dtype.torch_name());
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// Logits of the last position of a fixed prompt.
fn last_logits(dir: &Path) -> Vec<f32> {
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = Qwen3::load(&CpuBackend::new(), &ckpt, &config, &mut |_, _| {}).unwrap();
    let mut runner = Runner::new(CpuBackend::new(), model, 16, 8).unwrap();
    let mut seq = Sequence::new(vec![3, 14, 15, 92, 65, 35, 89, 79]);
    let out = runner
        .step(&mut [StepItem {
            seq: &mut seq,
            count: 8,
            all_logits: false,
        }])
        .unwrap();
    out[0].data.clone()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().map(|v| v.abs()).fold(0.0, f32::max);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let want = last_logits(&golden_dir());
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), DType::F32, 200_000);
    assert!(tmp.path().join("model.safetensors.index.json").exists());
    assert!(!tmp.path().join("model.safetensors").exists());
    let shards = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("model-0")
        })
        .count();
    assert!(shards >= 3, "{shards} shards");
    assert_eq!(
        last_logits(tmp.path()),
        want,
        "sharding must not change a single bit"
    );
}

#[test]
fn f16_and_bf16_weights_are_read_exactly() {
    for dtype in [DType::F16, DType::BF16] {
        // The same values stored in f32: the half-precision path must compute the same.
        let reference = tempfile::tempdir().unwrap();
        write_specs(
            reference.path(),
            &specs_rounded(dtype, DType::F32),
            DType::F32,
            usize::MAX,
        );
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), dtype, usize::MAX);
        let ckpt = Checkpoint::open(tmp.path()).unwrap();
        assert_eq!(
            ckpt.tensor("model.norm.weight", &[96]).unwrap().dtype,
            dtype
        );
        let rel = max_rel(&last_logits(tmp.path()), &last_logits(reference.path()));
        assert!(rel < 1e-5, "{dtype}: relative error {rel}");
    }
}

#[test]
fn refusals_name_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    // A shard listed in the index but missing on disk.
    write(tmp.path(), DType::F32, 200_000);
    let shard = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("model-00002-of-"))
        .unwrap();
    std::fs::remove_file(tmp.path().join(&shard)).unwrap();
    let err = Checkpoint::open(tmp.path()).unwrap_err().to_string();
    assert!(err.contains(&shard), "{err}");

    // A truncated file.
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), DType::F32, usize::MAX);
    let path = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let err = Checkpoint::open(tmp.path()).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );

    // A missing tensor and a misshaped one.
    let tmp = tempfile::tempdir().unwrap();
    let mut s = specs(DType::F32);
    s.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
    write_checkpoint(tmp.path(), &s, usize::MAX, &|_| {}).unwrap();
    let config = ModelConfig::from_file(&golden_dir().join("config.json")).unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let err = Qwen3::load(&CpuBackend::new(), &ckpt, &config, &mut |_, _| {}).unwrap_err();
    assert!(
        matches!(&err, EngineError::Tensor { tensor, .. } if tensor == "model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );
    let mut bigger = config.clone();
    bigger.intermediate_size += 1;
    let ckpt = Checkpoint::open(&golden_dir()).unwrap();
    let err = Qwen3::load(&CpuBackend::new(), &ckpt, &bigger, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("shape"),
        "{err}"
    );

    // No checkpoint at all.
    let empty = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(empty.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn synthetic_models_go_through_the_real_files() {
    let cache = tempfile::tempdir().unwrap();
    let dir = synthetic::materialize(Preset::Tiny, 3, cache.path(), &|_, _| {}).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        assert!(dir.join(f).exists(), "{f}");
    }
    let files = ModelFiles::open(&dir).unwrap();
    assert_eq!(files.config.num_key_value_heads, 2);
    assert!(files.config.tie_word_embeddings);
    assert_eq!(files.eos_token_ids(), vec![151645, 151643]);
    // The metadata-only view of a preset (what the router loads) equals the written files.
    let meta = ModelSource::parse("synthetic:tiny")
        .unwrap()
        .open_metadata()
        .unwrap();
    assert_eq!(meta.config, files.config);
    assert_eq!(meta.eos_token_ids(), files.eos_token_ids());
    // Seeded: the same seed gives the same bytes, another seed other bytes.
    let again = tempfile::tempdir().unwrap();
    let same = synthetic::materialize(Preset::Tiny, 3, again.path(), &|_, _| {}).unwrap();
    let other = synthetic::materialize(Preset::Tiny, 4, again.path(), &|_, _| {}).unwrap();
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(bytes(&dir), bytes(&same));
    assert_ne!(bytes(&dir), bytes(&other));
    // The real shapes are what the presets claim.
    let cfg =
        |p: Preset| ModelConfig::from_json(&p.config_json().to_string(), Path::new("x")).unwrap();
    let small = cfg(Preset::Qwen3_0_6B);
    assert_eq!(
        (
            small.num_hidden_layers,
            small.hidden_size,
            small.num_key_value_heads
        ),
        (28, 1024, 8)
    );
    assert!((590_000_000..610_000_000).contains(&small.num_parameters()));
    let big = cfg(Preset::Qwen3_8B);
    assert!((8_100_000_000..8_300_000_000).contains(&big.num_parameters()));
    // Qwen3-30B-A3B: 30.5B parameters, 3.3B of them active per token (its model card).
    let moe = cfg(Preset::Qwen3_30BA3B);
    assert!((30_400_000_000..30_600_000_000).contains(&moe.num_parameters()));
    assert!((3_300_000_000..3_400_000_000).contains(&moe.num_active_parameters()));
    assert!(matches!(
        ModelSource::parse("synthetic:qwen3-9b"),
        Err(EngineError::UnknownSynthetic { .. })
    ));
}

/// A Qwen3-MoE checkpoint loads its routers and experts where the config says layers are
/// sparse and dense MLPs elsewhere; a config that disagrees with the files is refused naming
/// the tensor.
#[test]
fn qwen3_moe_checkpoints_load_their_experts_and_refuse_a_mismatch() {
    let cache = tempfile::tempdir().unwrap();
    let dir = synthetic::materialize(Preset::TinyMoe, 0, cache.path(), &|_, _| {}).unwrap();
    let files = ModelFiles::open(&dir).unwrap();
    let moe = files.config.moe.clone().expect("a MoE config");
    assert_eq!(moe.sparse_layers, vec![true, false, true]);
    let ckpt = Checkpoint::open(&dir).unwrap();
    // Every tensor of the files is read: none is left over unread.
    let mut read = 0;
    let model = Qwen3::load(&CpuBackend::new(), &ckpt, &files.config, &mut |done, _| {
        read = done
    })
    .unwrap();
    assert_eq!(read, ckpt.total_bytes());
    // A decode step reads 2 of each sparse layer's 8 experts (and no norm vectors, which
    // the parameter count includes).
    let unread_experts = 2 * (8 - 2) * 3 * 64 * 64;
    let norms = 3 * (2 * 64 + 2 * 32) + 64;
    assert_eq!(
        files.config.num_parameters() * 4 - model.weight_bytes_per_step(),
        (unread_experts + norms) * 4
    );
    assert_eq!(
        files.config.num_parameters() - files.config.num_active_parameters(),
        unread_experts
    );

    let refused = |config: &ModelConfig| {
        Qwen3::load(&CpuBackend::new(), &ckpt, config, &mut |_, _| {})
            .unwrap_err()
            .to_string()
    };
    // One expert more than the files hold: the router's shape is wrong.
    let mut more = files.config.clone();
    more.moe.as_mut().unwrap().num_experts = 9;
    let err = refused(&more);
    assert!(
        err.contains("model.layers.0.mlp.gate.weight") && err.contains("shape"),
        "{err}"
    );
    // Layer 1 declared sparse, but the files hold a dense MLP there.
    let mut all_sparse = files.config.clone();
    all_sparse.moe.as_mut().unwrap().sparse_layers = vec![true; 3];
    let err = refused(&all_sparse);
    assert!(err.contains("model.layers.1.mlp.gate.weight"), "{err}");
    // Read as a dense Qwen3, the sparse layers' dense MLP tensors are missing.
    let mut dense = files.config.clone();
    dense.moe = None;
    let err = refused(&dense);
    assert!(err.contains("model.layers.0.mlp.gate_proj.weight"), "{err}");
}
