//! The CUDA backend: every [`Backend`] op as a kernel launch or a cuBLAS call on one stream
//! of one device. Ops are asynchronous; [`Backend::to_host`], [`Backend::sample`],
//! [`Backend::prompt_logprobs`] and the block copies are the only points that wait for the
//! device.
//!
//! The `Backend` ops (other than loading and allocation) cannot return errors: a failed
//! launch leaves the CUDA context unusable, so it panics with the op's name and the driver's
//! message, which ends the engine thread (the node then reports itself unhealthy).
//!
//! Parts: `open` (start-up, memory sizing and KV storage), `elementwise` (the element- and
//! row-wise ops), `linear` (GEMM operands, stacked projections, cuBLAS through [`gemm`]),
//! `attention` (paged attention launches, planned by [`plan`]), `weights` (uploads), `graph`
//! (decode graphs), `sample` (device sampling), `prompt` (prompt log-probabilities), `tensor` (what lives on the device), `blocks`
//! and `pinned` (KV blocks moved to and from host memory, page-locked for leases), `import`
//! (imports written in from the puller's thread, on a second stream), `gemv`
//! (the decode-sized product kernel), `moe` (Qwen3-MoE's sparse layers routed on the
//! device), `device` and [`modules`] (the device, its libraries and compiled kernels).

mod attention;
mod blocks;
mod device;
mod elementwise;
pub mod gemm;
mod gemv;
mod graph;
mod import;
mod linear;
pub mod modules;
mod moe;
mod open;
mod pdl;
mod pinned;
pub mod plan;
mod pool;
mod prompt;
mod qk;
mod sample;
mod settings;
mod tensor;
mod weights;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaSlice, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg};
use pd_engine::backend::graph::DecodeGraphStep;
use pd_engine::backend::moe::{Expert, NormMoe};
use pd_engine::backend::{AttentionMeta, Backend, HostMatrix, NormMlp, QkNormRope};
use pd_engine::error::EngineError;
use pd_engine::kv::KvLayout;
use pd_engine::kv::handoff::host_buffer::HostAllocator;
use pd_engine::kv::handoff::reservation::BlockWriter;
use pd_engine::sampling::{DeviceSample, DeviceSampleRow, PromptLogprob, PromptLogprobRow};
use pd_engine::weights::{DType, TensorView};

pub use device::Device;
pub use gemv::{GEMV_MAX_ROWS, SmallBatchLinear};
use tensor::dtype_code;
pub use tensor::{CudaKvStorage, CudaTensor, CudaWeight};

use attention::AttentionOut;
use elementwise::norm_threads;
use graph::Graphs;
use linear::{Operand, shared_16bit};
use pinned::PinnedPool;
use plan::AttentionPlan;
use pool::BufferPools;
pub use pool::DeviceBuffer;
use qk::KOut;

/// Threads per block of the element-wise and row kernels.
const THREADS: u32 = 256;

