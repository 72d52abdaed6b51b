//! What the CUDA backend keeps on the device: activations, weights and paged KV storage.

use cudarc::driver::CudaSlice;
use pd_engine::kv::KvLayout;
use pd_engine::weights::DType;

/// A row-major `f32` matrix in device memory. The buffer holds at least one element (a zero
/// byte allocation is an error in CUDA), so `rows * cols` may be smaller than its length.
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<f32>,
}

impl CudaTensor {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A weight on the device: matrices in their stored dtype (read in place by cuBLAS and the
/// embedding gather), 1-D norm vectors widened to `f32` once (a few KiB).
pub enum CudaWeight {
    Matrix {
        dtype: DType,
        rows: usize,
        cols: usize,
        data: CudaSlice<u8>,
    },
    Vector(CudaSlice<f32>),
}

/// The code `common.cuh` gives each dtype (`DTYPE_*`).
pub fn dtype_code(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// Paged KV for all layers: per layer one K and one V buffer of
/// `[num_blocks, block_size, num_kv_heads, head_dim]` f32 (the layout every backend shares,
/// so blocks move between CPU and CUDA nodes unchanged).
pub struct CudaKvStorage {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub k: Vec<CudaSlice<f32>>,
    pub v: Vec<CudaSlice<f32>>,
    /// Device addresses `[k0, v0, k1, v1, ...]` for the block pack / unpack kernels.
    pub bases: CudaSlice<u64>,
}

impl CudaKvStorage {
    /// f32 values of K (or V) in one block of one layer.
    pub fn block_len(&self) -> usize {
        self.layout.block_size * self.layout.token_width()
    }
}
