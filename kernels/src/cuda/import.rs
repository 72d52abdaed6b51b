//! Imported KV written into device KV storage from the puller's thread, beside the engine's
//! steps (`Backend::block_writer`): a decode node copies each import into the blocks the
//! engine reserved for it as soon as the pull ends, on a stream of its own, so admitting the
//! request costs the engine thread no copy and no wait.
//!
//! Owns that stream, its staging buffer and the ordering rule: each write waits (on the
//! device, not the host) for the work the engine's stream had queued when the reservation
//! was made, so a block freed by a request whose kernels were still running is not written
//! under them. Does not decide which blocks (the engine's reservation) nor move bytes over the
//! network (pd-transport). The batch-at-a-time copies of the engine thread are `blocks`.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg, sys,
};
use pd_engine::kv::handoff::reservation::{BlockWrite, BlockWriter};

use super::blocks::{MAX_GRID_Z, queue_copies_in, transfer_block_bytes};
use super::tensor::CudaKvStorage;
use super::{CudaBackend, THREADS};

/// Device bytes the import writer stages blocks in, allocated once beside KV storage (the
/// memory plan sets them aside: `kv_budget_bytes`). A block larger than this moves alone.
pub(super) const IMPORT_STAGING_BYTES: usize = 16 << 20;

/// What every write of one engine's imports shares.
struct ImportCopier {
    ordinal: usize,
    /// The writer's own stream: its copies and unpack kernels run beside the engine's.
    stream: Arc<CudaStream>,
    /// The engine's stream, which each write waits for up to the reservation.
    engine: Arc<CudaStream>,
    unpack: CudaFunction,
    /// KV storage, kept allocated while a write may still reach it (the engine may be gone).
    _k: Arc<[CudaSlice<u8>]>,
    _v: Arc<[CudaSlice<u8>]>,
    bases: Arc<CudaSlice<u64>>,
    num_layers: usize,
    num_blocks: usize,
    /// Bytes of one layer's K (or V) of one block, and of a whole block.
    part: u64,
    block_bytes: usize,
    per_batch: usize,
    /// One write at a time: they share the host link anyway, and the staging buffer.
    staging: Mutex<CudaSlice<u8>>,
}

impl CudaBackend {
    /// The import writer for `kv` ([`pd_engine::backend::Backend::block_writer`]).
    pub(super) fn import_writer(&self, kv: &CudaKvStorage) -> Result<BlockWriter, DriverError> {
        let block_bytes = transfer_block_bytes(kv);
        let per_batch = (IMPORT_STAGING_BYTES / block_bytes.max(1)).clamp(1, MAX_GRID_Z);
        let stream = self.dev.ctx.new_stream()?;
        // SAFETY: uninitialised, and only ever read by an unpack kernel after the copies of
        // its batch have filled the part it reads (stream order).
        let staging = unsafe { stream.alloc::<u8>(per_batch * block_bytes) }?;
        let copier = Arc::new(ImportCopier {
            ordinal: self.dev.ordinal,
            stream,
            engine: Arc::clone(&self.dev.stream),
            unpack: self.dev.kernels.unpack_blocks.clone(),
            _k: Arc::clone(&kv.k),
            _v: Arc::clone(&kv.v),
            bases: Arc::clone(&kv.bases),
            num_layers: kv.k.len(),
            num_blocks: kv.num_blocks,
            part: kv.block_bytes_per_part() as u64,
            block_bytes,
            per_batch,
            staging: Mutex::new(staging),
        });
        Ok(Arc::new(move || {
            let after = copier.mark_engine_work();
            let copier = Arc::clone(&copier);
            Box::new(move |blocks: &[u32], src: &[&[u8]]| copier.write(&after, blocks, src))
                as BlockWrite
        }))
    }
}

impl ImportCopier {
    fn fail(&self, what: &str, e: impl std::fmt::Debug) -> ! {
        panic!("cuda:{}: {what} failed: {e:?}", self.ordinal)
    }

    /// An event after everything the engine's stream has queued so far (called on the
    /// engine thread when it reserves blocks).
    fn mark_engine_work(&self) -> CudaEvent {
        self.engine
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .unwrap_or_else(|e| self.fail("mark the engine's queued work", e))
    }

    /// `src[i]` into block `blocks[i]`, after `after`; returns once the bytes are there.
    fn write(&self, after: &CudaEvent, blocks: &[u32], src: &[&[u8]]) {
        assert_eq!(src.len(), blocks.len(), "one buffer per block");
        assert!(
            src.iter().all(|s| s.len() == self.block_bytes),
            "block buffer length"
        );
        assert!(
            blocks.iter().all(|&b| (b as usize) < self.num_blocks),
            "block ids in range"
        );
        if blocks.is_empty() {
            return;
        }
        let staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        // Binds the context to this thread too, for the raw copies below.
        if let Err(e) = self.stream.wait(after) {
            self.fail("wait for the engine's queued work", e);
        }
        let ids = self
            .stream
            .clone_htod(blocks)
            .unwrap_or_else(|e| self.fail("upload the import's block ids", e));
        let base = staging.device_ptr(&self.stream).0;
        for (n, (batch, bufs)) in blocks
            .chunks(self.per_batch)
            .zip(src.chunks(self.per_batch))
            .enumerate()
        {
            // The previous batch's unpack has read the staging buffer before these copies
            // overwrite it: both are on this stream.
            // SAFETY: the staging buffer holds `per_batch` blocks; `src` outlives this call,
            // which waits for its copies below; the context was bound by `wait` above.
            let queued = unsafe { queue_copies_in(&self.stream, base, bufs) };
            if let Err(e) = queued {
                self.fail("copy imported KV blocks to the device", e);
            }
            let first = n * self.per_batch;
            let ids = ids.slice(first..first + batch.len());
            let mut b = self.stream.launch_builder(&self.unpack);
            b.arg(self.bases.as_ref())
                .arg(&ids)
                .arg(&*staging)
                .arg(&self.part);
            let grid = LaunchConfig {
                grid_dim: (self.num_layers as u32, 2, batch.len() as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: unpack_blocks takes (bases, block ids, staging, part bytes); the ids
            // are in range (checked above), the staging buffer holds the batch's blocks in
            // the transfer layout, one thread block per (layer, K or V, block).
            if let Err(e) = unsafe { b.launch(grid) } {
                self.fail("unpack_blocks (import)", e);
            }
        }
        // The buffers are page-locked (lent by `host_allocator`) and go back to the pool,
        // and the reservation to the engine, once this returns: wait for the copies.
        if let Err(e) = self.stream.synchronize() {
            self.fail("synchronize the import stream", e);
        }
    }
}
