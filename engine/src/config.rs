//! `config.json` of a Hugging Face Qwen3 checkpoint: parsed, then validated into a
//! [`ModelConfig`] the rest of the engine trusts. Anything this engine does not implement
//! (other architectures, MoE, rope scaling, sliding window, attention bias) is refused here,
//! naming the field, so a model is never served with silently wrong math.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::EngineError;
use crate::weights::DType;

/// A validated Qwen3 dense configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub vocab_size: usize,
    pub dtype: DType,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The raw file, as loosely as transformers writes it (4.x and 5.x spellings).
#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    vocab_size: Option<usize>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    use_sliding_window: Option<bool>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    layer_types: Option<Vec<String>>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
}

impl ModelConfig {
    /// Read and validate `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Validate the text of a `config.json`; `path` only names the file in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, EngineError> {
        let err = |field: &str, message: String| EngineError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| err("<file>", format!("not a valid config.json: {e}")))?;

        let arch = raw.architectures.clone().unwrap_or_default();
        let model_type = raw.model_type.clone().unwrap_or_default();
        if model_type == "qwen3_moe" || arch.iter().any(|a| a.contains("Moe")) {
            return Err(err(
                "architectures",
                format!("{arch:?} is Qwen3-MoE, which this engine does not implement"),
            ));
        }
        if !arch.iter().any(|a| a == "Qwen3ForCausalLM") && model_type != "qwen3" {
            return Err(err(
                "architectures",
                format!(
                    "{arch:?} (model_type {model_type:?}) is not supported; only Qwen3ForCausalLM is"
                ),
            ));
        }
        if raw.use_sliding_window == Some(true) {
            return Err(err(
                "use_sliding_window",
                "sliding-window attention is not supported".into(),
            ));
        }
        if raw.attention_bias == Some(true) {
            return Err(err(
                "attention_bias",
                "attention biases are not supported (Qwen3 has none)".into(),
            ));
        }
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(err(
                "hidden_act",
                format!("{act:?} is not supported; only \"silu\" is"),
            ));
        }
        if let Some(kind) = raw
            .layer_types
            .iter()
            .flatten()
            .find(|t| t.as_str() != "full_attention")
        {
            return Err(err(
                "layer_types",
                format!("{kind:?} layers are not supported; only full_attention"),
            ));
        }
        check_rope_scaling(raw.rope_scaling.as_ref(), "rope_scaling")
            .map_err(|m| err("rope_scaling", m))?;
        let mut rope_theta = raw.rope_theta;
        if let Some(params) = &raw.rope_parameters {
            check_rope_scaling(Some(params), "rope_parameters")
                .map_err(|m| err("rope_parameters", m))?;
            if let Some(t) = params.get("rope_theta").and_then(Value::as_f64) {
                rope_theta = Some(t);
            }
        }

        let need = |v: Option<usize>, field: &str| -> Result<usize, EngineError> {
            match v {
                Some(0) => Err(err(field, "must be > 0".into())),
                Some(v) => Ok(v),
                None => Err(err(field, "is missing".into())),
            }
        };
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let intermediate_size = need(raw.intermediate_size, "intermediate_size")?;
        let num_hidden_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
        let num_attention_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = need(
            raw.num_key_value_heads.or(Some(num_attention_heads)),
            "num_key_value_heads",
        )?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"
                ),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => need(Some(d), "head_dim")?,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(err(
                    "head_dim",
                    "is missing and hidden_size is not divisible by num_attention_heads".into(),
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(err(
                "head_dim",
                format!("{head_dim} must be even for rotary embeddings"),
            ));
        }
        let vocab_size = need(raw.vocab_size, "vocab_size")?;
        if vocab_size > u32::MAX as usize {
            return Err(err("vocab_size", format!("{vocab_size} is too large")));
        }
        let max_position_embeddings = need(raw.max_position_embeddings, "max_position_embeddings")?;
        let rope_theta = rope_theta.unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(err(
                "rope_theta",
                format!("{rope_theta} must be a finite number > 1"),
            ));
        }
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(err("rms_norm_eps", format!("{rms_norm_eps} must be > 0")));
        }
        let dtype_name = raw
            .torch_dtype
            .or(raw.dtype)
            .unwrap_or_else(|| "bfloat16".to_string());
        let dtype = DType::from_torch_name(&dtype_name).ok_or_else(|| {
            err(
                "torch_dtype",
                format!("{dtype_name:?} is not supported; use bfloat16, float16 or float32"),
            )
        })?;
        let token_id = |v: &Value, field: &str| -> Result<u32, EngineError> {
            v.as_u64()
                .filter(|&id| (id as usize) < vocab_size)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    err(
                        field,
                        format!("{v} is not a token id below vocab_size {vocab_size}"),
                    )
                })
        };
        let bos_token_id = match &raw.bos_token_id {
            None | Some(Value::Null) => None,
            Some(v) => Some(token_id(v, "bos_token_id")?),
        };
        let eos_token_ids = parse_eos(raw.eos_token_id.as_ref(), &token_id, "eos_token_id")?;

        Ok(ModelConfig {
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta,
            rms_norm_eps: rms_norm_eps as f32,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            vocab_size,
            dtype,
            bos_token_id,
            eos_token_ids,
        })
    }

    /// Total parameter count (embedding counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let per_layer =
            h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h + 2 * self.head_dim;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + self.num_hidden_layers * per_layer + h
    }
}

