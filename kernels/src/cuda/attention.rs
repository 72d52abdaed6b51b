//! Paged attention launches of the CUDA backend: the launch plan of a step's attention
//! metadata (uploaded once per step), then either the f32 `paged_attention` kernel (split-K
//! merged inside it), writing f32 rows or the o_proj GEMM's 16-bit input (`attention.cu`),
//! or, for the prefill of 16-bit models, the tensor-core `attention_mma` kernel
//! (`attention_mma.cu`). The choice and the plan are [`super::plan`].

use cudarc::driver::{CudaSlice, LaunchConfig};
use pd_engine::backend::AttentionMeta;
use pd_engine::weights::DType;

use super::graph::Launch;
use super::pdl::arg;
use super::plan::{self, AttentionKernel, AttentionPlan};
use super::tensor::dtype_code;
use super::{CudaBackend, CudaKvStorage, CudaTensor, DeviceBuffer, DevicePlan};

/// Where attention writes its output: f32 rows, or the o_proj GEMM's 16-bit input.
pub(super) enum AttentionOut<'a> {
    F32(&'a CudaTensor),
    Bits16(&'a CudaSlice<u16>, DType),
}

impl CudaBackend {
    /// The attention launch shape and device metadata of `meta` for `kernel` (planned and
    /// uploaded when either changed since the last call). The addresses stay valid until
    /// the next call with another `meta` replaces the cached copy, i.e. past the launches of
    /// this op.
    pub(super) fn attention_plan(
        &self,
        meta: &AttentionMeta,
        kernel: AttentionKernel,
    ) -> (Launch, u64, u64, u64) {
        let mut uploads = self.uploads.lock().expect("uploads lock");
        let cached = uploads.attention.as_ref();
        if cached.map(|(m, dp)| (m, dp.plan.kernel)) != Some((meta, kernel)) {
            let sms = self.dev.num_sms as usize;
            let plan = plan::plan_with(meta, kernel, sms, self.min_keys_per_split());
            let device_plan = DevicePlan {
                items: self.upload(&plan.items),
                seqs: self.upload(&plan.seqs),
                block_tables: self.upload(&plan.block_tables),
                plan,
            };
            uploads.attention = Some((meta.clone(), device_plan));
        }
        let (_, dp) = uploads.attention.as_ref().expect("set above");
        let p = &dp.plan;
        let launch = Launch {
            items: p.num_items(),
            rows_per_item: p.rows_per_item,
            splits: p.splits,
            min_keys_per_split: p.min_keys_per_split,
        };
        (
            launch,
            self.ptr(&dp.items),
            self.ptr(&dp.seqs),
            self.ptr(&dp.block_tables),
        )
    }

    /// Attention of `q` written as `dtype` (bf16 or f16) rows shaped as `q`: the o_proj
    /// GEMM's input, in [`pd_engine::backend::Backend::attention_linear_add`]. Prefill-sized
    /// steps run on the tensor cores ([`plan::choose`]); decode steps on the f32 kernel.
    pub fn paged_attention_16bit(
        &self,
        q: &CudaTensor,
        kv: &CudaKvStorage,
        layer: usize,
        meta: &AttentionMeta,
        dtype: DType,
    ) -> DeviceBuffer<u16> {
        let out16 = self.alloc::<u16>(q.len());
        self.attend(q, kv, layer, meta, AttentionOut::Bits16(&out16, dtype));
        out16
    }

    /// [`Backend::paged_attention`] of `q` into `out` (shaped as `q`).
    pub(super) fn attend(
        &self,
        q: &CudaTensor,
        kv: &CudaKvStorage,
        layer: usize,
        meta: &AttentionMeta,
        out: AttentionOut<'_>,
    ) {
        if q.rows == 0 {
            return;
        }
        // The kernels write `out16` in `out_code`'s type when it is not null, else `out`.
        let (out, out16, out_code) = match out {
            AttentionOut::F32(t) => (self.ptr(t.dense()), 0u64, 0),
            AttentionOut::Bits16(d, dtype) => (0u64, self.ptr(d), dtype_code(dtype)),
        };
        plan::check_group(meta.num_heads, meta.num_kv_heads)
            .unwrap_or_else(|e| panic!("{e} (Qwen3 models have groups of at most 8)"));
        // Graphs capture decode steps only, planned for CUDA cores (graph::launch_shape).
        let (kernel, (p, items_ptr, seqs_ptr, tables_ptr)) = match self.capture_inputs() {
            Some(staged) => (
                AttentionKernel::CudaCores,
                (staged.launch, staged.items, staged.seqs, staged.tables),
            ),
            None => {
                let kernel = plan::choose(meta, out16 != 0 && self.tensor_core_attention);
                (kernel, self.attention_plan(meta, kernel))
            }
        };
        let items = p.items;
        assert!(
            p.splits == 1 || items * meta.num_kv_heads <= self.split_counters.len(),
            "split-K for {items} items x {} KV heads, beyond the {} counters",
            meta.num_kv_heads,
            self.split_counters.len()
        );
        let part_len = items * meta.num_kv_heads * p.splits * plan::MAX_PAIRS;
        let (part_acc, part_ml) = if p.splits > 1 {
            (
                self.alloc::<f32>(part_len * meta.head_dim),
                self.alloc::<f32>(2 * part_len),
            )
        } else {
            (self.alloc::<f32>(1), self.alloc::<f32>(1))
        };
        let heads = meta.num_heads as i32;
        let kv_heads = meta.num_kv_heads as i32;
        let hd = meta.head_dim as i32;
        let bs = kv.layout.block_size as i32;
        let kv_code = dtype_code(kv.dtype);
        let rows_per_item = p.rows_per_item as i32;
        let min_keys_per_split = p.min_keys_per_split as i32;
        // Both kernels take the same parameters (attention_mma ignores the split-K ones).
        let (function, name) = match kernel {
            AttentionKernel::CudaCores => (&self.dev.kernels.paged_attention, "paged_attention"),
            AttentionKernel::TensorCores => (&self.dev.kernels.attention_mma, "attention_mma"),
        };
        let cfg = LaunchConfig {
            grid_dim: (items as u32, meta.num_kv_heads as u32, p.splits as u32),
            block_dim: (plan::THREADS, 1, 1),
            shared_mem_bytes: AttentionPlan::shared_bytes(kernel, meta.head_dim) as u32,
        };
        let (q_ptr, k_ptr, v_ptr) = (
            self.ptr(q.dense()),
            self.ptr(&kv.k[layer]),
            self.ptr(&kv.v[layer]),
        );
        let (acc_ptr, ml_ptr, counters) = (
            self.ptr(&part_acc),
            self.ptr(&part_ml),
            self.ptr(&self.split_counters),
        );
        let mut args = [
            arg(&q_ptr),
            arg(&k_ptr),
            arg(&v_ptr),
            arg(&kv_code),
            arg(&tables_ptr),
            arg(&items_ptr),
            arg(&seqs_ptr),
            arg(&out),
            arg(&out16),
            arg(&out_code),
            arg(&acc_ptr),
            arg(&ml_ptr),
            arg(&counters),
            arg(&heads),
            arg(&kv_heads),
            arg(&hd),
            arg(&bs),
            arg(&rows_per_item),
            arg(&min_keys_per_split),
            arg(&meta.scale),
        ];
        // SAFETY: both kernels' parameters, in order, with the types they declare; the plan
        // sized the grid for the metadata and the partials; every buffer outlives the queued
        // launch. `paged_attention` waits before it reads or writes anything, so it may be
        // launched programmatically dependent; `attention_mma` does not wait.
        unsafe {
            match kernel {
                AttentionKernel::CudaCores => self.launch_dependent(name, function, cfg, &mut args),
                AttentionKernel::TensorCores => self.launch_plain(name, function, cfg, &mut args),
            }
        }
    }
}
