//! The CUDA backend's run-time choices that benchmarks and tests switch between steps (what
//! multiplies decode-sized batches, programmatic dependent launch, the least keys of a
//! split-K range, where MoE layers are routed) and its launch counters. The choices'
//! defaults and environment variables are [`super::gemv`]'s, [`super::pdl`]'s and `moe`'s;
//! what each one does is in those modules and [`super::plan`].

use std::sync::atomic::Ordering;

use super::CudaBackend;
use super::gemv::SmallBatchLinear;

impl CudaBackend {
    /// Choose what multiplies decode-sized batches (≤ 8 rows) with 16-bit weights from the
    /// next step on (decode graphs captured with the other choice are dropped and captured
    /// again); `open` takes it from `PD_CUDA_GEMV`. For benchmarks and tests that compare the
    /// two; call it between steps.
    pub fn set_small_batch_linear(&self, choice: SmallBatchLinear) {
        let kernel = choice == SmallBatchLinear::Kernel;
        if self.gemv_kernel.swap(kernel, Ordering::Relaxed) != kernel {
            self.drop_captured_graphs();
        }
    }

    /// What multiplies decode-sized batches with 16-bit weights.
    pub fn small_batch_linear(&self) -> SmallBatchLinear {
        if self.gemv_kernel.load(Ordering::Relaxed) {
            SmallBatchLinear::Kernel
        } else {
            SmallBatchLinear::Cublas
        }
    }

    /// Launch the GEMV kernels programmatically dependent on the kernel before them
    /// (Hopper's programmatic dependent launch; ignored below compute capability 9.0) from
    /// the next step on; `open` takes it from `PD_CUDA_PDL`. Decode graphs captured the
    /// other way are dropped and captured again. For benchmarks and tests; call it between
    /// steps.
    pub fn set_programmatic_launch(&self, on: bool) {
        if self.programmatic.swap(on, Ordering::Relaxed) != on {
            self.drop_captured_graphs();
        }
    }

    /// Split decode attention into key ranges of at least `keys` (default
    /// [`super::plan::MIN_KEYS_PER_SPLIT`]; 0 is taken as 1) from the next step on, dropping the
    /// cached attention plan and captured decode graphs. For the benchmark, which measures
    /// what the default should be; call it between steps.
    pub fn set_min_keys_per_split(&self, keys: usize) {
        let keys = keys.max(1);
        if self.min_keys_per_split.swap(keys, Ordering::Relaxed) != keys {
            self.uploads.lock().expect("uploads lock").attention = None;
            self.drop_captured_graphs();
        }
    }

    /// Route Qwen3-MoE layers on the device (`true`, the default) or every batch on the
    /// host, expert by expert (`false`; decode graphs of MoE models then fail to capture and
    /// turn themselves off); `open` takes it from `PD_CUDA_MOE`. For the benchmark, which
    /// measures one against the other; call it between steps.
    pub fn set_moe_on_device(&self, on: bool) {
        if self.moe_on_device.swap(on, Ordering::Relaxed) != on {
            self.drop_captured_graphs();
        }
    }

    /// The least number of keys a split-K range takes.
    pub fn min_keys_per_split(&self) -> usize {
        self.min_keys_per_split.load(Ordering::Relaxed)
    }

    /// Whether programmatic dependent launch is asked for (`PD_CUDA_PDL=on`).
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic.load(Ordering::Relaxed)
    }

    /// Kernel launches issued with the programmatic-dependence attribute (a subset of
    /// [`Self::kernel_launches`]).
    pub fn programmatic_launches(&self) -> u64 {
        self.programmatic_launches.load(Ordering::Relaxed)
    }

    /// Count one launch about to be issued.
    pub(super) fn count_launch(&self, programmatic: bool) {
        self.launches.fetch_add(1, Ordering::Relaxed);
        if programmatic {
            self.programmatic_launches.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Kernel launches this backend has issued (recorded into a graph during a capture
    /// included; graph replays and cuBLAS's own kernels not): tests and benchmarks read what
    /// an op costs in launches from its difference.
    pub fn kernel_launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// Device buffers this backend has allocated on its stream for activations and uploads
    /// (`cuMemAllocAsync`; in a capture, a graph memory node): each is also freed on the
    /// stream when dropped, so between two kernels of a step it stands between them.
    pub fn stream_allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }

    /// Bytes of idle buffers the backend keeps for its ops: for eager steps (at most
    /// 256 MiB) and for decode graphs (what their captures need).
    pub fn pooled_bytes(&self) -> (usize, usize) {
        self.pools.idle_bytes()
    }
}
