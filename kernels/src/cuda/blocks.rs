//! KV blocks out of and into device storage in the transfer layout (`Backend::read_blocks`,
//! `Backend::write_blocks`), a batch at a time: a lease, a spill to the host tier or an
//! import moves many blocks, and one gather kernel, one copy and one synchronization per
//! batch replace one of each per block. Does not decide which blocks move (the engine does).

use cudarc::driver::{CudaStream, DriverError, LaunchConfig, PushKernelArg, sys};

use super::tensor::CudaKvStorage;
use super::{CudaBackend, THREADS};

/// Most bytes of blocks staged in device memory at once. Blocks move between engine steps,
/// when the step's working memory (`step_activation_bytes`: at least 256 MiB) is free.
const STAGING_BYTES: usize = 64 << 20;

/// A grid's z dimension is at most 65,535 blocks.
pub(super) const MAX_GRID_Z: usize = 65_535;

impl CudaBackend {
    /// Copies `blocks` out of KV storage into `dst`, block `i` of the list at
    /// `i * block_bytes`, each in the transfer layout.
    pub(super) fn copy_blocks_out(&self, kv: &CudaKvStorage, blocks: &[u32], dst: &mut [u8]) {
        let block_bytes = transfer_block_bytes(kv);
        assert_eq!(
            dst.len(),
            blocks.len() * block_bytes,
            "blocks buffer length"
        );
        check_ids(kv, blocks);
        if blocks.is_empty() {
            return;
        }
        let per_batch = batch_blocks(block_bytes).min(blocks.len());
        let staging = self.alloc::<u8>(per_batch * block_bytes);
        let part = kv.block_bytes_per_part() as u64;
        for (ids, out) in blocks
            .chunks(per_batch)
            .zip(dst.chunks_mut(per_batch * block_bytes))
        {
            let ids_dev = self.upload(ids);
            let mut b = self
                .dev
                .stream
                .launch_builder(&self.dev.kernels.pack_blocks);
            b.arg(kv.bases.as_ref())
                .arg(&ids_dev)
                .arg(&staging)
                .arg(&part);
            self.launch("pack_blocks", b, grid(kv, ids.len()));
            // A plain host slice (page-locked when the lease's buffer was lent by
            // `host_buffer`, which makes the copy itself faster): the copy returns once it is
            // done, so the staging buffer is free for the next batch (and stream order would
            // keep it safe anyway).
            self.dev
                .stream
                .memcpy_dtoh(&staging.slice(..out.len()), out)
                .unwrap_or_else(|e| self.fail("copy KV blocks to host", e));
        }
        self.synchronize();
    }

    /// Copies `src[i]` (each one block in the transfer layout) into block `blocks[i]` of KV
    /// storage.
    pub(super) fn copy_blocks_in(&self, kv: &mut CudaKvStorage, blocks: &[u32], src: &[&[u8]]) {
        let block_bytes = transfer_block_bytes(kv);
        assert_eq!(src.len(), blocks.len(), "one buffer per block");
        assert!(
            src.iter().all(|s| s.len() == block_bytes),
            "block buffer length"
        );
        check_ids(kv, blocks);
        if blocks.is_empty() {
            return;
        }
        let per_batch = batch_blocks(block_bytes).min(blocks.len());
        let staging = self.alloc::<u8>(per_batch * block_bytes);
        let part = kv.block_bytes_per_part() as u64;
        if let Err(e) = self.dev.stream.context().bind_to_thread() {
            self.fail("copy KV blocks to the device", e);
        }
        for (ids, bufs) in blocks.chunks(per_batch).zip(src.chunks(per_batch)) {
            // SAFETY: the staging buffer has room for the batch (`per_batch` blocks); `bufs`
            // outlive this call, which waits for its copies before it returns (below).
            let queued = unsafe { queue_copies_in(&self.dev.stream, self.ptr(&staging), bufs) };
            if let Err(e) = queued {
                self.fail("copy KV blocks to the device", e);
            }
            let ids_dev = self.upload(ids);
            let mut b = self
                .dev
                .stream
                .launch_builder(&self.dev.kernels.unpack_blocks);
            b.arg(kv.bases.as_ref())
                .arg(&ids_dev)
                .arg(&staging)
                .arg(&part);
            self.launch("unpack_blocks", b, grid(kv, ids.len()));
        }
        // The staging and id buffers are freed stream-ordered, after the kernels read them;
        // the next batch's copies into staging wait for this batch's kernel the same way.
        // A copy out of page-locked memory (the host tier's batch buffer, an import's block
        // buffers: `host_allocator`'s) is still reading `src` when it has been queued; the
        // callers refill or recycle those buffers as soon as this returns, so wait here.
        self.synchronize();
    }
}

