//! Qwen3 (dense and MoE) written once over the op-level [`Backend`]: embedding, per layer
//! RMSNorm → q/k/v projections → per-head q/k RMSNorm → RoPE → paged GQA attention → output
//! projection → residual → RMSNorm → SwiGLU MLP (Qwen3-MoE: the router's top-k experts, each
//! a SwiGLU MLP, in the sparse layers) → residual; final RMSNorm and a tied or separate LM
//! head. No backend-specific code lives here.

use crate::backend::moe::{Expert, NormMoe};
use crate::backend::{AttentionMeta, Backend, HostMatrix, NormMlp, QkNormRope};
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::weights::{Checkpoint, TensorView};

struct Layer<B: Backend> {
    input_norm: B::Weight,
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Weight,
    k_norm: B::Weight,
    post_norm: B::Weight,
    mlp: Mlp<B>,
}

/// A layer's MLP: Qwen3's dense SwiGLU, or Qwen3-MoE's router and experts.
enum Mlp<B: Backend> {
    Dense(Expert<B::Weight>),
    Sparse {
        router: B::Weight,
        experts: Vec<Expert<B::Weight>>,
    },
}

/// Qwen3 weights resident on backend `B`.
pub struct Qwen3<B: Backend> {
    config: ModelConfig,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Weight,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Weight>,
}

