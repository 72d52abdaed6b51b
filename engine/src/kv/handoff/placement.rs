//! Imported KV placed straight into this node's KV memory: the decode node reserves the
//! blocks a pull will fill, the transport writes each block's bytes where the engine keeps
//! them (a TCP read or an RDMA READ lands there directly), and the request is then admitted
//! on those blocks without a copy.
//!
//! This module owns the description of host KV memory ([`HostKvMemory`]: where every block
//! lies, byte segment by byte segment, in the transfer layout of
//! [`crate::backend::Backend::read_block`]) and the reservation a pull fills
//! ([`KvReservation`]). It does not own the block bookkeeping (the engine's pool) nor the
//! wire (pd-transport). KV memory that is not host memory (a GPU's) has no `HostKvMemory`;
//! such a node receives into buffers and copies them into reserved device blocks
//! ([`super::reservation::DeviceReservation`]), or the engine copies them in at admission.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use super::checksum::BlockChecksummer;
use super::host_buffer::HostBuffer;
use super::reservation::{Landing, ReservedBlocks};
pub use super::reservation::{ReleaseFn, ReservationId};

/// One contiguous piece of host KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostSegment {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a segment is an address and a length; every access through it goes through a
// `KvReservation`, which owns the blocks it names exclusively (see `block_mut`).
unsafe impl Send for HostSegment {}
// SAFETY: as above; `&HostSegment` gives no access to the memory.
unsafe impl Sync for HostSegment {}

impl HostSegment {
    /// # Safety
    /// `ptr .. ptr + len` must be KV memory that stays allocated while the keep-alive of the
    /// [`HostKvMemory`] it goes into lives, and that the engine reads and writes only block by
    /// block, through references covering just the blocks it uses (so that a block reserved
    /// for an import can be written from another thread meanwhile).
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> Self {
        Self { ptr, len }
    }

    /// The address, for registering the memory with a NIC.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `offset` of this segment.
    fn slice(&self, offset: usize, len: usize) -> HostSegment {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "segment {offset}+{len} outside a region of {} bytes",
            self.len
        );
        // SAFETY: in bounds of the region, checked above.
        let ptr = unsafe { self.ptr.add(offset) };
        HostSegment { ptr, len }
    }
}

/// Where every KV block of a node lies in host memory: `regions` in the transfer layout's
/// order (layer 0's K, layer 0's V, layer 1's K, …), block `b` taking `stride` bytes at
/// `b × stride` of each. Cloning shares the memory's keep-alive.
#[derive(Clone)]
pub struct HostKvMemory {
    regions: Arc<[HostSegment]>,
    stride: usize,
    num_blocks: usize,
    /// Keeps the memory allocated while a reservation or a registered NIC may still write it,
    /// even if the engine has gone.
    _keep_alive: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for HostKvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKvMemory")
            .field("regions", &self.regions.len())
            .field("stride", &self.stride)
            .field("num_blocks", &self.num_blocks)
            .finish()
    }
}

impl HostKvMemory {
    /// `regions` must each hold `num_blocks × stride` bytes (checked) and satisfy
    /// [`HostSegment::new`]'s contract; `keep_alive` owns their memory.
    pub fn new(
        regions: Vec<HostSegment>,
        stride: usize,
        num_blocks: usize,
        keep_alive: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        for r in &regions {
            assert_eq!(r.len, stride * num_blocks, "a KV region's length");
        }
        Self {
            regions: regions.into(),
            stride,
            num_blocks,
            _keep_alive: keep_alive,
        }
    }

    /// `num_blocks` blocks of `block_bytes` in host memory this value owns, in `regions`
    /// regions laid out as the CPU backend's KV (which describes its own memory through
    /// [`crate::backend::Backend::host_kv_memory`]): for transport benchmarks and tests that
    /// land blocks in place without an engine. `None` if `regions` does not divide the block.
    pub fn allocate(num_blocks: usize, block_bytes: usize, regions: usize) -> Option<Self> {
        if regions == 0 || !block_bytes.is_multiple_of(regions) {
            return None;
        }
        let stride = block_bytes / regions;
        let mut backing = vec![0u8; num_blocks * block_bytes].into_boxed_slice();
        let base = backing.as_mut_ptr();
        let segments = (0..regions)
            .map(|r| {
                // SAFETY: region `r` of `backing`, which the keep-alive below owns; nothing
                // else references it (the box is only kept, never read).
                unsafe {
                    HostSegment::new(
                        NonNull::new(base.add(r * stride * num_blocks))
                            .unwrap_or(NonNull::dangling()),
                        stride * num_blocks,
                    )
                }
            })
            .collect();
        Some(Self::new(segments, stride, num_blocks, Arc::new(backing)))
    }