/// `eos_token_id` may be one id or a list of ids.
pub(crate) fn parse_eos(
    v: Option<&Value>,
    token_id: &dyn Fn(&Value, &str) -> Result<u32, EngineError>,
    field: &str,
) -> Result<Vec<u32>, EngineError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(ids)) => ids.iter().map(|id| token_id(id, field)).collect(),
        Some(id) => Ok(vec![token_id(id, field)?]),
    }
}

/// Only plain rotary embeddings are implemented: no scaling block, or `rope_type` "default".
fn check_rope_scaling(v: Option<&Value>, field: &str) -> Result<(), String> {
    let Some(v) = v else { return Ok(()) };
    if v.is_null() {
        return Ok(());
    }
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    if kind == "default" {
        Ok(())
    } else {
        Err(format!(
            "{field} of type {kind:?} is not implemented; only plain RoPE (no scaling) is supported"
        ))
    }
}

/// `generation_config.json`: only what changes generation here (EOS ids).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
}

impl GenerationConfig {
    /// Read `generation_config.json` if present; a missing file is an empty config.
    pub fn from_dir(dir: &Path, vocab_size: usize) -> Result<Self, EngineError> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let err = |field: &str, message: String| EngineError::Config {
            path: path.clone(),
            field: field.to_string(),
            message,
        };
        let raw: Value = serde_json::from_str(&text)
            .map_err(|e| err("<file>", format!("not valid JSON: {e}")))?;
        let token_id = |v: &Value, field: &str| -> Result<u32, EngineError> {
            v.as_u64()
                .filter(|&id| (id as usize) < vocab_size)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    err(
                        field,
                        format!("{v} is not a token id below vocab_size {vocab_size}"),
                    )
                })
        };
        Ok(Self {
            eos_token_ids: parse_eos(raw.get("eos_token_id"), &token_id, "eos_token_id")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
            "tie_word_embeddings": true, "vocab_size": 512, "torch_dtype": "float32",
            "eos_token_id": 3
        })
    }

    fn parse(v: &Value) -> Result<ModelConfig, EngineError> {
        ModelConfig::from_json(&v.to_string(), Path::new("m/config.json"))
    }

    fn refused_field(v: &Value) -> String {
        match parse(v) {
            Err(EngineError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn parses_a_qwen3_config() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.head_dim, 32);
        assert_eq!(c.dtype, DType::F32);
        assert_eq!(c.eos_token_ids, vec![3]);
    }

    #[test]
    fn refuses_what_is_not_implemented_naming_the_field() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        v["model_type"] = serde_json::json!("llama");
        assert_eq!(refused_field(&v), "architectures");
        let mut v = base();
        v["model_type"] = serde_json::json!("qwen3_moe");
        assert_eq!(refused_field(&v), "architectures");
        let mut v = base();
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        assert_eq!(refused_field(&v), "rope_scaling");
        let mut v = base();
        v["use_sliding_window"] = serde_json::json!(true);
        assert_eq!(refused_field(&v), "use_sliding_window");
        let mut v = base();
        v["num_key_value_heads"] = serde_json::json!(3);
        assert_eq!(refused_field(&v), "num_key_value_heads");
        let mut v = base();
        v["torch_dtype"] = serde_json::json!("float8_e4m3fn");
        assert_eq!(refused_field(&v), "torch_dtype");
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert_eq!(refused_field(&v), "hidden_size");
        let mut v = base();
        v["eos_token_id"] = serde_json::json!(100000);
        assert_eq!(refused_field(&v), "eos_token_id");
    }

    #[test]
    fn accepts_transformers_5_spelling() {
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("torch_dtype");
        o.insert("dtype".into(), serde_json::json!("bfloat16"));
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 1000000.0}),
        );
        let c = parse(&v).unwrap();
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.dtype, DType::BF16);
    }
}
