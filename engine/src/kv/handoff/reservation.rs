//! Blocks the engine sets aside for one import before the pull starts, and how they are
//! filled where KV storage is not host memory: a [`DeviceReservation`] is written from the
//! puller's thread through the backend's [`BlockWriter`] (a GPU's copy stream), so the
//! engine thread admits the request without copying anything.
//!
//! This module owns what every reservation shares ([`ReservedBlocks`]: its id, where it
//! starts, and giving its blocks back if it is dropped unadmitted) and the device-side
//! writer's contract. Reservations in host memory, which a pull fills in place, are
//! [`super::placement::KvReservation`]. The block bookkeeping itself is the engine's.

use std::sync::Arc;

use super::host_buffer::HostBuffer;
use super::placement::KvReservation;

/// Identifies a reservation to the engine that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReservationId(pub u64);

/// Gives a reservation's blocks back to the engine (called once, when a reservation is
/// dropped without being admitted).
pub type ReleaseFn = Arc<dyn Fn(ReservationId) + Send + Sync>;

/// Writes `src[i]` (one block in [`crate::backend::Backend::read_block`]'s layout) into
/// physical block `blocks[i]` of KV storage, on the thread that calls it, ordered after
/// every device operation the engine had queued when it was made (so a block the engine
/// freed is no longer being written by its old owner's work); returns once the bytes are
/// in KV storage. Made on the engine thread for one reservation's blocks, which the engine
/// then neither reads nor writes until the reservation is admitted.
pub type BlockWrite = Box<dyn FnOnce(&[u32], &[&[u8]]) + Send>;

/// Makes a [`BlockWrite`] (called on the engine thread, once per reservation): the
/// backend's way into device KV storage from other threads
/// ([`crate::backend::Backend::block_writer`]).
pub type BlockWriter = Arc<dyn Fn() -> BlockWrite + Send + Sync>;

/// How a reservation's blocks were filled (the `landing` of the imports metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// The pull wrote them in place: KV storage in host memory.
    HostInPlace,
    /// The puller copied them into device KV storage as they arrived, off the engine thread.
    DeviceCopy,
    /// The pull wrote them into buffers (no room to reserve when it began), and the puller
    /// copied those into host KV storage reserved when it ended, off the engine thread.
    HostCopy,
}

/// A reservation whose blocks hold the pulled KV: hand it to the engine with the request
/// ([`crate::serve::ImportedBlocks::Placed`]). Dropped unadmitted (the request ended
/// first, the engine is gone), it gives every block back.
pub struct ReservedBlocks {
    id: ReservationId,
    first_block: usize,
    len: usize,
    landing: Landing,
    release: Option<ReleaseFn>,
}

impl std::fmt::Debug for ReservedBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReservedBlocks")
            .field("id", &self.id)
            .field("first_block", &self.first_block)
            .field("len", &self.len)
            .field("landing", &self.landing)
            .finish()
    }
}

impl ReservedBlocks {
    pub(crate) fn new(
        id: ReservationId,
        first_block: usize,
        len: usize,
        landing: Landing,
        release: ReleaseFn,
    ) -> Self {
        Self {
            id,
            first_block,
            len,
            landing,
            release: Some(release),
        }
    }

    pub fn id(&self) -> ReservationId {
        self.id
    }

    /// The prompt's first pulled block: the blocks before it are cached on this node.
    pub fn first_block(&self) -> usize {
        self.first_block
    }

    /// Blocks pulled.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn landing(&self) -> Landing {
        self.landing
    }

    /// The same blocks, filled another way than the reservation was made for.
    pub(crate) fn landed(mut self, landing: Landing) -> Self {
        self.landing = landing;
        self
    }

    /// The engine takes the blocks over (the request was admitted on them): nothing to give
    /// back on drop.
    pub(crate) fn admit(mut self) -> ReservationId {
        self.release = None;
        self.id
    }
}

impl Drop for ReservedBlocks {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release(self.id);
        }
    }
}

/// Blocks reserved for one import, by where this node keeps KV.
#[derive(Debug)]
pub enum ImportReservation {
    /// Host memory: the pull lands in place ([`KvReservation`]).
    Host(KvReservation),
    /// Device memory: the pull lands in buffers, which the puller then writes in
    /// ([`DeviceReservation::write`]).
    Device(DeviceReservation),
}

impl ImportReservation {
    /// The prompt's first block to pull: the blocks before it are cached on this node.
    pub fn first_block(&self) -> usize {
        match self {
            Self::Host(r) => r.first_block(),
            Self::Device(r) => r.first_block(),
        }
    }

