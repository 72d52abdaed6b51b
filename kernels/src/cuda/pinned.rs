//! Page-locked host buffers lent for KV copied out of the device (a GPU prefill node's lease,
//! the host tier's batches) and into it (a GPU decode node's imports, received straight into
//! them): `Backend::host_allocator`. A copy between the device and page-locked memory runs at
//! the link's speed; one through pageable memory goes through the driver's staging buffer.
//! Pinning is slow (milliseconds per hundreds of MB), so a returned buffer is kept for the
//! next request of a fitting size, all within one budget; past it, callers get heap memory.
//! Does not decide what is copied.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, PinnedHostSlice};
use pd_engine::kv::handoff::host_buffer::{HostBuffer, HostBytes, heap_buffer};

/// Most page-locked bytes lent and kept together.
pub const PINNED_BUDGET: usize = 4 << 30;

/// Sizes round up to this. Small enough that a block-sized buffer (an import receives block
/// by block: 1.75 MiB for Qwen3-0.6B in bf16, 2.25 MiB for Qwen3-8B) wastes little of the
/// budget; buffers of similar sizes still reuse each other (up to twice the request).
const GRANULE: usize = 256 << 10;

/// What [`Shelf::take`] found for a request.
#[derive(Debug, PartialEq, Eq)]
enum Take<B> {
    /// A kept buffer large enough (and not more than twice the request).
    Reuse(B),
    /// None fits: allocate this many bytes, after freeing `evict` (kept buffers given up to
    /// stay within the budget).
    Allocate { bytes: usize, evict: Vec<B> },
    /// Even with nothing kept the budget would be exceeded: use heap memory.
    OverBudget,
}

/// The pool's bookkeeping, apart from CUDA: buffers kept for reuse and bytes lent out, within
/// a budget. `B` is a buffer, `cap` its size in bytes.
#[derive(Debug)]
struct Shelf<B> {
    budget: usize,
    lent: usize,
    kept: Vec<(usize, B)>,
}

impl<B> Shelf<B> {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            lent: 0,
            kept: Vec::new(),
        }
    }

    fn kept_bytes(&self) -> usize {
        self.kept.iter().map(|(cap, _)| cap).sum()
    }

    /// A buffer for `len` bytes (`len` > 0).
    fn take(&mut self, len: usize) -> Take<B> {
        let best = self
            .kept
            .iter()
            .enumerate()
            .filter(|(_, (cap, _))| *cap >= len && *cap / 2 <= len)
            .min_by_key(|(_, (cap, _))| *cap)
            .map(|(i, _)| i);
        if let Some(i) = best {
            let (cap, b) = self.kept.swap_remove(i);
            self.lent += cap;
            return Take::Reuse(b);
        }
        let bytes = len.div_ceil(GRANULE) * GRANULE;
        if self.lent + bytes > self.budget {
            return Take::OverBudget;
        }
        // Give up kept buffers, largest first, until the new one fits beside them.
        let mut evict = Vec::new();
        self.kept.sort_by_key(|(cap, _)| *cap);
        while self.lent + self.kept_bytes() + bytes > self.budget {
            let (_, b) = self.kept.pop().expect("kept buffers cover the excess");
            evict.push(b);
        }
        self.lent += bytes;
        Take::Allocate { bytes, evict }
    }

    /// Record the allocation [`Take::Allocate`] asked for as failed.
    fn not_allocated(&mut self, bytes: usize) {
        self.lent -= bytes;
    }

    /// A lent buffer of `cap` bytes comes back: kept for reuse.
    fn give_back(&mut self, cap: usize, b: B) {
        self.lent -= cap;
        self.kept.push((cap, b));
    }
}

/// The page-locked buffers of one device's context.
#[derive(Debug)]
pub(super) struct PinnedPool {
    ctx: Arc<CudaContext>,
    shelf: Mutex<Shelf<PinnedHostSlice<u8>>>,
}

