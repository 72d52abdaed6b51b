//! Borrowed views of stored weight matrices, in their own dtype, for the CPU kernels.

use crate::weights::DType;

/// A `[rows, cols]` row-major matrix stored as little-endian `dtype` in `bytes`.
/// `bytes` need not be aligned: kernels use unaligned loads, so weights are read straight
/// from the memory-mapped checkpoint without a copy.
#[derive(Debug, Clone, Copy)]
pub struct WeightMatrix<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

impl<'a> WeightMatrix<'a> {
    pub fn new(dtype: DType, rows: usize, cols: usize, bytes: &'a [u8]) -> Self {
        assert_eq!(
            bytes.len(),
            rows * cols * dtype.size_in_bytes(),
            "weight byte length"
        );
        Self {
            dtype,
            rows,
            cols,
            bytes,
        }
    }

    /// Bytes of row `r`.
    pub fn row_bytes(&self, r: usize) -> &'a [u8] {
        let w = self.cols * self.dtype.size_in_bytes();
        &self.bytes[r * w..(r + 1) * w]
    }
}
