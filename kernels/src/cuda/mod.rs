//! The CUDA backend: every [`Backend`] op as a kernel launch or a cuBLAS call on one stream
//! of one device. Ops are asynchronous; [`Backend::to_host`], [`Backend::sample`] and the
//! block copies are the only points that wait for the device.
//!
//! The `Backend` ops (other than loading and allocation) cannot return errors: a failed
//! launch leaves the CUDA context unusable, so it panics with the op's name and the driver's
//! message, which ends the engine thread (the node then reports itself unhealthy).
//!
//! Parts: `linear` (GEMM operands, stacked projections, cuBLAS through [`gemm`]),
//! `attention` (paged attention launches, planned by [`plan`]), `weights` (uploads), `graph`
//! (decode graphs), `sample` (device sampling), `tensor` (what lives on the device), `blocks`
//! and `pinned` (KV blocks moved to and from host memory, page-locked for leases), `gemv`
//! (the decode-sized product kernel), `device` and [`modules`] (the device, its libraries
//! and compiled kernels).

mod attention;
mod blocks;
mod device;
pub mod gemm;
mod gemv;
mod graph;
mod linear;
pub mod modules;
mod pdl;
mod pinned;
pub mod plan;
mod qk;
mod sample;
mod settings;
mod tensor;
mod weights;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaSlice, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg};
use pd_engine::backend::graph::DecodeGraphStep;
use pd_engine::backend::{AttentionMeta, Backend, HostMatrix, NormMlp, QkNormRope};
use pd_engine::error::EngineError;
use pd_engine::kv::KvLayout;
use pd_engine::kv::host_buffer::HostBuffer;
use pd_engine::sampling::{DeviceSample, DeviceSampleRow};
use pd_engine::weights::{DType, TensorView};

pub use device::Device;
pub use gemv::{GEMV_MAX_ROWS, SmallBatchLinear};
use tensor::dtype_code;
pub use tensor::{CudaKvStorage, CudaTensor, CudaWeight};

use crate::CudaError;
use attention::AttentionOut;
use graph::Graphs;
use linear::{Operand, shared_16bit};
use pinned::PinnedPool;
use plan::AttentionPlan;
use qk::KOut;
use weights::weight_vector;

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
    /// Whether the GEMV kernels are launched programmatically dependent on the kernel
    /// before them (`PD_CUDA_PDL=on`, [`pdl`]), and how many were.
    programmatic: AtomicBool,
    programmatic_launches: AtomicU64,
    /// The least number of keys a split-K range takes ([`plan::MIN_KEYS_PER_SPLIT`]).
    min_keys_per_split: AtomicUsize,
}

/// The last uploaded copy of each kind of per-step metadata, reused while unchanged.
#[derive(Default)]
struct Uploads {
    positions: Option<(Vec<u32>, CudaSlice<u32>)>,
    slots: Option<(Vec<u32>, CudaSlice<u32>)>,
    attention: Option<(AttentionMeta, DevicePlan)>,
}

/// An [`AttentionPlan`] on the device.
struct DevicePlan {
    plan: AttentionPlan,
    items: CudaSlice<i32>,
    seqs: CudaSlice<i32>,
    block_tables: CudaSlice<u32>,
}

/// Kernel arguments of `silu_mul` / `silu_mul_16` (see [`CudaBackend::silu_mul_args`]).
struct SiluMulArgs {
    gate: u64,
    up: u64,
    n: u64,
    cols: i32,
    gate_stride: i32,
    up_stride: i32,
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
    /// Open device `ordinal`: check driver, libraries and compute capability, compile the
    /// kernels for it. `gpu_memory_utilization` is the fraction of the card's memory this
    /// process may use (weights, activations and KV together), as vLLM defines it.
    pub fn open(ordinal: usize, gpu_memory_utilization: f64) -> Result<Self, CudaError> {
        if !(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0) {
            return Err(CudaError::BadMemoryUtilization(gpu_memory_utilization));
        }
        let tensor_core_attention = match std::env::var("PD_CUDA_ATTENTION") {
            Err(_) => true,
            Ok(v) if v == "auto" => true,
            Ok(v) if v == "f32" => false,
            Ok(v) => return Err(CudaError::BadAttentionSetting(v)),
        };
        let small_batch_linear = SmallBatchLinear::from_env()?;
        let programmatic = pdl::from_env()?;
        let dev = Device::open(ordinal)?;
        tracing::info!(
            device = %format!("cuda:{ordinal}"),
            gpu = %dev.name,
            compute_capability = %format!("{}.{}", dev.cc.major, dev.cc.minor),
            multiprocessors = dev.num_sms,
            "CUDA device open, kernels compiled"
        );
        let pinned = PinnedPool::new(Arc::clone(&dev.ctx));
        let split_counters = dev
            .stream
            .alloc_zeros::<u32>(plan::max_split_blocks(dev.num_sms as usize))
            .map_err(|e| CudaError::Driver {
                ordinal,
                what: "allocate the split-K counters",
                message: e.to_string(),
            })?;
        Ok(Self {
            dev,
            split_counters,
            tensor_core_attention,
            gpu_memory_utilization,
            kv_dtype: None,
            matrix_dtype: OnceLock::new(),
            weight_bytes: AtomicUsize::new(0),
            uploads: Mutex::new(Uploads::default()),
            graphs: Mutex::new(Graphs::default()),
            gemv_kernel: AtomicBool::new(small_batch_linear == SmallBatchLinear::Kernel),
            pinned,
            launches: AtomicU64::new(0),
            programmatic: AtomicBool::new(programmatic),
            programmatic_launches: AtomicU64::new(0),
            min_keys_per_split: AtomicUsize::new(plan::MIN_KEYS_PER_SPLIT),
        })
    }