impl PinnedPool {
    pub(super) fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Self {
            ctx,
            shelf: Mutex::new(Shelf::new(PINNED_BUDGET)),
        })
    }

    /// `len` bytes of page-locked memory, or of heap memory when the budget is spent or the
    /// driver cannot pin more (a host short of lockable memory): the copy is then slower,
    /// never refused. Contents are unspecified (the caller overwrites them). Any thread may
    /// lend, also while the engine's thread captures a decode graph: captures use CUDA's
    /// thread-local mode (graph.rs), which restricts only the capturing thread's calls.
    pub(super) fn lend(self: &Arc<Self>, len: usize) -> HostBuffer {
        if len == 0 {
            return heap_buffer(0);
        }
        let take = self.lock().take(len);
        let slice = match take {
            Take::Reuse(slice) => slice,
            Take::OverBudget => return heap_buffer(len),
            Take::Allocate { bytes, evict } => {
                self.free(evict);
                // SAFETY: page-locked memory of `bytes` bytes; its contents are unspecified,
                // which `HostBytes` readers never see before `read_blocks` writes them.
                match unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) } {
                    Ok(slice) => slice,
                    Err(e) => {
                        self.lock().not_allocated(bytes);
                        tracing::warn!(
                            bytes,
                            "cannot page-lock host memory for a KV copy ({e}); using heap memory"
                        );
                        return heap_buffer(len);
                    }
                }
            }
        };
        // The address is taken here, with the context current on the lending thread (the
        // engine's, or an importer's), so that readers make no driver call. No copy is ever
        // queued through the slice's own event (the backend copies as a plain host slice and
        // waits), so this does not wait.
        let _ = self.ctx.bind_to_thread();
        let ptr = match slice.as_ptr() {
            Ok(p) => p.cast_mut(),
            Err(e) => {
                tracing::warn!("page-locked buffer unusable ({e}); using heap memory");
                self.lock().give_back(slice.len(), slice);
                return heap_buffer(len);
            }
        };
        Box::new(PinnedBytes {
            slice: Some(slice),
            ptr,
            len,
            pool: Arc::clone(self),
        })
    }

    /// (bytes lent out, bytes kept for reuse).
    pub(super) fn usage(&self) -> (usize, usize) {
        let shelf = self.lock();
        (shelf.lent, shelf.kept_bytes())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shelf<PinnedHostSlice<u8>>> {
        self.shelf.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn free(&self, slices: Vec<PinnedHostSlice<u8>>) {
        if !slices.is_empty() {
            // cuMemFreeHost wants the context current on the thread that frees.
            let _ = self.ctx.bind_to_thread();
            drop(slices);
        }
    }
}

impl Drop for PinnedPool {
    fn drop(&mut self) {
        // The kept buffers are freed here, maybe on a thread that last held a lease.
        let kept = std::mem::take(&mut self.lock().kept);
        self.free(kept.into_iter().map(|(_, slice)| slice).collect());
    }
}

/// A lent page-locked buffer; back to its pool when dropped.
#[derive(Debug)]
struct PinnedBytes {
    /// `Some` until dropped.
    slice: Option<PinnedHostSlice<u8>>,
    /// The slice's host address.
    ptr: *mut u8,
    len: usize,
    pool: Arc<PinnedPool>,
}

// SAFETY: `ptr` points into `slice`, page-locked host memory owned by this value (not tied to
// a thread); shared access only reads it (`as_bytes`), writes need `&mut self`.
unsafe impl Send for PinnedBytes {}
// SAFETY: as for Send.
unsafe impl Sync for PinnedBytes {}

impl HostBytes for PinnedBytes {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` starts at least `len` bytes of host memory, alive while `self` is
        // (the slice is dropped only in `drop`), and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        if let Some(slice) = self.slice.take() {
            let cap = slice.len();
            self.pool.lock().give_back(cap, slice);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    #[test]
    fn reuses_a_returned_buffer_of_a_fitting_size() {
        let mut shelf = Shelf::new(64 * MB);
        let Take::Allocate { bytes, evict } = shelf.take(4 * MB - 1000) else {
            panic!("nothing to reuse yet");
        };
        assert_eq!(
            (bytes, evict.len()),
            (4 * MB, 0),
            "rounded up to the granule"
        );
        shelf.give_back(bytes, 'a');
        assert_eq!((shelf.lent, shelf.kept_bytes()), (0, 4 * MB));
        assert_eq!(shelf.take(4 * MB), Take::Reuse('a'), "the same size again");
        shelf.give_back(4 * MB, 'a');
        assert!(
            matches!(shelf.take(MB), Take::Allocate { .. }),
            "a buffer over twice the request is not used for it"
        );
        // Qwen3-8B's bf16 block (36 layers x 2 x 16 tokens x 8 heads x 128 x 2 bytes) is whole
        // granules: a decode node's import buffers take what they hold.
        let block_8b = 36 * 2 * 16 * 8 * 128 * 2;
        assert_eq!(
            Shelf::<char>::new(64 * MB).take(block_8b),
            Take::Allocate {
                bytes: block_8b,
                evict: vec![]
            }
        );
        assert!(
            matches!(shelf.take(5 * MB), Take::Allocate { .. }),
            "a smaller buffer is not"
        );
    }

    #[test]
    fn stays_within_the_budget() {
        let mut shelf = Shelf::new(10 * MB);
        assert_eq!(
            shelf.take(8 * MB),
            Take::Allocate {
                bytes: 8 * MB,
                evict: vec![]
            }
        );
        assert_eq!(shelf.take(4 * MB), Take::OverBudget, "8 + 4 lent > 10");
        shelf.give_back(8 * MB, 'a');
        // Kept buffers are given up to make room for one that fits the budget.
        assert_eq!(
            shelf.take(4 * MB - 1),
            Take::Allocate {
                bytes: 4 * MB,
                evict: vec!['a']
            }
        );
        assert_eq!((shelf.lent, shelf.kept_bytes()), (4 * MB, 0));
        shelf.not_allocated(4 * MB);
        assert_eq!(shelf.lent, 0, "a failed allocation lends nothing");
        assert_eq!(
            shelf.take(11 * MB),
            Take::OverBudget,
            "larger than the budget"
        );
    }
}