/// Bytes of one block across all layers, K and V: the transfer layout's block.
pub(super) fn transfer_block_bytes(kv: &CudaKvStorage) -> usize {
    // The kernels copy 8-byte words: head_dim is a multiple of 32 (`alloc_kv` checks).
    assert!(
        kv.block_bytes_per_part().is_multiple_of(8),
        "KV block parts of whole 8-byte words"
    );
    kv.layout.block_bytes()
}

fn check_ids(kv: &CudaKvStorage, blocks: &[u32]) {
    assert!(
        blocks.iter().all(|&b| (b as usize) < kv.num_blocks),
        "block ids in range"
    );
}

/// `bufs` as the fewest (address, length) ranges covering the same bytes in order: neighbours
/// that continue each other in memory are joined. Ranges, not slices: two neighbours may
/// belong to different allocations, which no Rust slice may span (a copy may).
fn contiguous_runs(bufs: &[&[u8]]) -> Vec<(*const u8, usize)> {
    let mut runs: Vec<(*const u8, usize)> = Vec::new();
    for buf in bufs {
        match runs.last_mut() {
            Some((start, len)) if start.wrapping_add(*len) == buf.as_ptr() => *len += buf.len(),
            _ => runs.push((buf.as_ptr(), buf.len())),
        }
    }
    runs
}

/// Queues the copies of `bufs`, back to back from device address `dst`, on `stream`: one copy
/// per run of blocks that lie back to back in host memory (a host-tier batch is one buffer:
/// one copy).
///
/// # Safety
/// `dst` must have room for all of `bufs`' bytes, and `bufs` must stay allocated and
/// unwritten until `stream` has run the copies (the callers synchronize before returning).
/// The context must be bound to this thread.
pub(super) unsafe fn queue_copies_in(
    stream: &CudaStream,
    dst: u64,
    bufs: &[&[u8]],
) -> Result<(), DriverError> {
    let mut at = dst;
    for (start, len) in contiguous_runs(bufs) {
        // SAFETY: the runs cover `bufs` once each, in order, and every byte of a run lies in
        // one of them; `dst` has room for them all and `bufs` outlive the copy (the
        // caller's contract).
        unsafe { sys::cuMemcpyHtoDAsync_v2(at, start.cast(), len, stream.cu_stream()) }.result()?;
        at += len as u64;
    }
    Ok(())
}

/// Blocks per batch: as many as fit in [`STAGING_BYTES`], at least one.
fn batch_blocks(block_bytes: usize) -> usize {
    (STAGING_BYTES / block_bytes.max(1)).clamp(1, MAX_GRID_Z)
}

/// pack / unpack: one thread block per (layer, K or V, block of the batch).
fn grid(kv: &CudaKvStorage, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (kv.k.len() as u32, 2, n as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_blocks_join_into_one_copy() {
        let one = [7u8; 12];
        let other = [9u8; 4];
        let parts: Vec<&[u8]> = vec![&one[..4], &one[4..8], &other, &one[8..], &one[..4]];
        let runs = contiguous_runs(&parts);
        assert_eq!(
            runs,
            [
                (one.as_ptr(), 8),
                (other.as_ptr(), 4),
                (one[8..].as_ptr(), 4),
                (one.as_ptr(), 4)
            ],
            "only the first two continue each other"
        );
        assert!(contiguous_runs(&[]).is_empty());
    }

    #[test]
    fn batches_stay_within_the_staging_budget() {
        // Qwen3-0.6B with a bf16 cache: 28 layers x 2 x 16 tokens x 8 heads x 128 x 2 bytes.
        let qwen3_06b = 28 * 2 * 16 * 8 * 128 * 2;
        assert_eq!(batch_blocks(qwen3_06b), 36);
        assert!(batch_blocks(qwen3_06b) * qwen3_06b <= STAGING_BYTES);
        // A block larger than the budget still moves, alone.
        assert_eq!(batch_blocks(STAGING_BYTES * 2), 1);
        // Tiny blocks are bounded by the grid.
        assert_eq!(batch_blocks(16), MAX_GRID_Z);
    }
}
