//! The op-level contract every compute backend implements (CPU here, CUDA in `pd-kernels`).
//!
//! The Qwen3 model in [`crate::model`] is written once against this trait; a backend owns
//! where tensors live and how each op runs, never the model's math order. Activations are
//! 2-D row-major `f32` matrices (`rows` tokens × `cols` features). Weights stay in the dtype
//! they were stored in (bf16 / f16 / f32) and are consumed in place. This module does not
//! own the KV block *allocation* (see [`crate::kv`]), only the storage the blocks index.
//! Sampling decisions stay with [`crate::sampling`]; a backend only runs the part of it
//! that [`crate::sampling::device`] specifies, next to the logits.

pub mod conformance;
pub mod cpu;
pub mod graph;
pub mod moe;

use crate::error::EngineError;
use crate::kv::KvLayout;
use crate::kv::handoff::host_buffer::{HostAllocator, HostBuffer, heap_allocator};
use crate::sampling::{DeviceSample, DeviceSampleRow, PromptLogprob, PromptLogprobRow};
use crate::weights::TensorView;
use graph::DecodeGraphStep;
use moe::NormMoe;

/// Rows of one sequence inside a batch, for attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqAttention {
    /// First row of this sequence's new tokens in the batch's activation matrix.
    pub q_start: usize,
    /// Number of new tokens (query rows) this step; their positions are
    /// `context_len - q_len .. context_len`.
    pub q_len: usize,
    /// Tokens of context after this step's tokens are written (cached + new).
    pub context_len: usize,
    /// Physical block id of each logical block, covering at least `context_len` tokens.
    pub block_table: Vec<u32>,
}

/// Everything attention needs to know about a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionMeta {
    pub seqs: Vec<SeqAttention>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Softmax scale, `1 / sqrt(head_dim)` for Qwen3.
    pub scale: f32,
}

impl AttentionMeta {
    /// KV slot (`block * block_size + offset`) of every new token, in batch row order.
    pub fn slot_mapping(&self, block_size: usize) -> Vec<u32> {
        let mut slots = Vec::new();
        for seq in &self.seqs {
            for pos in seq.context_len - seq.q_len..seq.context_len {
                let block = seq.block_table[pos / block_size] as usize;
                slots.push((block * block_size + pos % block_size) as u32);
            }
        }
        slots
    }

    /// Absolute position of every new token, in batch row order.
    pub fn positions(&self) -> Vec<u32> {
        self.seqs
            .iter()
            .flat_map(|s| (s.context_len - s.q_len..s.context_len).map(|p| p as u32))
            .collect()
    }
}

/// One layer's per-head q/k RMSNorm and RoPE: what [`Backend::qk_norm_rope`] needs besides q
/// and k (norm weights `[head_dim]`, each batch row's position, RoPE's base `theta`).
pub struct QkNormRope<'a, W> {
    pub q_norm: &'a W,
    pub k_norm: &'a W,
    pub positions: &'a [u32],
    pub head_dim: usize,
    pub eps: f32,
    pub theta: f64,
}

/// Qwen3's MLP block with the RMSNorm before it: what [`Backend::norm_mlp_add`] needs besides
/// the residual stream `[rows, hidden]` (the norm's weight `[hidden]` and `eps`; gate / up
/// `[inter, hidden]`, down `[hidden, inter]`).
pub struct NormMlp<'a, W> {
    pub hidden: usize,
    pub norm: &'a W,
    pub eps: f32,
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
}