    /// The regions, for registering them with a NIC once.
    pub fn regions(&self) -> &[HostSegment] {
        &self.regions
    }

    /// Bytes of one block in each region (one piece of the transfer layout).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Bytes of one block across all regions (the transfer layout's block length).
    pub fn block_bytes(&self) -> usize {
        self.stride * self.regions.len()
    }

    /// Block `block`'s bytes, segment by segment in transfer-layout order.
    ///
    /// # Safety
    /// Nobody may write the block while the returned slices live. The engine writes no block
    /// a lease holds, and frees a lease's blocks only once every reader of the lease has
    /// dropped it ([`crate::serve::LeasedKv`]).
    pub(crate) unsafe fn block_slices(&self, block: u32) -> Vec<&[u8]> {
        self.block_segments(block)
            .into_iter()
            // SAFETY: inside this memory (checked by `block_segments`), kept allocated by
            // `_keep_alive` as long as `self`; unwritten per the caller's contract.
            .map(|s| unsafe { std::slice::from_raw_parts(s.ptr.as_ptr(), s.len) })
            .collect()
    }

    /// Block `block`'s segments, in transfer-layout order.
    fn block_segments(&self, block: u32) -> Vec<HostSegment> {
        let b = block as usize;
        assert!(b < self.num_blocks, "block {b} of {}", self.num_blocks);
        self.regions
            .iter()
            .map(|r| r.slice(b * self.stride, self.stride))
            .collect()
    }
}

/// Blocks the engine set aside for one import: the prompt's blocks from `first_block` on
/// (those before it are this node's cached prefix, held too). Fill every block with
/// [`KvReservation::block_mut`], then hand [`KvReservation::filled`] to the engine with the
/// request. Dropped unused (a failed pull, an aborted request), it gives every block back.
pub struct KvReservation {
    held: ReservedBlocks,
    /// Per pulled block, its segments in transfer-layout order.
    blocks: Vec<Vec<HostSegment>>,
    memory: HostKvMemory,
}

impl std::fmt::Debug for KvReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvReservation")
            .field("held", &self.held)
            .finish()
    }
}

impl KvReservation {
    /// Made by the engine ([`crate::serve::EngineHandle::reserve_import`]) for physical
    /// blocks `physical`, exclusively its to give; `release` is called with `id` if the
    /// reservation is dropped unadmitted. Public for transport benchmarks and tests, which
    /// reserve plain host memory the same way.
    pub fn new(
        id: ReservationId,
        first_block: usize,
        physical: &[u32],
        memory: HostKvMemory,
        release: ReleaseFn,
    ) -> Self {
        Self {
            held: ReservedBlocks::new(
                id,
                first_block,
                physical.len(),
                Landing::HostInPlace,
                release,
            ),
            blocks: physical.iter().map(|&b| memory.block_segments(b)).collect(),
            memory,
        }
    }

    pub fn id(&self) -> ReservationId {
        self.held.id()
    }

    /// The prompt's first block to pull: the blocks before it are cached on this node.
    pub fn first_block(&self) -> usize {
        self.held.first_block()
    }

