//! Host memory that KV blocks are copied into out of a device's KV storage: a GPU prefill
//! node's lease ([`crate::kv::handoff::lease_store::LeasedKv`]). Plain heap memory, or memory the
//! backend lends ([`crate::backend::Backend::host_buffer`]: page-locked on a GPU, so that the
//! copy runs at the link's speed instead of through the driver's bounce buffer; it goes back
//! to the backend's pool when dropped). Does not decide what is copied (the engine) nor how
//! (`Backend::read_blocks`).

use std::fmt;
use std::sync::Arc;

/// Bytes in host memory, readable from any thread (the exporters read a lease's copy).
pub trait HostBytes: Send + Sync + fmt::Debug {
    fn as_bytes(&self) -> &[u8];
    fn as_bytes_mut(&mut self) -> &mut [u8];
}

impl HostBytes for Vec<u8> {
    fn as_bytes(&self) -> &[u8] {
        self
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// A host buffer of either kind.
pub type HostBuffer = Box<dyn HostBytes>;

/// `len` zeroed bytes of heap memory: what a backend without memory of its own to lend gives.
pub fn heap_buffer(len: usize) -> HostBuffer {
    Box::new(vec![0u8; len])
}

/// Lends host buffers from any thread: what a backend's [`crate::backend::Backend::host_allocator`]
/// gives, so that an importer's threads can receive blocks straight into memory the backend
/// copies from fastest.
pub type HostAllocator = Arc<dyn Fn(usize) -> HostBuffer + Send + Sync>;

/// [`heap_buffer`] as a [`HostAllocator`].
pub fn heap_allocator() -> HostAllocator {
    Arc::new(heap_buffer)
}