/// The op-level backend contract. Implementations: [`cpu::CpuBackend`] here and the CUDA
/// backend in `pd-kernels`. Ops take shapes from their inputs and panic only on internal
/// shape bugs (the model guarantees shapes; clients never reach these calls directly).
pub trait Backend: Send + Sync + 'static {
    /// A 2-D `f32` activation matrix.
    type Tensor: Send;
    /// A weight in its stored dtype, resident where the backend computes.
    type Weight: Send + Sync;
    /// Paged K/V storage for every layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    type KvStorage: Send;

    /// Short name for logs and metrics (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// Make a weight usable by this backend. 1-D tensors are vectors (norm weights),
    /// 2-D ones are `[out_features, in_features]` matrices (or the embedding table).
    fn load_weight(&self, name: &str, view: TensorView) -> Result<Self::Weight, EngineError>;

    /// Make the matrices of projections that share their input (q, k, v; gate, up) usable,
    /// in order. One [`Backend::load_weight`] each by default; a backend may lay them out
    /// side by side so that [`Backend::linear_shared`] multiplies them as one matrix (the
    /// CUDA backend: one GEMM for q/k/v and one for gate/up).
    fn load_stacked<const N: usize>(
        &self,
        parts: [(&str, TensorView); N],
    ) -> Result<[Self::Weight; N], EngineError> {
        let mut weights = Vec::with_capacity(N);
        for (name, view) in parts {
            weights.push(self.load_weight(name, view)?);
        }
        Ok(weights
            .try_into()
            .unwrap_or_else(|_| unreachable!("one weight per part")))
    }

    /// Allocate KV storage for `num_blocks` blocks of `layout`, whose dtype must be
    /// [`Backend::kv_dtype`].
    fn alloc_kv(
        &self,
        layout: &KvLayout,
        num_blocks: usize,
    ) -> Result<Self::KvStorage, EngineError>;

    /// The type the KV cache is stored in (after `auto` is resolved). Default f32.
    fn kv_dtype(&self) -> crate::weights::DType {
        crate::weights::DType::F32
    }

    /// Bytes of this backend's own memory the KV cache may take once the weights are
    /// resident and `activation_bytes` of working memory are set aside, or `None` for a
    /// backend without a fixed memory of its own (the CPU), where the engine's default KV
    /// size applies. Errs when not even the working memory fits.
    fn kv_memory_budget(&self, activation_bytes: usize) -> Result<Option<usize>, EngineError> {
        let _ = activation_bytes;
        Ok(None)
    }

    /// Rows of the embedding table for `ids` (`[ids.len(), hidden]`).
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Self::Tensor;

    /// RMSNorm over each consecutive group of `group` features (group = hidden size for the
    /// layer norms, head_dim for Qwen3's per-head q/k norms), times `weight` (`[group]`).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        group: usize,
        eps: f32,
    ) -> Self::Tensor;

    /// `x · Wᵀ`: `[rows, in] × [out, in]ᵀ → [rows, out]`.
    fn linear(&self, x: &Self::Tensor, weight: &Self::Weight) -> Self::Tensor;

    /// `x · Wᵢᵀ` for each of projections that share their input (q, k, v; gate, up), in
    /// order. One `linear` each by default; a backend that prepares the input for every
    /// product (the CUDA backend's 16-bit copy for the tensor cores) does it once.
    fn linear_shared<const N: usize>(
        &self,
        x: &Self::Tensor,
        weights: [&Self::Weight; N],
    ) -> [Self::Tensor; N] {
        weights.map(|w| self.linear(x, w))
    }

    /// `linear_shared(rms_norm(x))` where the normalised `x` feeds nothing else (Qwen3's
    /// layer norms before q/k/v and before gate/up). By default those two ops; a backend may
    /// write the normalised rows straight in its GEMM input format.
    fn norm_linear_shared<const N: usize>(
        &self,
        x: &Self::Tensor,
        norm: &Self::Weight,
        group: usize,
        eps: f32,
        weights: [&Self::Weight; N],
    ) -> [Self::Tensor; N] {
        let h = self.rms_norm(x, norm, group, eps);
        self.linear_shared(&h, weights)
    }

    /// `x += silu_mul(gate, up) · Wᵀ`: the MLP's down projection added to the residual
    /// stream. By default three ops; a backend may write the activation straight in its GEMM
    /// input format and let the GEMM add its product to `x` (the CUDA backend: two launches).
    fn silu_mul_linear_add(
        &self,
        x: &mut Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        weight: &Self::Weight,
    ) {
        let act = self.silu_mul(gate, up);
        let y = self.linear(&act, weight);
        self.add_assign(x, &y);
    }

    /// `x += down(silu(gate(n)) · up(n))` with `n = rms_norm(x)` over the whole row: the
    /// post-attention norm and the MLP added to the residual stream. By default
    /// [`Self::norm_linear_shared`] then [`Self::silu_mul_linear_add`]; a backend may fuse
    /// further (the CUDA backend's decode-batch kernels: two launches instead of four).
    fn norm_mlp_add(&self, x: &mut Self::Tensor, mlp: &NormMlp<'_, Self::Weight>) {
        let [gate, up] =
            self.norm_linear_shared(x, mlp.norm, mlp.hidden, mlp.eps, [mlp.gate, mlp.up]);
        self.silu_mul_linear_add(x, &gate, &up, mlp.down);
    }

    /// `x += Σₑ wₑ · expertₑ(n)` with `n = rms_norm(x)` over the whole row, each row sent to
    /// its `top_k` experts by the router ([`moe::route`]): Qwen3-MoE's post-attention norm
    /// and sparse MLP added to the residual stream. By default [`moe::norm_moe_add_on_host`]:
    /// the router's logits go to the host to be routed, then each chosen expert runs on its
    /// rows and its output is added, expert by expert in index order. A device backend may
    /// route on the device (the CUDA backend); each row must still add its experts in index
    /// order.
    fn norm_moe_add(&self, x: &mut Self::Tensor, moe: &NormMoe<'_, Self::Weight>) {
        moe::norm_moe_add_on_host(self, x, moe);
    }

    /// Make one sparse layer's experts usable, in expert order, each from its `[gate, up,
    /// down]` matrices (`[inter, hidden]`, `[inter, hidden]`, `[hidden, inter]`). By default
    /// [`Backend::load_stacked`] for gate / up and [`Backend::load_weight`] for down, expert
    /// by expert; a backend may place every expert of the layer in one buffer, so that a
    /// kernel finds an expert by its index (the CUDA backend).
    fn load_experts(
        &self,
        experts: Vec<[(&str, TensorView); 3]>,
    ) -> Result<Vec<moe::Expert<Self::Weight>>, EngineError> {
        experts
            .into_iter()
            .map(|[gate, up, down]| {
                let [gate, up] = self.load_stacked([gate, up])?;
                let down = self.load_weight(down.0, down.1)?;
                Ok(moe::Expert { gate, up, down })
            })
            .collect()
    }

    /// `x[rows[i]] += scales[i] · y[i]` for each row `i` of `y` (`rows` distinct): an
    /// expert's output added to the rows routed to it.
    fn add_rows_scaled(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        rows: &[usize],
        scales: &[f32],
    );

    /// Rotate-half rotary embedding in place on `[rows, heads * head_dim]`, row `i` at
    /// `positions[i]`, `inv_freq[j] = theta^(-2j/head_dim)`.
    fn rope(&self, x: &mut Self::Tensor, positions: &[u32], head_dim: usize, theta: f64);

    /// Qwen3's attention-input step: per-head RMSNorm of `q` and `k` (weights `[head_dim]`),
    /// then RoPE on both at `positions`. By default those four ops; a backend may fuse them
    /// (the CUDA backend runs one kernel instead of four launches).
    fn qk_norm_rope(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        p: &QkNormRope<'_, Self::Weight>,
    ) -> (Self::Tensor, Self::Tensor) {
        let mut q = self.rms_norm(q, p.q_norm, p.head_dim, p.eps);
        let mut k = self.rms_norm(k, p.k_norm, p.head_dim, p.eps);
        self.rope(&mut q, p.positions, p.head_dim, p.theta);
        self.rope(&mut k, p.positions, p.head_dim, p.theta);
        (q, k)
    }

    /// [`Backend::qk_norm_rope`], then [`Backend::write_kv`] of the rotated `k` and of `v`:
    /// the whole step between the q/k/v projections and attention. Returns the rotated `q`.
    /// By default those two ops; a backend may write the KV from the same kernel (the CUDA
    /// backend: one launch instead of two).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_write_kv(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        p: &QkNormRope<'_, Self::Weight>,
        kv: &mut Self::KvStorage,
        layer: usize,
        slots: &[u32],
    ) -> Self::Tensor {
        let (q, k) = self.qk_norm_rope(q, k, p);
        self.write_kv(kv, layer, &k, v, slots);
        q
    }

    /// Write this step's keys and values (`[rows, kv_heads * head_dim]`) into `slots`.
    fn write_kv(
        &self,
        kv: &mut Self::KvStorage,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        slots: &[u32],
    );

    /// Causal grouped-query attention of the batch's queries (`[rows, heads * head_dim]`)
    /// over each sequence's paged context, already including this step's keys/values.
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        kv: &Self::KvStorage,
        layer: usize,
        meta: &AttentionMeta,
    ) -> Self::Tensor;

    /// `x += paged_attention(q) · o_projᵀ`: attention and its output projection added to the
    /// residual stream. By default three ops; a backend may write the attention output
    /// straight in its GEMM input format and let the GEMM add its product to `x` (the CUDA
    /// backend: two launches, three with split-K).
    fn attention_linear_add(
        &self,
        x: &mut Self::Tensor,
        q: &Self::Tensor,
        kv: &Self::KvStorage,
        layer: usize,
        meta: &AttentionMeta,
        o_proj: &Self::Weight,
    ) {
        let attn = self.paged_attention(q, kv, layer, meta);
        let o = self.linear(&attn, o_proj);
        self.add_assign(x, &o);
    }

    /// `silu(gate) * up`, element-wise.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;

    /// `x += y`, element-wise.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor);

    /// The listed rows of `x`, in order (picks the positions whose logits are wanted).
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Self::Tensor;

    /// Copy to host memory as `(rows, cols, row-major data)`.
    fn to_host(&self, x: &Self::Tensor) -> HostMatrix;

    /// Choose one token for each listed row of `logits` (`[rows, vocab]`) where the logits
    /// are, returning only the token ids (and their log-probabilities) to the host. Only the
    /// first `vocab_limit` columns are candidates; log-probabilities are normalized over
    /// every column. Must choose exactly the token of
    /// [`crate::sampling::device::sample_row_within`] for every row (the conformance
    /// contract; the log-probability may differ by rounding).
    fn sample(
        &self,
        logits: &Self::Tensor,
        rows: &[DeviceSampleRow],
        vocab_limit: usize,
    ) -> Vec<DeviceSample>;

    /// Score prompt positions where the logits are: for each listed row of `logits`, the
    /// log-probability of its next prompt token (normalized over every column) and its `top`
    /// most likely alternatives among the first `vocab_limit` columns. Must list the ids of
    /// [`crate::sampling::prompt_logprobs_within`], in its order (the conformance contract;
    /// log-probabilities may differ by rounding).
    fn prompt_logprobs(
        &self,
        logits: &Self::Tensor,
        rows: &[PromptLogprobRow],
        vocab_limit: usize,
    ) -> Vec<PromptLogprob>;

    /// Run a pure decode step through a graph this backend captured for `step.bucket` rows
    /// (see [`graph`]), staging the step's metadata in the graph's fixed buffers. The first
    /// time for a bucket the backend records `forward` (the model over
    /// [`DecodeGraphStep::padded`]; possibly more than once, so it must only queue device
    /// work) and then replays the recording. Returns the logits of
    /// the bucket's rows, the real sequences first, or `None` when the backend has no graphs
    /// or capturing failed: the caller then runs the step eagerly. Default: `None`.
    fn decode_graph(
        &self,
        step: &DecodeGraphStep<'_>,
        forward: &mut dyn FnMut() -> Self::Tensor,
    ) -> Option<Self::Tensor> {
        let _ = (step, forward);
        None
    }

    /// Copy block `block` of every layer out of KV storage into `dst`
    /// ([`KvLayout::block_bytes`] long), laid out layer by layer as `[K block, V block]`
    /// (each `block_size × kv_heads × head_dim` values), each value as stored
    /// ([`KvLayout::dtype`], little-endian): the transfer layout.
    fn read_block(&self, kv: &Self::KvStorage, block: u32, dst: &mut [u8]);

    /// The inverse of [`Backend::read_block`].
    fn write_block(&self, kv: &mut Self::KvStorage, block: u32, src: &[u8]);

    /// A host buffer of `len` bytes for [`Backend::read_blocks`] to fill and other threads to
    /// read (a GPU prefill node's lease): [`Backend::host_allocator`]'s.
    fn host_buffer(&self, len: usize) -> HostBuffer {
        (self.host_allocator())(len)
    }

    /// Where host buffers that KV blocks are copied through come from, callable from any
    /// thread (a decode node's importer receives blocks into them, then
    /// [`Backend::write_blocks`] copies them in): heap memory by default; a device backend
    /// lends memory its copies run faster from and into (page-locked, on a GPU).
    fn host_allocator(&self) -> HostAllocator {
        heap_allocator()
    }

    /// [`Backend::read_block`] of each of `blocks` in turn into `dst`, block `i` of the list
    /// at `i * block_bytes`. A device backend overrides it to move many blocks per launch
    /// and per copy (one synchronization for a whole lease, not one per block).
    fn read_blocks(&self, kv: &Self::KvStorage, blocks: &[u32], dst: &mut [u8]) {
        if blocks.is_empty() {
            return;
        }
        assert!(
            dst.len().is_multiple_of(blocks.len()),
            "blocks buffer length"
        );
        let block_bytes = dst.len() / blocks.len();
        for (&block, out) in blocks.iter().zip(dst.chunks_exact_mut(block_bytes)) {
            self.read_block(kv, block, out);
        }
    }

    /// [`Backend::write_block`] of `src[i]` into `blocks[i]`, for each `i`; batched like
    /// [`Backend::read_blocks`] by a device backend.
    fn write_blocks(&self, kv: &mut Self::KvStorage, blocks: &[u32], src: &[&[u8]]) {
        assert_eq!(blocks.len(), src.len(), "one buffer per block");
        for (&block, bytes) in blocks.iter().zip(src) {
            self.write_block(kv, block, bytes);
        }
    }

    /// Where KV storage lies in host memory, block by block in [`Backend::read_block`]'s
    /// layout, so that imported KV can land in place; `None` (the default) when it is not
    /// host memory (a GPU's), and imports are copied in with [`Backend::write_block`].
    fn host_kv_memory(
        &self,
        kv: &Self::KvStorage,
    ) -> Option<crate::kv::handoff::placement::HostKvMemory> {
        let _ = kv;
        None
    }

    /// A way to write blocks into `kv` from other threads while the engine keeps stepping
    /// (a GPU's copy stream): a decode node's puller copies an import into the blocks the
    /// engine reserved for it as soon as it arrives, so admission copies nothing on the
    /// engine thread. Each [`crate::kv::handoff::reservation::BlockWrite`] it makes is ordered after
    /// the device work queued when it was made, and writes only blocks the engine handed
    /// out exclusively. `None` (the default): imports that do not land in host memory are
    /// copied in with [`Backend::write_blocks`] at admission. Called once, on the engine
    /// thread, and only where [`Backend::host_kv_memory`] is `None`.
    fn block_writer(
        &self,
        kv: &Self::KvStorage,
    ) -> Option<crate::kv::handoff::reservation::BlockWriter> {
        let _ = kv;
        None
    }
}

/// A row-major `f32` matrix in host memory (logits handed to the sampler).
#[derive(Debug, Clone, PartialEq)]
pub struct HostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostMatrix {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// A matrix of these (equally long) rows.
    #[cfg(test)]
    pub(crate) fn from_rows(rows: &[&[f32]]) -> Self {
        Self {
            rows: rows.len(),
            cols: rows[0].len(),
            data: rows.concat(),
        }
    }
}