/// Whether libcuda (the NVIDIA driver) can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names; no symbol is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Qwen3 on one NVIDIA GPU (see the crate docs).
pub struct CudaBackend {
    dev: Device,
    gpu_memory_utilization: f64,
    /// How KV is stored on the device (`--kv-cache-dtype`); `None` is auto, the model's dtype.
    kv_dtype: Option<DType>,
    /// The dtype of the first matrix uploaded: the model's, for auto.
    matrix_dtype: OnceLock<DType>,
    /// Bytes of weights uploaded so far (reported in logs and the memory error).
    weight_bytes: AtomicUsize,
    /// Step metadata uploaded once per step rather than once per layer.
    uploads: Mutex<Uploads>,
    /// Whether prefill of 16-bit models may run attention on the tensor cores
    /// (`PD_CUDA_ATTENTION=auto`, the default) or always runs the f32 kernel (`f32`): a
    /// switch to tell a tensor-core defect from any other on a new GPU.
    tensor_core_attention: bool,
    /// One arrival counter per (item, KV head) block of a split-K attention launch: the
    /// last split to arrive merges them (`attention.cu`) and resets its counter to 0.
    split_counters: CudaSlice<u32>,
    /// Decode graphs per batch-size bucket (`--cuda-graphs on`).
    graphs: Mutex<Graphs>,
    /// Whether decode-sized batches with 16-bit weights go through the `gemv16` kernel
    /// ([`SmallBatchLinear::Kernel`], `PD_CUDA_GEMV=kernel`) instead of cuBLAS.
    gemv_kernel: AtomicBool,
    /// Page-locked host buffers lent for KV copied out (`Backend::host_buffer`).
    pinned: Arc<PinnedPool>,
    /// Kernel launches issued so far ([`CudaBackend::kernel_launches`]).
    launches: AtomicU64,
    /// Stream-ordered allocations issued so far ([`CudaBackend::stream_allocations`]).
    allocations: AtomicU64,
    /// Activation and upload buffers recycled between ops, steps and graph captures.
    pools: BufferPools,
    /// Whether the GEMV kernels are launched programmatically dependent on the kernel
    /// before them (`PD_CUDA_PDL=on`, [`pdl`]), and how many were.
    programmatic: AtomicBool,
    programmatic_launches: AtomicU64,
    /// The least number of keys a split-K range takes ([`plan::MIN_KEYS_PER_SPLIT`]).
    min_keys_per_split: AtomicUsize,
    /// Whether Qwen3-MoE layers are routed on the device (`moe`; the default) or always on
    /// the host (`PD_CUDA_MOE=host`, and the benchmark's comparison).
    moe_on_device: AtomicBool,
    /// Whether Qwen3-MoE experts were uploaded ([`Backend::load_experts`]).
    moe_layers: AtomicBool,
}

/// The last uploaded copy of each kind of per-step metadata, reused while unchanged.
#[derive(Default)]
struct Uploads {
    positions: Option<(Vec<u32>, DeviceBuffer<u32>)>,
    slots: Option<(Vec<u32>, DeviceBuffer<u32>)>,
    attention: Option<(AttentionMeta, DevicePlan)>,
}