    /// [`CudaBackend::open`], storing KV as `kv_dtype`: f32, or bf16 / f16 for half the
    /// memory and traffic; `None` (what `open` does, vLLM's `auto`) stores the dtype of the
    /// model's weight matrices (`--kv-cache-dtype`).
    pub fn open_with(
        ordinal: usize,
        gpu_memory_utilization: f64,
        kv_dtype: Option<DType>,
    ) -> Result<Self, CudaError> {
        let mut backend = Self::open(ordinal, gpu_memory_utilization)?;
        backend.kv_dtype = kv_dtype;
        Ok(backend)
    }

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

    /// Bytes the KV cache may take: the utilization limit minus what the card already has in
    /// use (this process's context, cuBLAS and weights, and anything else on the card) minus
    /// `activation_bytes` of working memory for one engine step.
    pub fn kv_budget_bytes(&self, activation_bytes: usize) -> Result<usize, CudaError> {
        let (free, total) = self.dev.ctx.mem_get_info().map_err(|e| CudaError::Driver {
            ordinal: self.dev.ordinal,
            what: "reading free memory",
            message: e.to_string(),
        })?;
        let limit = (total as f64 * self.gpu_memory_utilization) as usize;
        let used = total - free;
        let needed = used + activation_bytes;
        if needed >= limit {
            return Err(CudaError::OutOfMemory {
                ordinal: self.dev.ordinal,
                utilization: self.gpu_memory_utilization,
                needed_mib: needed >> 20,
                limit_mib: limit >> 20,
                total_mib: total >> 20,
            });
        }
        tracing::info!(
            weights_mib = self.weight_bytes.load(Ordering::Relaxed) >> 20,
            in_use_mib = used >> 20,
            activations_mib = activation_bytes >> 20,
            kv_mib = (limit - needed) >> 20,
            limit_mib = limit >> 20,
            "device memory plan"
        );
        Ok((limit - needed).min(free.saturating_sub(activation_bytes)))
    }

    fn fail(&self, what: &str, e: impl std::fmt::Debug) -> ! {
        panic!("cuda:{}: {what} failed: {e:?}", self.dev.ordinal)
    }

    /// Uninitialised device memory for `len` elements (at least one: CUDA refuses zero).
    fn alloc<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> CudaSlice<T> {
        // SAFETY: every caller writes the elements it later reads (kernels cover their
        // whole output).
        unsafe { self.dev.stream.alloc::<T>(len.max(1)) }.unwrap_or_else(|e| self.fail("alloc", e))
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor::new(rows, cols, self.alloc(rows * cols))
    }

    /// The device address of row 0 of `t` (a buffer of its own, or a view).
    fn rows_ptr(&self, t: &CudaTensor) -> u64 {
        self.ptr(t.buffer()) + (t.offset() * std::mem::size_of::<f32>()) as u64
    }

    fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> CudaSlice<T> {
        if host.is_empty() {
            return self.alloc(1);
        }
        self.dev
            .stream
            .clone_htod(host)
            .unwrap_or_else(|e| self.fail("upload", e))
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

    /// The inputs of `silu_mul` / `silu_mul_16`: `gate` and `up` of one shape, each dense or a
    /// view (the two halves of one stacked gate/up product).
    fn silu_mul_args(&self, gate: &CudaTensor, up: &CudaTensor) -> SiluMulArgs {
        assert_eq!(
            (gate.rows, gate.cols),
            (up.rows, up.cols),
            "silu_mul: shapes"
        );
        SiluMulArgs {
            gate: self.rows_ptr(gate),
            up: self.rows_ptr(up),
            n: gate.len() as u64,
            cols: gate.cols as i32,
            gate_stride: gate.stride() as i32,
            up_stride: up.stride() as i32,
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

/// Threads of an RMSNorm block: two warps for a head (q/k norms), more for a hidden row.
pub(super) fn norm_threads(group: usize) -> u32 {
    if group <= 128 { 64 } else { THREADS }
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
        plan::check_head_dim(layout.head_dim)
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        if !layout.block_size.is_power_of_two() {
            // The attention kernels find a key's block with shifts.
            return Err(EngineError::InvalidRequest(format!(
                "KV block size {} is not a power of two",
                layout.block_size
            )));
        }
        let dtype = self.kv_dtype();
        if layout.dtype != dtype {
            return Err(EngineError::InvalidRequest(format!(
                "a KV layout of {} asked of {} storing KV as {}",
                layout.dtype.torch_name(),
                self.name(),
                dtype.torch_name()
            )));
        }
        let len = num_blocks
            .checked_mul(layout.block_size * layout.token_width() * dtype.size_in_bytes())
            .ok_or_else(|| EngineError::OutOfBlocks("KV cache size overflows".into()))?;
        let oom = |e: cudarc::driver::DriverError| {
            EngineError::OutOfBlocks(format!(
                "cannot allocate {num_blocks} KV blocks ({} MiB) on {}: {e}",
                (num_blocks * layout.block_bytes()) >> 20,
                self.name()
            ))
        };
        let mut k = Vec::with_capacity(layout.num_layers);
        let mut v = Vec::with_capacity(layout.num_layers);
        let mut bases = Vec::with_capacity(2 * layout.num_layers);
        for _ in 0..layout.num_layers {
            let kl = self.dev.stream.alloc_zeros::<u8>(len.max(4)).map_err(oom)?;
            let vl = self.dev.stream.alloc_zeros::<u8>(len.max(4)).map_err(oom)?;
            bases.push(kl.device_ptr(&self.dev.stream).0);
            bases.push(vl.device_ptr(&self.dev.stream).0);
            k.push(kl);
            v.push(vl);
        }
        let bases = self.dev.stream.clone_htod(&bases).map_err(oom)?;
        Ok(CudaKvStorage {
            layout: layout.clone(),
            num_blocks,
            dtype,
            k,
            v,
            bases,
        })
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
        let (dtype, _, cols, table_ptr) = self.matrix(table);
        let out = self.tensor(ids.len(), cols);
        if ids.is_empty() {
            return out;
        }
        // An eager upload lives until the end of the call, after the launch is queued.
        let ids_dev;
        let ids_ptr = match self.capture_inputs() {
            Some(staged) => staged.ids,
            None => {
                ids_dev = self.upload(ids);
                self.ptr(&ids_dev)
            }
        };
        let (code, rows, cols_i) = (dtype_code(dtype), ids.len() as i32, cols as i32);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.embedding);
        b.arg(&table_ptr)
            .arg(&code)
            .arg(&ids_ptr)
            .arg(out.dense())
            .arg(&rows)
            .arg(&cols_i);
        self.launch("embedding", b, Self::per_row(ids.len(), THREADS));
        out
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaWeight, group: usize, eps: f32) -> CudaTensor {
        let w = weight_vector(weight);
        assert_eq!(x.cols % group, 0, "rms_norm: width is whole groups");
        let out = self.tensor(x.rows, x.cols);
        let groups = x.len() / group;
        if groups == 0 {
            return out;
        }
        let (groups_i, group_i) = (groups as i32, group as i32);
        let threads = norm_threads(group);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.rms_norm);
        b.arg(x.dense())
            .arg(w)
            .arg(out.dense())
            .arg(&groups_i)
            .arg(&group_i)
            .arg(&eps);
        self.launch("rms_norm", b, Self::per_row(groups, threads));
        out
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
        assert_eq!(x.cols % group, 0, "rms_norm: width is whole groups");
        let x16 = self.alloc::<u16>(x.len());
        let groups = x.len() / group;
        let (groups_i, group_i, code) = (groups as i32, group as i32, dtype_code(dtype));
        let threads = norm_threads(group);
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.rms_norm_16);
        b.arg(x.dense())
            .arg(weight_vector(norm))
            .arg(&x16)
            .arg(&groups_i)
            .arg(&group_i)
            .arg(&eps)
            .arg(&code);
        self.launch("rms_norm_16", b, Self::per_row(groups, threads));
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
        assert_eq!(positions.len(), x.rows);
        if x.is_empty() {
            return;
        }
        let pos = self.positions_ptr(positions);
        let (rows, cols, hd, th) = (x.rows as i32, x.cols as i32, head_dim as i32, theta as f32);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.rope);
        b.arg(x.dense())
            .arg(&pos)
            .arg(&rows)
            .arg(&cols)
            .arg(&hd)
            .arg(&th);
        self.launch("rope", b, Self::elements(x.len() / 2));
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
        let width = kv.layout.token_width();
        assert_eq!(k.cols, width);
        assert_eq!(v.cols, width);
        assert_eq!(slots.len(), k.rows);
        if slots.is_empty() {
            return;
        }
        let slots_dev = self.slots_ptr(slots);
        let (rows, width_i) = (k.rows as i32, width as i32);
        // v (and k) may be views of one stacked q/k/v product.
        let (k_in, v_in) = (self.rows_ptr(k), self.rows_ptr(v));
        let (k_stride, v_stride) = (k.stride() as i32, v.stride() as i32);
        let code = dtype_code(kv.dtype);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.write_kv);
        b.arg(&kv.k[layer])
            .arg(&kv.v[layer])
            .arg(&code)
            .arg(&k_in)
            .arg(&v_in)
            .arg(&k_stride)
            .arg(&v_stride)
            .arg(&slots_dev)
            .arg(&rows)
            .arg(&width_i);
        self.launch("write_kv", b, Self::per_row(k.rows, 128));
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
        assert_eq!(gate.len(), up.len());
        let out = self.tensor(gate.rows, gate.cols);
        if out.is_empty() {
            return out;
        }
        let a = self.silu_mul_args(gate, up);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.silu_mul);
        b.arg(&a.gate)
            .arg(&a.up)
            .arg(out.dense())
            .arg(&a.n)
            .arg(&a.cols)
            .arg(&a.gate_stride)
            .arg(&a.up_stride);
        self.launch("silu_mul", b, Self::elements(out.len()));
        out
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        assert_eq!(x.len(), y.len());
        if x.is_empty() {
            return;
        }
        let n = x.len() as u64;
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.add_assign);
        b.arg(x.dense()).arg(y.dense()).arg(&n);
        self.launch("add_assign", b, Self::elements(x.len()));
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let out = self.tensor(rows.len(), x.cols);
        if out.is_empty() {
            return out;
        }
        assert!(
            rows.iter().all(|&r| r < x.rows),
            "select_rows: row in range"
        );
        let idx_dev;
        let idx = match self.capture_inputs() {
            Some(staged) => staged.select,
            None => {
                let host: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                idx_dev = self.upload(&host);
                self.ptr(&idx_dev)
            }
        };
        let (n, cols) = (rows.len() as i32, x.cols as i32);
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.select_rows);
        b.arg(x.dense())
            .arg(&idx)
            .arg(out.dense())
            .arg(&n)
            .arg(&cols);
        self.launch("select_rows", b, Self::per_row(rows.len(), THREADS));
        out
    }

    fn to_host(&self, x: &CudaTensor) -> HostMatrix {
        // A view (columns of a stacked product) is copied with the rows' gaps, which are
        // dropped here: the host is the only reader.
        let span = if x.is_empty() {
            0
        } else {
            (x.rows - 1) * x.stride() + x.cols
        };
        let mut copied = vec![0f32; span];
        if span > 0 {
            let src = x.buffer().slice(x.offset()..x.offset() + span);
            self.dev
                .stream
                .memcpy_dtoh(&src, &mut copied)
                .unwrap_or_else(|e| self.fail("copy to host", e));
        }
        self.synchronize();
        let data = if span == x.len() {
            copied
        } else {
            (0..x.rows)
                .flat_map(|r| &copied[r * x.stride()..r * x.stride() + x.cols])
                .copied()
                .collect()
        };
        HostMatrix {
            rows: x.rows,
            cols: x.cols,
            data,
        }
    }

    fn sample(
        &self,
        logits: &CudaTensor,
        rows: &[DeviceSampleRow],
        vocab_limit: usize,
    ) -> Vec<DeviceSample> {
        self.sample_on_device(logits, rows, vocab_limit)
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

    fn host_buffer(&self, len: usize) -> HostBuffer {
        self.pinned.lend(len)
    }

    fn read_blocks(&self, kv: &CudaKvStorage, blocks: &[u32], dst: &mut [u8]) {
        self.copy_blocks_out(kv, blocks, dst);
    }

    fn write_blocks(&self, kv: &mut CudaKvStorage, blocks: &[u32], src: &[&[u8]]) {
        self.copy_blocks_in(kv, blocks, src);
    }
}

/// The device copy of `host`, uploading it only when it differs from the cached one.
fn cached<'a>(
    slot: &'a mut Option<(Vec<u32>, CudaSlice<u32>)>,
    host: &[u32],
    upload: impl FnOnce(&[u32]) -> CudaSlice<u32>,
) -> &'a CudaSlice<u32> {
    if slot.as_ref().map(|(h, _)| h.as_slice()) != Some(host) {
        *slot = Some((host.to_vec(), upload(host)));
    }
    &slot.as_ref().expect("set above").1
}
