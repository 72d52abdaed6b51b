//! `config.json` of a Hugging Face Qwen3 or Qwen3-MoE checkpoint: parsed, then validated into
//! a [`ModelConfig`] the rest of the engine trusts. Anything this engine does not implement
//! (other architectures, rope scaling, sliding window, attention bias) is refused here,
//! naming the field, so a model is never served with silently wrong math.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::EngineError;
use crate::weights::DType;

/// A validated Qwen3 configuration (dense, or Qwen3-MoE when [`ModelConfig::moe`] is set).
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
    /// Qwen3-MoE's sparse MLPs (`Qwen3MoeForCausalLM`); `None` for a dense Qwen3.
    pub moe: Option<MoeConfig>,
}

/// Qwen3-MoE's mixture of experts: which layers have one and how tokens are routed to it.
/// Layers without one have the dense MLP of `intermediate_size`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_experts`).
    pub num_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's SwiGLU width (`moe_intermediate_size`).
    pub intermediate_size: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1 (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// `sparse_layers[i]`: layer `i` has the experts (transformers' rule: not in
    /// `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`).
    pub sparse_layers: Vec<bool>,
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
    num_experts: Option<usize>,
    /// transformers 5's name for `num_experts`.
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
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
        let is_moe = if arch.is_empty() {
            match model_type.as_str() {
                "qwen3" => false,
                "qwen3_moe" => true,
                _ => {
                    return Err(err(
                        "model_type",
                        format!("{model_type:?} is not supported; only qwen3 and qwen3_moe are"),
                    ));
                }
            }
        } else if arch.iter().any(|a| a == "Qwen3ForCausalLM") {
            false
        } else if arch.iter().any(|a| a == "Qwen3MoeForCausalLM") {
            true
        } else {
            return Err(err(
                "architectures",
                format!(
                    "{arch:?} (model_type {model_type:?}) is not supported; only \
                     Qwen3ForCausalLM and Qwen3MoeForCausalLM are"
                ),
            ));
        };
        let expected_type = if is_moe { "qwen3_moe" } else { "qwen3" };
        if !model_type.is_empty() && model_type != expected_type {
            return Err(err(
                "model_type",
                format!("{model_type:?} does not match architectures {arch:?} ({expected_type:?})"),
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
            .clone()
            .or(raw.dtype.clone())
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
        let moe = if is_moe {
            parse_moe(&raw, num_hidden_layers).map_err(|(field, m)| err(field, m))?
        } else {
            None
        };

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
            moe,
        })
    }

    /// Whether layer `i` has Qwen3-MoE's experts instead of the dense MLP.
    pub fn is_sparse_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers[i])
    }

    /// Total parameter count (embedding counted once when tied; every expert).
    pub fn num_parameters(&self) -> usize {
        self.parameters(false)
    }

    /// Parameters one token reads: [`Self::num_parameters`] with only `top_k` experts (and
    /// the router) of each sparse layer. Equal to it for a dense model.
    pub fn num_active_parameters(&self) -> usize {
        self.parameters(true)
    }

    fn parameters(&self, active_only: bool) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let attention = h * q + 2 * h * kv + q * h + 2 * h + 2 * self.head_dim;
        let layers: usize = (0..self.num_hidden_layers)
            .map(|i| match &self.moe {
                Some(m) if m.sparse_layers[i] => {
                    let experts = if active_only { m.top_k } else { m.num_experts };
                    attention + m.num_experts * h + experts * 3 * h * m.intermediate_size
                }
                _ => attention + 3 * h * self.intermediate_size,
            })
            .sum();
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + layers + h
    }
}