    /// Blocks to pull.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.memory.block_bytes()
    }

    /// The node's whole host KV memory (an RDMA reader finds each segment's registration
    /// in it).
    pub fn memory(&self) -> &HostKvMemory {
        &self.memory
    }

    /// Pulled block `i`'s segments, for a NIC to write (RDMA READ scatter lists).
    pub fn block_segments(&self, i: usize) -> &[HostSegment] {
        &self.blocks[i]
    }

    /// Pulled block `i`'s memory, segment by segment in transfer-layout order.
    pub fn block_mut(&mut self, i: usize) -> Vec<&mut [u8]> {
        self.blocks[i]
            .iter()
            // SAFETY: the engine gave this reservation the block exclusively: it neither
            // reads nor writes it, nor hands it to anyone else, until the reservation is
            // admitted or dropped; the memory stays allocated (`memory._keep_alive`); the
            // segments of one block do not overlap, and `&mut self` keeps these slices
            // unique on this side.
            .map(|s| unsafe { std::slice::from_raw_parts_mut(s.ptr.as_ptr(), s.len) })
            .collect()
    }

    /// Copy pulled block `i`, given whole in transfer layout (`block_bytes` long), into its
    /// segments: a block that arrived in a buffer after all.
    pub fn write_block(&mut self, i: usize, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.block_bytes(), "block length");
        let mut at = 0;
        for segment in self.block_mut(i) {
            segment.copy_from_slice(&bytes[at..at + segment.len()]);
            at += segment.len();
        }
    }

    /// Copy pulled blocks given whole in transfer layout (block `i` of `blocks` into pulled
    /// block `i`): blocks that arrived in buffers after all.
    pub fn write_blocks(&mut self, blocks: &[HostBuffer]) {
        for (i, block) in blocks.iter().enumerate() {
            self.write_block(i, block.as_bytes());
        }
    }

    /// The transfer checksum of pulled block `i` as it is now, for the prompt block index
    /// `lease_index` ([`super::checksum::block_checksum`] over the segments in order).
    pub fn block_checksum(&self, i: usize, lease_index: u64) -> u64 {
        let mut h = BlockChecksummer::new(lease_index);
        for s in &self.blocks[i] {
            // SAFETY: as in `block_mut`; reading through `&self` while no `&mut` slice of
            // this reservation is alive (the borrow checker sees to that).
            h.update(unsafe { std::slice::from_raw_parts(s.ptr.as_ptr(), s.len) });
        }
        h.digest()
    }

    /// Every block is filled: what the engine takes with the request
    /// ([`crate::serve::ImportedBlocks::Placed`]). Dropped unadmitted, it gives the blocks
    /// back as this reservation would have.
    pub fn filled(self) -> ReservedBlocks {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::kv::handoff::checksum::block_checksum;

    /// Host memory of 3 regions × 4 blocks × 8 bytes, owned by a `Vec` kept alive.
    fn memory() -> (HostKvMemory, Arc<Mutex<Vec<u8>>>) {
        let stride = 8;
        let blocks = 4;
        let backing = Arc::new(Mutex::new(vec![0u8; 3 * stride * blocks]));
        let base = backing.lock().unwrap().as_mut_ptr();
        let regions = (0..3)
            .map(|r| {
                // SAFETY: inside the Vec, which `keep_alive` owns; the test touches it only
                // through the reservation or after it is gone.
                unsafe {
                    HostSegment::new(
                        NonNull::new(base.add(r * stride * blocks)).unwrap(),
                        stride * blocks,
                    )
                }
            })
            .collect();
        let keep: Arc<dyn Any + Send + Sync> = backing.clone();
        (HostKvMemory::new(regions, stride, blocks, keep), backing)
    }

    #[test]
    fn a_block_is_written_where_its_segments_lie_and_checksummed_in_order() {
        let (mem, backing) = memory();
        let released = Arc::new(Mutex::new(Vec::new()));
        let r2 = released.clone();
        let mut r = KvReservation::new(
            ReservationId(7),
            1,
            &[2, 0],
            mem,
            Arc::new(move |id| r2.lock().unwrap().push(id)),
        );
        assert_eq!((r.len(), r.first_block(), r.block_bytes()), (2, 1, 24));
        let wire: Vec<u8> = (0..24).collect();
        for (seg, piece) in r.block_mut(0).into_iter().zip(wire.chunks(8)) {
            seg.copy_from_slice(piece);
        }
        assert_eq!(r.block_checksum(0, 5), block_checksum(5, &wire));
        assert_ne!(r.block_checksum(0, 6), block_checksum(5, &wire));
        drop(r);
        assert_eq!(*released.lock().unwrap(), vec![ReservationId(7)]);
        let b = backing.lock().unwrap();
        // Physical block 2 of each region, in region order.
        assert_eq!(&b[16..24], &wire[0..8]);
        assert_eq!(&b[32 + 16..32 + 24], &wire[8..16]);
        assert_eq!(&b[64 + 16..64 + 24], &wire[16..24]);
        assert!(b[..16].iter().all(|&x| x == 0), "block 0 untouched so far");
    }

    #[test]
    fn an_admitted_reservation_gives_nothing_back() {
        let (mem, _backing) = memory();
        let released = Arc::new(Mutex::new(Vec::new()));
        let r2 = released.clone();
        let r = KvReservation::new(
            ReservationId(1),
            0,
            &[3],
            mem,
            Arc::new(move |id| r2.lock().unwrap().push(id)),
        );
        assert_eq!(r.filled().admit(), ReservationId(1));
        assert!(released.lock().unwrap().is_empty());
    }
}
