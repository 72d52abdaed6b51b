//! What the CUDA backend keeps on the device: activations, weights and paged KV storage.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::pool::DeviceBuffer;
use pd_engine::kv::KvLayout;
use pd_engine::weights::DType;

/// A row-major `f32` matrix in device memory: its own buffer, or a view of some columns of
/// a wider product that it shares (the q / k / v and gate / up outputs of one stacked GEMM,
/// see [`CudaTensor::split_cols`]). Only the ops that take a row stride accept a view; every
/// other op asks for [`CudaTensor::dense`], which refuses one. The buffer holds at least one
/// element (a zero byte allocation is an error in CUDA), so `rows * cols` may be smaller
/// than its length.
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    data: Arc<DeviceBuffer<f32>>,
    /// Elements before row 0 in `data`, and from one row to the next.
    offset: usize,
    stride: usize,
}

impl CudaTensor {
    /// Rows back to back in `data`.
    pub fn new(rows: usize, cols: usize, data: CudaSlice<f32>) -> Self {
        Self::in_buffer(rows, cols, DeviceBuffer::unpooled(data))
    }

    /// Rows back to back in a buffer that may go back to the backend's pool.
    pub(super) fn in_buffer(rows: usize, cols: usize, data: DeviceBuffer<f32>) -> Self {
        Self {
            rows,
            cols,
            data: Arc::new(data),
            offset: 0,
            stride: cols,
        }
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer of a tensor whose rows lie back to back from its start.
    ///
    /// # Panics
    /// On a view of a wider product's columns: the op was handed a view it cannot read.
    pub fn dense(&self) -> &CudaSlice<f32> {
        assert!(
            self.offset == 0 && (self.stride == self.cols || self.rows <= 1),
            "a view of {} of {} columns passed to an op that reads dense rows",
            self.cols,
            self.stride
        );
        &self.data
    }

    /// The whole buffer, [`Self::offset`] and [`Self::stride`] say where the rows are.
    pub fn buffer(&self) -> &CudaSlice<f32> {
        &self.data
    }

    /// Elements before row 0 in [`Self::buffer`].
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Elements from one row to the next in [`Self::buffer`].
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Views of consecutive column ranges of widths `widths` (which must add up to `cols`),
    /// sharing this tensor's buffer.
    pub fn split_cols<const N: usize>(self, widths: [usize; N]) -> [CudaTensor; N] {
        assert_eq!(
            widths.iter().sum::<usize>(),
            self.cols,
            "split_cols: widths"
        );
        let mut start = self.offset;
        widths.map(|cols| {
            let view = CudaTensor {
                rows: self.rows,
                cols,
                data: self.data.clone(),
                offset: start,
                stride: self.stride,
            };
            start += cols;
            view
        })
    }
}

/// A weight on the device: matrices in their stored dtype (read in place by cuBLAS and the
/// embedding gather), 1-D norm vectors widened to `f32` once (a few KiB). Projections that
/// share their input are uploaded side by side into one buffer ([`Backend::load_stacked`]):
/// each is then a range of it, and one GEMM multiplies them all.
///
/// [`Backend::load_stacked`]: pd_engine::backend::Backend::load_stacked
pub enum CudaWeight {
    Matrix {
        dtype: DType,
        rows: usize,
        cols: usize,
        data: Arc<CudaSlice<u8>>,
        /// Byte offset of row 0 in `data`.
        offset: usize,
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
/// `[num_blocks, block_size, num_kv_heads, head_dim]` elements of `dtype` (the layout every
/// backend shares; blocks move between nodes as stored, so CPU and CUDA nodes with the same
/// cache type exchange them).
pub struct CudaKvStorage {
    pub layout: KvLayout,
    pub num_blocks: usize,
    /// `--kv-cache-dtype`: f32, or the 16-bit bf16 / f16 (half the memory and traffic).
    pub dtype: DType,
    /// Shared (not copied) with the import writer ([`pd_engine::backend::Backend::block_writer`]),
    /// which keeps them allocated while it may still write them.
    pub k: Arc<[CudaSlice<u8>]>,
    pub v: Arc<[CudaSlice<u8>]>,
    /// Device addresses `[k0, v0, k1, v1, ...]` for the block pack / unpack kernels.
    pub bases: Arc<CudaSlice<u64>>,
}

impl CudaKvStorage {
    /// Elements of K (or V) in one block of one layer.
    pub fn block_len(&self) -> usize {
        self.layout.block_size * self.layout.token_width()
    }

    /// Bytes of K (or V) in one block of one layer.
    pub fn block_bytes_per_part(&self) -> usize {
        self.block_len() * self.dtype.size_in_bytes()
    }
}