/// Qwen3-MoE's fields, validated; `None` when `num_experts` is 0 (every layer dense, as
/// transformers builds it). Errors name the field.
fn parse_moe(raw: &RawConfig, layers: usize) -> Result<Option<MoeConfig>, (&'static str, String)> {
    let need = |v: Option<usize>, field: &'static str| match v {
        Some(0) => Err((field, "must be > 0".to_string())),
        Some(v) => Ok(v),
        None => Err((
            field,
            "is missing (a Qwen3-MoE config needs it)".to_string(),
        )),
    };
    if raw.shared_expert_intermediate_size.is_some_and(|s| s > 0) {
        return Err((
            "shared_expert_intermediate_size",
            "shared experts are not part of Qwen3-MoE and are not supported".into(),
        ));
    }
    let num_experts = match (raw.num_experts, raw.num_local_experts) {
        (Some(a), Some(b)) if a != b => {
            return Err((
                "num_experts",
                format!("{a} disagrees with num_local_experts {b}"),
            ));
        }
        (a, b) => a.or(b),
    };
    let num_experts = match num_experts {
        None => {
            return Err((
                "num_experts",
                "is missing (a Qwen3-MoE config needs it)".into(),
            ));
        }
        Some(0) => return Ok(None),
        Some(n) => n,
    };
    let top_k = need(raw.num_experts_per_tok, "num_experts_per_tok")?;
    if top_k > num_experts {
        return Err((
            "num_experts_per_tok",
            format!("{top_k} is more than num_experts {num_experts}"),
        ));
    }
    let intermediate_size = need(raw.moe_intermediate_size, "moe_intermediate_size")?;
    let step = need(raw.decoder_sparse_step.or(Some(1)), "decoder_sparse_step")?;
    let dense = raw.mlp_only_layers.clone().unwrap_or_default();
    if let Some(&bad) = dense.iter().find(|&&i| i >= layers) {
        return Err((
            "mlp_only_layers",
            format!("layer {bad} does not exist (num_hidden_layers is {layers})"),
        ));
    }
    let sparse_layers = (0..layers)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect();
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        intermediate_size,
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
        sparse_layers,
    }))
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
        assert_eq!(refused_field(&v), "model_type");
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen2MoeForCausalLM"]);
        v["model_type"] = serde_json::json!("qwen2_moe");
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

    fn moe() -> Value {
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.insert(
            "architectures".into(),
            serde_json::json!(["Qwen3MoeForCausalLM"]),
        );
        o.insert("model_type".into(), serde_json::json!("qwen3_moe"));
        o.insert("num_hidden_layers".into(), serde_json::json!(4));
        o.insert("num_experts".into(), serde_json::json!(8));
        o.insert("num_experts_per_tok".into(), serde_json::json!(2));
        o.insert("moe_intermediate_size".into(), serde_json::json!(32));
        o.insert("norm_topk_prob".into(), serde_json::json!(true));
        o.insert("decoder_sparse_step".into(), serde_json::json!(1));
        o.insert("mlp_only_layers".into(), serde_json::json!([]));
        v
    }

    #[test]
    fn parses_a_qwen3_moe_config_and_its_sparse_layers() {
        let c = parse(&moe()).unwrap();
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.top_k, m.intermediate_size), (8, 2, 32));
        assert!(m.norm_topk_prob);
        assert_eq!(m.sparse_layers, vec![true; 4]);
        // Only the experts a token is routed to count as active.
        let per_expert = 3 * 64 * 32;
        assert_eq!(
            c.num_parameters() - c.num_active_parameters(),
            4 * 6 * per_expert
        );

        let mut v = moe();
        v["mlp_only_layers"] = serde_json::json!([0]);
        v["decoder_sparse_step"] = serde_json::json!(2);
        let c = parse(&v).unwrap();
        assert_eq!(c.moe.unwrap().sparse_layers, vec![false, true, false, true]);
        assert!(!parse(&base()).unwrap().is_sparse_layer(0));

        // transformers' defaults: no renormalisation, every layer sparse.
        let mut v = moe();
        let o = v.as_object_mut().unwrap();
        o.remove("norm_topk_prob");
        o.remove("decoder_sparse_step");
        o.remove("mlp_only_layers");
        let m = parse(&v).unwrap().moe.unwrap();
        assert!(!m.norm_topk_prob);
        assert_eq!(m.sparse_layers, vec![true; 4]);

        // transformers 5 writes `num_local_experts`.
        let mut v = moe();
        let experts = v.as_object_mut().unwrap().remove("num_experts").unwrap();
        v["num_local_experts"] = experts;
        assert_eq!(parse(&v).unwrap().moe.unwrap().num_experts, 8);
        v["num_experts"] = serde_json::json!(4);
        assert_eq!(refused_field(&v), "num_experts");

        // No experts at all: transformers builds every layer dense.
        let mut v = moe();
        v["num_experts"] = serde_json::json!(0);
        assert_eq!(parse(&v).unwrap().moe, None);
    }

    #[test]
    fn refuses_a_qwen3_moe_config_it_cannot_serve_naming_the_field() {
        let cases: [(&str, Value); 6] = [
            ("num_experts_per_tok", serde_json::json!(9)),
            ("num_experts_per_tok", serde_json::json!(0)),
            ("moe_intermediate_size", serde_json::json!(0)),
            ("decoder_sparse_step", serde_json::json!(0)),
            ("mlp_only_layers", serde_json::json!([4])),
            ("shared_expert_intermediate_size", serde_json::json!(64)),
        ];
        for (field, value) in cases {
            let mut v = moe();
            v[field] = value;
            assert_eq!(refused_field(&v), field);
        }
        for field in [
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ] {
            let mut v = moe();
            v.as_object_mut().unwrap().remove(field);
            assert_eq!(refused_field(&v), field);
        }
        let mut v = moe();
        v["model_type"] = serde_json::json!("qwen3");
        assert_eq!(refused_field(&v), "model_type");
    }
}
