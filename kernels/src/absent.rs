//! The CUDA backend in a build without the `cuda` feature: a type with no values. Its
//! [`CudaBackend::open`] always fails with [`CudaError::NotBuilt`], so no value of it ever
//! exists and its [`Backend`] methods can never run (each is an empty `match`). It lets the
//! node binaries and `pdctl` pick a device with one `match`, with no `cfg` of their own.

use pd_engine::backend::{AttentionMeta, Backend, HostMatrix};
use pd_engine::error::EngineError;
use pd_engine::kv::KvLayout;
use pd_engine::sampling::{DeviceSample, DeviceSampleRow, PromptLogprob, PromptLogprobRow};
use pd_engine::weights::TensorView;

use crate::CudaError;

/// No CUDA backend in this build (see the module docs).
#[derive(Debug)]
pub enum CudaBackend {}

/// Tensors, weights and KV storage of a backend that cannot exist.
#[derive(Debug)]
pub enum Never {}

impl CudaBackend {
    /// Always [`CudaError::NotBuilt`]: this binary was built without the `cuda` feature.
    pub fn open(ordinal: usize, gpu_memory_utilization: f64) -> Result<Self, CudaError> {
        let _ = gpu_memory_utilization;
        Err(CudaError::NotBuilt { ordinal })
    }

    /// Always [`CudaError::NotBuilt`], as [`CudaBackend::open`].
    pub fn open_with(
        ordinal: usize,
        gpu_memory_utilization: f64,
        kv_dtype: Option<pd_engine::weights::DType>,
    ) -> Result<Self, CudaError> {
        let _ = kv_dtype;
        Self::open(ordinal, gpu_memory_utilization)
    }
}

impl Backend for CudaBackend {
    type Tensor = Never;
    type Weight = Never;
    type KvStorage = Never;

    fn name(&self) -> String {
        match *self {}
    }
    fn load_weight(&self, _: &str, _: TensorView) -> Result<Never, EngineError> {
        match *self {}
    }
    fn alloc_kv(&self, _: &KvLayout, _: usize) -> Result<Never, EngineError> {
        match *self {}
    }
    fn embedding(&self, _: &Never, _: &[u32]) -> Never {
        match *self {}
    }
    fn rms_norm(&self, _: &Never, _: &Never, _: usize, _: f32) -> Never {
        match *self {}
    }
    fn linear(&self, _: &Never, _: &Never) -> Never {
        match *self {}
    }
    fn rope(&self, _: &mut Never, _: &[u32], _: usize, _: f64) {
        match *self {}
    }
    fn write_kv(&self, _: &mut Never, _: usize, _: &Never, _: &Never, _: &[u32]) {
        match *self {}
    }
    fn paged_attention(&self, _: &Never, _: &Never, _: usize, _: &AttentionMeta) -> Never {
        match *self {}
    }
    fn silu_mul(&self, _: &Never, _: &Never) -> Never {
        match *self {}
    }
    fn add_assign(&self, _: &mut Never, _: &Never) {
        match *self {}
    }
    fn add_rows_scaled(&self, _: &mut Never, _: &Never, _: &[usize], _: &[f32]) {
        match *self {}
    }
    fn select_rows(&self, _: &Never, _: &[usize]) -> Never {
        match *self {}
    }
    fn to_host(&self, _: &Never) -> HostMatrix {
        match *self {}
    }
    fn sample(&self, _: &Never, _: &[DeviceSampleRow], _: usize) -> Vec<DeviceSample> {
        match *self {}
    }
    fn prompt_logprobs(&self, _: &Never, _: &[PromptLogprobRow], _: usize) -> Vec<PromptLogprob> {
        match *self {}
    }
    fn read_block(&self, _: &Never, _: u32, _: &mut [u8]) {
        match *self {}
    }
    fn write_block(&self, _: &mut Never, _: u32, _: &[u8]) {
        match *self {}
    }
}
