//! Recycled host buffers for KV blocks that arrive from another node.
//!
//! A decode node receives every prompt block it does not cache into a host buffer, the
//! engine copies it into KV storage, and the buffer is free again. Allocating those buffers
//! fresh for each request costs more than the transfer itself on a fast link: megabytes of
//! new pages are faulted in and zeroed by the kernel (or, on a GPU node, page-locked by the
//! driver) before a byte arrives. The transport takes buffers from here and the engine gives
//! them back once their contents are in KV storage, so a steady stream of imports reuses warm
//! memory. New buffers come from the backend's [`HostAllocator`]: page-locked memory on a GPU,
//! which the copy into device memory reads at the link's speed. Spare buffers are bounded in
//! bytes; beyond the bound they are freed. This owns no KV storage and knows nothing of
//! leases.

use std::fmt;
use std::sync::{Arc, Mutex};

use super::host_buffer::{HostAllocator, HostBuffer, heap_allocator};

/// Spare bytes kept by [`BlockBuffers::new`]'s callers by default: 1 GiB, a few long prompts
/// of an 8B model.
pub const DEFAULT_SPARE_BYTES: usize = 1 << 30;

/// A bounded free-list of block buffers of `block_bytes` bytes. Clones share the list.
#[derive(Clone)]
pub struct BlockBuffers {
    spare: Arc<Mutex<Vec<HostBuffer>>>,
    block_bytes: usize,
    max_spare: usize,
    alloc: HostAllocator,
}

impl fmt::Debug for BlockBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockBuffers")
            .field("block_bytes", &self.block_bytes)
            .field("max_spare", &self.max_spare)
            .field("spare", &self.spare())
            .finish_non_exhaustive()
    }
}

impl BlockBuffers {
    /// Heap buffers of `block_bytes` bytes, at most `max_spare_bytes` of them kept spare.
    pub fn new(block_bytes: usize, max_spare_bytes: usize) -> Self {
        Self::with_allocator(block_bytes, max_spare_bytes, heap_allocator())
    }

    /// Buffers from `alloc` ([`crate::backend::Backend::host_allocator`]), otherwise as
    /// [`BlockBuffers::new`].
    pub fn with_allocator(
        block_bytes: usize,
        max_spare_bytes: usize,
        alloc: HostAllocator,
    ) -> Self {
        Self {
            spare: Arc::default(),
            block_bytes,
            max_spare: max_spare_bytes / block_bytes.max(1),
            alloc,
        }
    }

    /// Bytes per buffer.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// A buffer of `block_bytes` bytes: a spare one or a new one, holding unspecified bytes
    /// either way (the caller overwrites all of it).
    pub fn take(&self) -> HostBuffer {
        let reused = self.spare.lock().ok().and_then(|mut s| s.pop());
        reused.unwrap_or_else(|| (self.alloc)(self.block_bytes))
    }

    /// Up to `n` spare buffers, without allocating any: never waits on the allocator.
    pub fn take_spare(&self, n: usize) -> Vec<HostBuffer> {
        let Ok(mut spare) = self.spare.lock() else {
            return Vec::new();
        };
        let keep = spare.len().saturating_sub(n);
        spare.split_off(keep)
    }

    /// `n` new buffers from the allocator. Can block for milliseconds (page-locking on a
    /// GPU node), so async callers run it on a blocking thread.
    pub fn allocate(&self, n: usize) -> Vec<HostBuffer> {
        (0..n).map(|_| (self.alloc)(self.block_bytes)).collect()
    }

    /// Return buffers whose contents are no longer needed. Buffers of another length, and
    /// any past the bound, are freed.
    pub fn give_all(&self, buffers: impl IntoIterator<Item = HostBuffer>) {
        let Ok(mut spare) = self.spare.lock() else {
            return;
        };
        for b in buffers {
            if spare.len() >= self.max_spare {
                break;
            }
            if b.as_bytes().len() == self.block_bytes {
                spare.push(b);
            }
        }
    }

    /// Spare buffers held now.
    pub fn spare(&self) -> usize {
        self.spare.lock().map(|s| s.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::super::host_buffer::heap_buffer;
    use super::*;

    fn filled(len: usize, byte: u8) -> HostBuffer {
        Box::new(vec![byte; len])
    }

    #[test]
    fn given_buffers_come_back_and_the_bound_holds() {
        let pool = BlockBuffers::new(4, 2 * 4);
        assert_eq!(
            pool.take().as_bytes(),
            [0; 4],
            "a new heap buffer is zeroed"
        );
        pool.give_all([filled(4, 1), filled(4, 2), filled(4, 3)]);
        assert_eq!(pool.spare(), 2, "at most 8 bytes = 2 buffers kept");
        let b = pool.take();
        assert_eq!(b.as_bytes().len(), 4);
        assert_ne!(
            b.as_bytes(),
            [0; 4],
            "a spare buffer is reused, not reallocated"
        );
        pool.give_all([filled(5, 0)]);
        assert_eq!(pool.spare(), 1, "a buffer of another length is not kept");
        pool.take();
        pool.take();
        assert_eq!(pool.spare(), 0);
    }

    #[test]
    fn a_zero_bound_keeps_nothing() {
        let pool = BlockBuffers::new(4, 0);
        pool.give_all([filled(4, 1)]);
        assert_eq!(pool.spare(), 0);
    }

    /// A pool of `block_bytes` buffers whose allocator counts its calls.
    fn counted(block_bytes: usize, max_spare: usize) -> (BlockBuffers, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let pool = BlockBuffers::with_allocator(
            block_bytes,
            max_spare,
            Arc::new(move |len| {
                counted.fetch_add(1, Ordering::Relaxed);
                heap_buffer(len)
            }),
        );
        (pool, calls)
    }

    #[test]
    fn new_buffers_come_from_the_allocator_and_spares_do_not() {
        let (pool, calls) = counted(8, 64);
        let (a, b) = (pool.take(), pool.take());
        assert_eq!(
            calls.load(Ordering::Relaxed),
            2,
            "one allocation per new buffer"
        );
        assert_eq!((a.as_bytes().len(), b.as_bytes().len()), (8, 8));
        pool.give_all([a, b]);
        let _again = [pool.take(), pool.take()];
        assert_eq!(calls.load(Ordering::Relaxed), 2, "spares are reused");
        pool.take();
        assert_eq!(calls.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn take_spare_never_allocates_and_allocate_always_does() {
        let (pool, calls) = counted(4, 64);
        assert!(pool.take_spare(3).is_empty(), "nothing spare yet");
        pool.give_all([filled(4, 1), filled(4, 2)]);
        let got = pool.take_spare(3);
        assert_eq!(got.len(), 2, "only what is spare");
        assert_eq!(pool.spare(), 0);
        assert_eq!(calls.load(Ordering::Relaxed), 0);
        pool.give_all(got);
        assert_eq!(pool.take_spare(1).len(), 1);
        assert_eq!(pool.spare(), 1, "the rest stays spare");
        let fresh = pool.allocate(3);
        assert_eq!(fresh.len(), 3);
        assert!(fresh.iter().all(|b| b.as_bytes().len() == 4));
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        assert_eq!(pool.spare(), 1, "allocate leaves spares alone");
    }
}
