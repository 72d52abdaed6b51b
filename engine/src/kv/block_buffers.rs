//! Recycled host buffers for KV blocks that arrive from another node.
//!
//! A decode node receives every prompt block it does not cache into a host buffer, the
//! engine copies it into KV storage, and the buffer is free again. Allocating those buffers
//! fresh for each request costs more than the transfer itself on a fast link: megabytes of
//! new pages are faulted in and zeroed by the kernel before a byte arrives. The transport
//! takes buffers from here and the engine gives them back once their contents are in KV
//! storage, so a steady stream of imports reuses warm memory. Spare buffers are bounded in
//! bytes; beyond the bound they are freed. This owns no KV storage and knows nothing of
//! leases.

use std::sync::{Arc, Mutex};

/// Spare bytes kept by [`BlockBuffers::new`]'s callers by default: 1 GiB, a few long prompts
/// of an 8B model.
pub const DEFAULT_SPARE_BYTES: usize = 1 << 30;

/// A bounded free-list of block buffers of `block_bytes` bytes. Clones share the list.
#[derive(Debug, Clone)]
pub struct BlockBuffers {
    spare: Arc<Mutex<Vec<Vec<u8>>>>,
    block_bytes: usize,
    max_spare: usize,
}

impl BlockBuffers {
    /// Buffers of `block_bytes` bytes, at most `max_spare_bytes` of them kept spare.
    pub fn new(block_bytes: usize, max_spare_bytes: usize) -> Self {
        Self {
            spare: Arc::default(),
            block_bytes,
            max_spare: max_spare_bytes / block_bytes.max(1),
        }
    }

    /// Bytes per buffer.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// A buffer of `block_bytes` bytes: a spare one (holding old contents: the caller
    /// overwrites all of it) or a new zeroed one.
    pub fn take(&self) -> Vec<u8> {
        let reused = self.spare.lock().ok().and_then(|mut s| s.pop());
        reused.unwrap_or_else(|| vec![0; self.block_bytes])
    }

    /// Return buffers whose contents are no longer needed. Buffers of another length, and
    /// any past the bound, are freed.
    pub fn give_all(&self, buffers: impl IntoIterator<Item = Vec<u8>>) {
        let Ok(mut spare) = self.spare.lock() else {
            return;
        };
        for b in buffers {
            if spare.len() >= self.max_spare {
                break;
            }
            if b.len() == self.block_bytes {
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
    use super::*;

    #[test]
    fn given_buffers_come_back_and_the_bound_holds() {
        let pool = BlockBuffers::new(4, 2 * 4);
        assert_eq!(pool.take(), vec![0; 4], "a new buffer is zeroed");
        pool.give_all(vec![vec![1; 4], vec![2; 4], vec![3; 4]]);
        assert_eq!(pool.spare(), 2, "at most 8 bytes = 2 buffers kept");
        let b = pool.take();
        assert_eq!(b.len(), 4);
        assert_ne!(b, vec![0; 4], "a spare buffer is reused, not reallocated");
        pool.give_all(vec![vec![0; 5]]);
        assert_eq!(pool.spare(), 1, "a buffer of another length is not kept");
        pool.take();
        pool.take();
        assert_eq!(pool.spare(), 0);
    }

    #[test]
    fn a_zero_bound_keeps_nothing() {
        let pool = BlockBuffers::new(4, 0);
        pool.give_all(vec![vec![1; 4]]);
        assert_eq!(pool.spare(), 0);
    }
}