/// An [`AttentionPlan`] on the device.
struct DevicePlan {
    plan: AttentionPlan,
    items: DeviceBuffer<i32>,
    seqs: DeviceBuffer<i32>,
    block_tables: DeviceBuffer<u32>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.name())
            .field("gpu", &self.dev.name)
            .field("compute_capability", &self.dev.cc)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Page-locked bytes lent out for KV copies and kept for reuse (`Backend::host_buffer`),
    /// within the pool's budget (`pinned::PINNED_BUDGET`, 4 GiB): for tests and the benchmark.
    pub fn pinned_usage(&self) -> (usize, usize) {
        self.pinned.usage()
    }

    /// How this backend stores KV: as set, else the model's matrices' dtype, else f32.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
            .or_else(|| self.matrix_dtype.get().copied())
            .unwrap_or(DType::F32)
    }

    /// The device, for benchmarks and tests that time or synchronise it.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Wait until every queued op has finished.
    pub fn synchronize(&self) {
        if let Err(e) = self.dev.stream.synchronize() {
            self.fail("synchronize", e);
        }
    }

    fn fail(&self, what: &str, e: impl std::fmt::Debug) -> ! {
        panic!("cuda:{}: {what} failed: {e:?}", self.dev.ordinal)
    }

    /// Device memory of unspecified contents for `len` elements (at least one: CUDA refuses
    /// zero), from the pools ([`pool`]): every caller writes the elements it later reads.
    fn alloc<T: cudarc::driver::DeviceRepr + 'static>(&self, len: usize) -> DeviceBuffer<T> {
        let mut fresh = 0;
        let buffer = self
            .pools
            .alloc::<T>(&self.dev.stream, len.max(1), &mut fresh)
            .unwrap_or_else(|e| self.fail("alloc", e));
        self.allocations.fetch_add(fresh, Ordering::Relaxed);
        buffer
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor::in_buffer(rows, cols, self.alloc(rows * cols))
    }

    /// The device address of row 0 of `t` (a buffer of its own, or a view).
    fn rows_ptr(&self, t: &CudaTensor) -> u64 {
        self.ptr(t.buffer()) + (t.offset() * std::mem::size_of::<f32>()) as u64
    }

    /// `host` copied to the device, at the start of a buffer whose length is rounded up to
    /// a power of two: per-step metadata (block tables grow with the context) then reuses
    /// the same few pooled buffers step after step. Kernels read the lengths they are told.
    fn upload<T: cudarc::driver::DeviceRepr + 'static>(&self, host: &[T]) -> DeviceBuffer<T> {
        let mut buffer = self.alloc::<T>(host.len().next_power_of_two().max(64));
        if !host.is_empty() {
            self.dev
                .stream
                .memcpy_htod(host, &mut buffer.slice_mut(..host.len()))
                .unwrap_or_else(|e| self.fail("upload", e));
        }
        buffer
    }

    fn launch(&self, name: &str, mut args: LaunchArgs<'_>, cfg: LaunchConfig) {
        self.count_launch(false);
        // SAFETY: each call site passes the arguments its kernel declares, in order, with
        // buffers sized for the grid it launches.
        if let Err(e) = unsafe { args.launch(cfg) } {
            self.fail(name, e);
        }
    }

    /// The device address of `slice`, for a kernel argument. The caller keeps the slice alive
    /// until the launch is queued (frees are stream-ordered after it).
    fn ptr<T>(&self, slice: &CudaSlice<T>) -> u64 {
        slice.device_ptr(&self.dev.stream).0
    }

    /// One thread per element.
    fn elements(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One block per row.
    fn per_row(rows: usize, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The device address of `positions`: the staged copy while a graph captures, else an
    /// upload shared by every op of the step that takes the same positions.
    fn positions_ptr(&self, positions: &[u32]) -> u64 {
        match self.capture_inputs() {
            Some(staged) => staged.positions,
            None => {
                let mut uploads = self.uploads.lock().expect("uploads lock");
                self.ptr(cached(&mut uploads.positions, positions, |h| {
                    self.upload(h)
                }))
            }
        }
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type KvStorage = CudaKvStorage;

    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal)
    }

    fn load_weight(&self, _name: &str, view: TensorView) -> Result<CudaWeight, EngineError> {
        self.upload_weight(view)
    }

    fn load_stacked<const N: usize>(
        &self,
        parts: [(&str, TensorView); N],
    ) -> Result<[CudaWeight; N], EngineError> {
        self.upload_stacked(parts)
    }

    fn alloc_kv(&self, layout: &KvLayout, num_blocks: usize) -> Result<CudaKvStorage, EngineError> {
        self.alloc_kv_storage(layout, num_blocks)
    }

    fn kv_dtype(&self) -> DType {
        CudaBackend::kv_dtype(self)
    }

    fn kv_memory_budget(&self, activation_bytes: usize) -> Result<Option<usize>, EngineError> {
        self.kv_budget_bytes(activation_bytes)
            .map(Some)
            .map_err(|e| EngineError::DeviceMemory(e.to_string()))
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> CudaTensor {
        self.launch_embedding(table, ids)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaWeight, group: usize, eps: f32) -> CudaTensor {
        self.launch_rms_norm(x, weight, group, eps)
    }

    fn linear(&self, x: &CudaTensor, weight: &CudaWeight) -> CudaTensor {
        self.linear_with(Operand::F32(x), weight)
    }

    fn linear_shared<const N: usize>(
        &self,
        x: &CudaTensor,
        weights: [&CudaWeight; N],
    ) -> [CudaTensor; N] {
        // One 16-bit copy of `x` for all the products when they all take that dtype.
        let x16 = shared_16bit(&weights)
            .filter(|_| !x.is_empty())
            .map(|dtype| self.cast(x, dtype));
        let operand = match &x16 {
            Some(x16) => Operand::bits16(x16, x),
            None => Operand::F32(x),
        };
        self.linear_stacked(operand, weights)
    }

    fn norm_linear_shared<const N: usize>(
        &self,
        x: &CudaTensor,
        norm: &CudaWeight,
        group: usize,
        eps: f32,
        weights: [&CudaWeight; N],
    ) -> [CudaTensor; N] {
        if let Some(out) = self.norm_linear_gemv(x, norm, group, eps, weights) {
            return out;
        }
        let Some(dtype) = shared_16bit(&weights).filter(|_| !x.is_empty()) else {
            let h = self.rms_norm(x, norm, group, eps);
            return self.linear_shared(&h, weights);
        };
        // The normalised rows go straight into the GEMMs' 16-bit input; `x` has their shape.
        let x16 = self.launch_rms_norm_16(x, norm, group, eps, dtype);
        self.linear_stacked(Operand::bits16(&x16, x), weights)
    }

    fn silu_mul_linear_add(
        &self,
        x: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        weight: &CudaWeight,
    ) {
        let Some(dtype) = shared_16bit(&[weight]).filter(|_| !gate.is_empty()) else {
            let act = self.silu_mul(gate, up);
            return self.linear_into(Operand::F32(&act), self.matrix(weight), x, true);
        };
        // The activation goes straight into the GEMM's 16-bit input; `gate` has its shape.
        let x16 = self.alloc::<u16>(gate.len());
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.silu_mul_16);
        let a = self.silu_mul_args(gate, up);
        let code = dtype_code(dtype);
        b.arg(&a.gate)
            .arg(&a.up)
            .arg(&x16)
            .arg(&a.n)
            .arg(&a.cols)
            .arg(&a.gate_stride)
            .arg(&a.up_stride)
            .arg(&code);
        self.launch("silu_mul_16", b, Self::elements(gate.len()));
        self.linear_into(Operand::bits16(&x16, gate), self.matrix(weight), x, true);
    }

    fn norm_mlp_add(&self, x: &mut CudaTensor, mlp: &NormMlp<'_, CudaWeight>) {
        if self.norm_mlp_gemv(x, mlp) {
            return;
        }
        let [gate, up] =
            self.norm_linear_shared(x, mlp.norm, mlp.hidden, mlp.eps, [mlp.gate, mlp.up]);
        self.silu_mul_linear_add(x, &gate, &up, mlp.down);
    }

    fn rope(&self, x: &mut CudaTensor, positions: &[u32], head_dim: usize, theta: f64) {
        self.launch_rope(x, positions, head_dim, theta)
    }

    fn qk_norm_rope(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        p: &QkNormRope<'_, CudaWeight>,
    ) -> (CudaTensor, CudaTensor) {
        let k_out = self.tensor(k.rows, k.cols);
        let q_out = self.norm_rope(q, k, p, KOut::Tensor(&k_out));
        (q_out, k_out)
    }

    fn qk_norm_rope_write_kv(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        p: &QkNormRope<'_, CudaWeight>,
        kv: &mut CudaKvStorage,
        layer: usize,
        slots: &[u32],
    ) -> CudaTensor {
        let width = kv.layout.token_width();
        assert_eq!(
            (k.cols, v.cols),
            (width, width),
            "k and v are one KV token wide"
        );
        assert_eq!((slots.len(), v.rows), (k.rows, k.rows), "a slot per row");
        self.norm_rope(
            q,
            k,
            p,
            KOut::Cache {
                kv,
                layer,
                v,
                slots,
            },
        )
    }

    fn write_kv(
        &self,
        kv: &mut CudaKvStorage,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        slots: &[u32],
    ) {
        self.launch_write_kv(kv, layer, k, v, slots)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKvStorage,
        layer: usize,
        meta: &AttentionMeta,
    ) -> CudaTensor {
        let out = self.tensor(q.rows, q.cols);
        self.attend(q, kv, layer, meta, AttentionOut::F32(&out));
        out
    }

    fn attention_linear_add(
        &self,
        x: &mut CudaTensor,
        q: &CudaTensor,
        kv: &CudaKvStorage,
        layer: usize,
        meta: &AttentionMeta,
        o_proj: &CudaWeight,
    ) {
        let Some(dtype) = shared_16bit(&[o_proj]).filter(|_| !q.is_empty()) else {
            let attn = self.paged_attention(q, kv, layer, meta);
            return self.linear_into(Operand::F32(&attn), self.matrix(o_proj), x, true);
        };
        // The attention output goes straight into the GEMM's 16-bit input; `q` has its shape.
        let out16 = self.paged_attention_16bit(q, kv, layer, meta, dtype);
        self.linear_into(Operand::bits16(&out16, q), self.matrix(o_proj), x, true);
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        self.launch_silu_mul(gate, up)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        self.launch_add_assign(x, y)
    }

    fn norm_moe_add(&self, x: &mut CudaTensor, moe: &NormMoe<'_, CudaWeight>) {
        if !self.norm_moe_on_device(x, moe) {
            self.route_moe_on_host(x, moe);
        }
    }

    fn load_experts(
        &self,
        experts: Vec<[(&str, TensorView); 3]>,
    ) -> Result<Vec<Expert<CudaWeight>>, EngineError> {
        self.upload_experts(experts)
    }

    fn add_rows_scaled(&self, x: &mut CudaTensor, y: &CudaTensor, rows: &[usize], scales: &[f32]) {
        self.launch_add_rows_scaled(x, y, rows, scales)
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        self.launch_select_rows(x, rows)
    }

    fn to_host(&self, x: &CudaTensor) -> HostMatrix {
        self.copy_to_host(x)
    }

    fn sample(
        &self,
        logits: &CudaTensor,
        rows: &[DeviceSampleRow],
        vocab_limit: usize,
    ) -> Vec<DeviceSample> {
        self.sample_on_device(logits, rows, vocab_limit)
    }

    fn prompt_logprobs(
        &self,
        logits: &CudaTensor,
        rows: &[PromptLogprobRow],
        vocab_limit: usize,
    ) -> Vec<PromptLogprob> {
        self.prompt_logprobs_on_device(logits, rows, vocab_limit)
    }

    fn decode_graph(
        &self,
        step: &DecodeGraphStep<'_>,
        forward: &mut dyn FnMut() -> CudaTensor,
    ) -> Option<CudaTensor> {
        self.run_decode_graph(step, forward)
    }

    fn read_block(&self, kv: &CudaKvStorage, block: u32, dst: &mut [u8]) {
        self.copy_blocks_out(kv, &[block], dst);
    }

    fn write_block(&self, kv: &mut CudaKvStorage, block: u32, src: &[u8]) {
        self.copy_blocks_in(kv, &[block], &[src]);
    }

    fn host_allocator(&self) -> HostAllocator {
        let pool = Arc::clone(&self.pinned);
        Arc::new(move |len| pool.lend(len))
    }

    fn read_blocks(&self, kv: &CudaKvStorage, blocks: &[u32], dst: &mut [u8]) {
        self.copy_blocks_out(kv, blocks, dst);
    }

    fn write_blocks(&self, kv: &mut CudaKvStorage, blocks: &[u32], src: &[&[u8]]) {
        self.copy_blocks_in(kv, blocks, src);
    }

    fn block_writer(&self, kv: &CudaKvStorage) -> Option<BlockWriter> {
        match self.import_writer(kv) {
            Ok(writer) => Some(writer),
            Err(e) => {
                // Imports still work: the engine copies them in at admission.
                tracing::warn!(
                    device = %self.name(),
                    error = %e,
                    "no import stream; imported KV is copied in on the engine thread"
                );
                None
            }
        }
    }
}

/// The device copy of `host`, uploading it only when it differs from the cached one.
fn cached<'a>(
    slot: &'a mut Option<(Vec<u32>, DeviceBuffer<u32>)>,
    host: &[u32],
    upload: impl FnOnce(&[u32]) -> DeviceBuffer<u32>,
) -> &'a CudaSlice<u32> {
    if slot.as_ref().map(|(h, _)| h.as_slice()) != Some(host) {
        *slot = Some((host.to_vec(), upload(host)));
    }
    &slot.as_ref().expect("set above").1
}