    /// Blocks to pull.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(r) => r.len(),
            Self::Device(r) => r.len(),
        }
    }

    /// Fill every reserved block from buffers that already hold it (block `i` of `blocks`
    /// into reserved block `i`, each whole in the transfer layout): copied into host KV
    /// memory ([`Landing::HostCopy`]), or written into device KV storage
    /// ([`Landing::DeviceCopy`]). Blocking; the buffers may be reused once this returns.
    ///
    /// # Panics
    /// If `blocks` does not hold exactly one buffer of the block size per reserved block.
    pub fn fill(self, blocks: &[HostBuffer]) -> ReservedBlocks {
        match self {
            Self::Host(mut r) => {
                assert_eq!(blocks.len(), r.len(), "one buffer per block");
                r.write_blocks(blocks);
                r.filled().landed(Landing::HostCopy)
            }
            Self::Device(r) => r.write(blocks),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Device blocks the engine set aside for one import (KV storage on a GPU): the prompt's
/// blocks from `first_block` on. Pull into buffers, then [`DeviceReservation::write`] them,
/// off the engine thread; dropped unwritten, it gives every block back.
pub struct DeviceReservation {
    held: ReservedBlocks,
    physical: Vec<u32>,
    block_bytes: usize,
    write: BlockWrite,
}

impl std::fmt::Debug for DeviceReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceReservation")
            .field("held", &self.held)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl DeviceReservation {
    /// Made by the engine for physical blocks `physical`, exclusively its to give, with a
    /// writer made for them on the engine thread.
    pub(crate) fn new(
        id: ReservationId,
        first_block: usize,
        physical: Vec<u32>,
        block_bytes: usize,
        write: BlockWrite,
        release: ReleaseFn,
    ) -> Self {
        let held = ReservedBlocks::new(
            id,
            first_block,
            physical.len(),
            Landing::DeviceCopy,
            release,
        );
        Self {
            held,
            physical,
            block_bytes,
            write,
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
        self.physical.len()
    }

    pub fn is_empty(&self) -> bool {
        self.physical.is_empty()
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Copy the pulled blocks (block `i` of `blocks` into reserved block `i`, each whole in
    /// the transfer layout) into device KV storage, waiting until they are there. Blocks
    /// the device reads straight out of page-locked memory: the buffers may be reused once
    /// this returns. Blocking (a copy over the host link): call it off async threads.
    ///
    /// # Panics
    /// If `blocks` does not hold exactly one buffer of [`Self::block_bytes`] per reserved
    /// block (the transport checks both before it hands buffers over).
    pub fn write(self, blocks: &[HostBuffer]) -> ReservedBlocks {
        assert_eq!(blocks.len(), self.physical.len(), "one buffer per block");
        let src: Vec<&[u8]> = blocks.iter().map(|b| b.as_bytes()).collect();
        assert!(
            src.iter().all(|b| b.len() == self.block_bytes),
            "block buffer length"
        );
        (self.write)(&self.physical, &src);
        self.held
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::kv::handoff::host_buffer::heap_buffer;

    type Log = Arc<Mutex<Vec<String>>>;

    fn reservation(log: &Log) -> DeviceReservation {
        let (l1, l2) = (log.clone(), log.clone());
        DeviceReservation::new(
            ReservationId(4),
            2,
            vec![9, 5],
            3,
            Box::new(move |blocks, src| {
                l1.lock()
                    .unwrap()
                    .push(format!("write {blocks:?} {:?}", src.concat()))
            }),
            Arc::new(move |id| l2.lock().unwrap().push(format!("release {}", id.0))),
        )
    }

    #[test]
    fn a_written_reservation_hands_its_blocks_to_whoever_admits_them() {
        let log = Log::default();
        let r = reservation(&log);
        assert_eq!((r.len(), r.first_block(), r.block_bytes()), (2, 2, 3));
        let mut buffers = vec![heap_buffer(3), heap_buffer(3)];
        buffers[0].as_bytes_mut().copy_from_slice(&[1, 2, 3]);
        buffers[1].as_bytes_mut().copy_from_slice(&[4, 5, 6]);
        let held = r.write(&buffers);
        assert_eq!(
            *log.lock().unwrap(),
            vec!["write [9, 5] [1, 2, 3, 4, 5, 6]".to_string()]
        );
        assert_eq!(
            (held.id(), held.first_block(), held.len()),
            (ReservationId(4), 2, 2)
        );
        assert_eq!(held.landing(), Landing::DeviceCopy);
        assert_eq!(held.admit(), ReservationId(4));
        assert_eq!(log.lock().unwrap().len(), 1, "admitted: nothing released");
    }

    #[test]
    fn a_reservation_dropped_written_or_not_gives_its_blocks_back_once() {
        let log = Log::default();
        drop(reservation(&log));
        assert_eq!(*log.lock().unwrap(), vec!["release 4".to_string()]);
        let log = Log::default();
        let held = reservation(&log).write(&[heap_buffer(3), heap_buffer(3)]);
        drop(held);
        assert_eq!(log.lock().unwrap().last().unwrap(), "release 4");
        assert_eq!(log.lock().unwrap().len(), 2);
    }

    #[test]
    #[should_panic(expected = "block buffer length")]
    fn buffers_of_another_layout_are_refused_before_anything_is_written() {
        let log = Log::default();
        let _ = reservation(&log).write(&[heap_buffer(3), heap_buffer(4)]);
    }
}
