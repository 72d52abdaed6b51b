//! Opening the CUDA backend and sizing its device memory: the settings read at start, the
//! device and its compiled kernels, the KV budget under `--gpu-memory-utilization` (vLLM's
//! meaning), and the KV storage itself. What runs on the device afterwards is elsewhere.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::DevicePtr;
use pd_engine::backend::Backend;
use pd_engine::error::EngineError;
use pd_engine::kv::KvLayout;
use pd_engine::weights::DType;

use super::gemv::SmallBatchLinear;
use super::graph::Graphs;
use super::import::IMPORT_STAGING_BYTES;
use super::pinned::PinnedPool;
use super::pool::{BufferPools, EAGER_IDLE_BYTES};
use super::{CudaBackend, CudaKvStorage, Device, Uploads, pdl, plan};
use crate::CudaError;

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
        let moe_on_device = super::moe::on_device_from_env()?;
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
            allocations: AtomicU64::new(0),
            pools: BufferPools::new(),
            programmatic: AtomicBool::new(programmatic),
            programmatic_launches: AtomicU64::new(0),
            min_keys_per_split: AtomicUsize::new(plan::MIN_KEYS_PER_SPLIT),
            moe_on_device: AtomicBool::new(moe_on_device),
            moe_layers: AtomicBool::new(false),
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

    /// Bytes the KV cache may take: the utilization limit minus what the card already has in
    /// use (this process's context, cuBLAS and weights, and anything else on the card) minus
    /// `activation_bytes` of working memory (the engine's reserve: a step's activations, and
    /// the decode graphs' buffers when they are on), the import writer's staging buffer
    /// (`IMPORT_STAGING_BYTES`, 16 MiB) and what the eager buffer pool may keep idle beside a
    /// step's live buffers (`EAGER_IDLE_BYTES`, 256 MiB).
    pub fn kv_budget_bytes(&self, activation_bytes: usize) -> Result<usize, CudaError> {
        let activation_bytes = activation_bytes + IMPORT_STAGING_BYTES + EAGER_IDLE_BYTES;
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

    /// KV storage for `num_blocks` blocks of `layout`, zeroed: one buffer per layer for K and
    /// one for V, and the table of their addresses the block copies use.
    pub(super) fn alloc_kv_storage(
        &self,
        layout: &KvLayout,
        num_blocks: usize,
    ) -> Result<CudaKvStorage, EngineError> {
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
            k: k.into(),
            v: v.into(),
            bases: Arc::new(bases),
        })
    }
}