impl<B: Backend> std::fmt::Debug for Qwen3<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen3")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Reads tensors by name and shape from a checkpoint onto a backend, reporting progress.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    ckpt: &'a Checkpoint,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl<B: Backend> Loader<'_, B> {
    fn view(&mut self, name: &str, shape: &[usize]) -> Result<TensorView, EngineError> {
        let view = self.ckpt.tensor(name, shape)?;
        self.done += view.bytes().len();
        Ok(view)
    }

    fn report(&mut self) {
        (self.progress)(self.done.min(self.total), self.total);
    }

    fn one(&mut self, name: &str, shape: &[usize]) -> Result<B::Weight, EngineError> {
        let view = self.view(name, shape)?;
        let w = self.backend.load_weight(name, view)?;
        self.report();
        Ok(w)
    }

    /// Projections that share their input ([`Backend::load_stacked`]).
    fn stacked<const N: usize>(
        &mut self,
        parts: [(&str, &[usize]); N],
    ) -> Result<[B::Weight; N], EngineError> {
        let mut views = Vec::with_capacity(N);
        for (name, shape) in parts {
            views.push((name, self.view(name, shape)?));
        }
        let views: [(&str, TensorView); N] = views
            .try_into()
            .unwrap_or_else(|_| unreachable!("one view per part"));
        let w = self.backend.load_stacked(views)?;
        self.report();
        Ok(w)
    }

    /// A SwiGLU MLP's `{prefix}.{gate,up,down}_proj.weight` of width `inter`.
    fn swiglu(
        &mut self,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<Expert<B::Weight>, EngineError> {
        let [gate, up] = self.stacked([
            (&format!("{prefix}.gate_proj.weight"), &[inter, hidden]),
            (&format!("{prefix}.up_proj.weight"), &[inter, hidden]),
        ])?;
        let down = self.one(&format!("{prefix}.down_proj.weight"), &[hidden, inter])?;
        Ok(Expert { gate, up, down })
    }

    /// A sparse layer's `{prefix}.{e}.{gate,up,down}_proj.weight` for experts `0..count`
    /// ([`Backend::load_experts`]).
    fn experts(
        &mut self,
        prefix: &str,
        count: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Vec<Expert<B::Weight>>, EngineError> {
        let names: Vec<[String; 3]> = (0..count)
            .map(|e| ["gate", "up", "down"].map(|m| format!("{prefix}.{e}.{m}_proj.weight")))
            .collect();
        let mut experts = Vec::with_capacity(count);
        for [gate, up, down] in &names {
            experts.push([
                (gate.as_str(), self.view(gate, &[inter, hidden])?),
                (up.as_str(), self.view(up, &[inter, hidden])?),
                (down.as_str(), self.view(down, &[hidden, inter])?),
            ]);
        }
        let experts = self.backend.load_experts(experts)?;
        self.report();
        Ok(experts)
    }
}

impl<B: Backend> Qwen3<B> {
    /// Load every tensor, checking names and shapes against `config`. `progress(done, total)`
    /// is called after each tensor (bytes).
    pub fn load(
        backend: &B,
        ckpt: &Checkpoint,
        config: &ModelConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        let c = config;
        let h = c.hidden_size;
        let q = c.num_attention_heads * c.head_dim;
        let kv = c.num_key_value_heads * c.head_dim;
        let mut loader = Loader {
            backend,
            ckpt,
            done: 0,
            total: ckpt.total_bytes(),
            progress,
        };
        let embed = loader.one("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let [q_proj, k_proj, v_proj] = loader.stacked([
                (&format!("{p}.self_attn.q_proj.weight"), &[q, h]),
                (&format!("{p}.self_attn.k_proj.weight"), &[kv, h]),
                (&format!("{p}.self_attn.v_proj.weight"), &[kv, h]),
            ])?;
            let mlp = match &c.moe {
                Some(moe) if moe.sparse_layers[i] => Mlp::Sparse {
                    router: loader.one(&format!("{p}.mlp.gate.weight"), &[moe.num_experts, h])?,
                    experts: loader.experts(
                        &format!("{p}.mlp.experts"),
                        moe.num_experts,
                        h,
                        moe.intermediate_size,
                    )?,
                },
                _ => Mlp::Dense(loader.swiglu(&format!("{p}.mlp"), h, c.intermediate_size)?),
            };
            layers.push(Layer {
                input_norm: loader.one(&format!("{p}.input_layernorm.weight"), &[h])?,
                q_proj,
                k_proj,
                v_proj,
                o_proj: loader.one(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
                q_norm: loader.one(&format!("{p}.self_attn.q_norm.weight"), &[c.head_dim])?,
                k_norm: loader.one(&format!("{p}.self_attn.k_norm.weight"), &[c.head_dim])?,
                post_norm: loader.one(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp,
            });
        }
        let norm = loader.one("model.norm.weight", &[h])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(loader.one("lm_head.weight", &[c.vocab_size, h])?)
        };
        Ok(Self {
            config: config.clone(),
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes of weights read by one decode step of one sequence (every matrix once, of a
    /// sparse layer the router and `top_k` experts; the embedding row gather is negligible
    /// unless the LM head is tied to it).
    pub fn weight_bytes_per_step(&self) -> usize {
        let c = &self.config;
        let elem = c.dtype.size_in_bytes();
        let h = c.hidden_size;
        let q = c.num_attention_heads * c.head_dim;
        let kv = c.num_key_value_heads * c.head_dim;
        let attention = 2 * h * q + 2 * h * kv;
        let layers: usize = (0..c.num_hidden_layers)
            .map(|i| match &c.moe {
                Some(m) if m.sparse_layers[i] => {
                    attention + m.num_experts * h + m.top_k * 3 * h * m.intermediate_size
                }
                _ => attention + 3 * h * c.intermediate_size,
            })
            .sum();
        (layers + c.vocab_size * h) * elem
    }

    /// Run the model over a batch. `tokens[i]` is batch row `i`; `meta` places rows in their
    /// sequences (whose earlier KV is already cached); this step's K/V are written to the
    /// cache. Returns logits for `logit_rows` (batch row indices), in that order.
    pub fn forward(
        &self,
        backend: &B,
        kv: &mut B::KvStorage,
        block_size: usize,
        tokens: &[u32],
        meta: &AttentionMeta,
        logit_rows: &[usize],
    ) -> HostMatrix {
        let logits = self.forward_logits(backend, kv, block_size, tokens, meta, logit_rows);
        backend.to_host(&logits)
    }

    /// [`Qwen3::forward`] with the logits left on the backend (`[logit_rows, vocab]`), for
    /// the caller to sample there or copy what it needs.
    pub fn forward_logits(
        &self,
        backend: &B,
        kv: &mut B::KvStorage,
        block_size: usize,
        tokens: &[u32],
        meta: &AttentionMeta,
        logit_rows: &[usize],
    ) -> B::Tensor {
        let c = &self.config;
        let x = self
            .layers_forward(backend, kv, block_size, tokens, meta, Tail::Whole)
            .expect("the whole last layer returns the residual stream");
        let x = backend.select_rows(&x, logit_rows);
        let lm_head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let [logits] =
            backend.norm_linear_shared(&x, &self.norm, c.hidden_size, c.rms_norm_eps, [lm_head]);
        logits
    }

    /// Write a batch's K/V into the cache and compute nothing else: for a step no row of
    /// which wants logits (prompt chunks that do not finish their prompt). The last layer
    /// stops once its K/V are written — its attention, MLP and the LM head only feed logits.
    pub fn forward_kv_only(
        &self,
        backend: &B,
        kv: &mut B::KvStorage,
        block_size: usize,
        tokens: &[u32],
        meta: &AttentionMeta,
    ) {
        self.layers_forward(backend, kv, block_size, tokens, meta, Tail::KvOnly);
    }

    /// The decoder layers over a batch; the residual stream after them, or `None` when
    /// `tail` stops the last layer after its K/V write.
    fn layers_forward(
        &self,
        backend: &B,
        kv: &mut B::KvStorage,
        block_size: usize,
        tokens: &[u32],
        meta: &AttentionMeta,
        tail: Tail,
    ) -> Option<B::Tensor> {
        let c = &self.config;
        let positions = meta.positions();
        let slots = meta.slot_mapping(block_size);
        assert_eq!(positions.len(), tokens.len(), "meta covers every batch row");
        let eps = c.rms_norm_eps;
        let mut x = backend.embedding(&self.embed, tokens);
        for (i, layer) in self.layers.iter().enumerate() {
            let [q, k, v] = backend.norm_linear_shared(
                &x,
                &layer.input_norm,
                c.hidden_size,
                eps,
                [&layer.q_proj, &layer.k_proj, &layer.v_proj],
            );
            let norm_rope = QkNormRope {
                q_norm: &layer.q_norm,
                k_norm: &layer.k_norm,
                positions: &positions,
                head_dim: c.head_dim,
                eps,
                theta: c.rope_theta,
            };
            let q = backend.qk_norm_rope_write_kv(&q, &k, &v, &norm_rope, kv, i, &slots);
            if tail == Tail::KvOnly && i + 1 == self.layers.len() {
                return None;
            }
            backend.attention_linear_add(&mut x, &q, kv, i, meta, &layer.o_proj);

            match &layer.mlp {
                Mlp::Dense(mlp) => {
                    let mlp = NormMlp {
                        hidden: c.hidden_size,
                        norm: &layer.post_norm,
                        eps,
                        gate: &mlp.gate,
                        up: &mlp.up,
                        down: &mlp.down,
                    };
                    backend.norm_mlp_add(&mut x, &mlp);
                }
                Mlp::Sparse { router, experts } => {
                    let moe = c.moe.as_ref().expect("a sparse layer has a MoE config");
                    let moe = NormMoe {
                        hidden: c.hidden_size,
                        norm: &layer.post_norm,
                        eps,
                        router,
                        experts,
                        top_k: moe.top_k,
                        norm_topk_prob: moe.norm_topk_prob,
                    };
                    backend.norm_moe_add(&mut x, &moe);
                }
            }
        }
        Some(x)
    }
}

/// How far [`Qwen3`]'s last layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tail {
    /// To the residual stream the final norm and the LM head read.
    Whole,
    /// To its K/V write: no row wants logits.
    KvOnly,
}
