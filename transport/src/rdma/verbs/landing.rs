//! Registered landing buffers for the decode node's RDMA READs, kept between transfers.
//!
//! Registering memory pins and maps every page of it: for a lease of hundreds of MiB that is
//! milliseconds, as long as the READs themselves at 100 Gb/s. So a landing buffer is
//! registered once and reused by later transfers (the largest kept first; at most
//! [`MAX_SPARE_BYTES`] kept idle), and a transfer registers memory only when no idle buffer
//! is large enough. This owns no queue pair: callers make sure no READ can still write into
//! a buffer they give back (a transfer that failed destroys its queue pair first).

use std::sync::{Arc, Mutex};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;

use super::device::RdmaDevice;
use crate::rdma::RdmaError;

/// Idle registered bytes kept for later transfers.
pub(super) const MAX_SPARE_BYTES: usize = 1 << 30;

/// One registered buffer of bytes.
pub(super) struct Landing {
    // Field order matters: the region is deregistered before the memory is freed.
    mr: Arc<MemoryRegion>,
    buf: Box<[u8]>,
}

impl Landing {
    fn register(device: &RdmaDevice, bytes: usize) -> Result<Self, RdmaError> {
        let mut buf = vec![0u8; bytes.max(1)].into_boxed_slice();
        // SAFETY: the boxed slice's heap memory does not move (moving a `Landing` moves the
        // pointer, not the memory) and is freed only after `mr` (field order above).
        let mr = unsafe { device.register(buf.as_mut_ptr(), buf.len(), AccessFlags::LocalWrite)? };
        Ok(Self { mr, buf })
    }

    /// Bytes this buffer holds.
    pub(super) fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// The local key for scatter/gather entries into this buffer.
    pub(super) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The address READs land at (offset 0).
    pub(super) fn base(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    /// The first `len` bytes (what a transfer of `len` bytes landed).
    pub(super) fn bytes(&self, len: usize) -> &[u8] {
        &self.buf[..len.min(self.buf.len())]
    }
}

/// Idle landing buffers of one device.
pub(super) struct LandingPool {
    device: RdmaDevice,
    spare: Mutex<Vec<Landing>>,
}

impl LandingPool {
    pub(super) fn new(device: &RdmaDevice) -> Self {
        Self {
            device: device.clone(),
            spare: Mutex::default(),
        }
    }

    /// A buffer of at least `bytes` bytes: the smallest idle one that is large enough,
    /// else a newly registered one. Blocking (registration).
    pub(super) fn take(&self, bytes: usize) -> Result<Landing, RdmaError> {
        let reused = {
            let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
            let best = spare
                .iter()
                .enumerate()
                .filter(|(_, l)| l.capacity() >= bytes)
                .min_by_key(|(_, l)| l.capacity())
                .map(|(i, _)| i);
            best.map(|i| spare.swap_remove(i))
        };
        match reused {
            Some(landing) => Ok(landing),
            None => Landing::register(&self.device, bytes),
        }
    }

    /// Keep `landing` for later transfers (no READ may still target it), the largest
    /// buffers first within [`MAX_SPARE_BYTES`].
    pub(super) fn give(&self, landing: Landing) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        spare.push(landing);
        spare.sort_by_key(|l| std::cmp::Reverse(l.capacity()));
        let mut kept = 0usize;
        spare.retain(|l| {
            kept += l.capacity();
            kept <= MAX_SPARE_BYTES
        });
    }
}
