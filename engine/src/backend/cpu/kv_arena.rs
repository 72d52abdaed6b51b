//! The CPU backend's KV memory: one fixed allocation per layer's K or V that never moves and
//! is read and written only through ranges, never as a whole slice. That is what lets a block
//! reserved for an import be filled from another thread (a KV transfer landing in place,
//! [`crate::kv::handoff::placement`]) while the engine computes on other blocks of the same arena.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use super::kv_elem::KvElem;

/// The allocation itself, freed when the last [`KvArena`] or keep-alive clone goes.
#[derive(Debug)]
struct Allocation<E: KvElem> {
    ptr: NonNull<E>,
    len: usize,
}

// SAFETY: the allocation is plain memory; access to it is arbitrated by `KvArena`'s `&`/`&mut`
// range methods on the engine's side and by `KvReservation` for reserved blocks.
unsafe impl<E: KvElem> Send for Allocation<E> {}
// SAFETY: as above.
unsafe impl<E: KvElem> Sync for Allocation<E> {}

impl<E: KvElem> Drop for Allocation<E> {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a `Box<[E]>` of `len` elements in
        // `KvArena::filled`, and this is the only place that frees it.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

/// `len` values of KV memory, of the cache's element type (f32 unless `--kv-cache-dtype`
/// says otherwise).
#[derive(Debug)]
pub struct KvArena<E: KvElem = f32>(Arc<Allocation<E>>);

impl<E: KvElem> KvArena<E> {
    /// `len` values set to `value`; `None` if the memory cannot be had.
    pub fn filled(len: usize, value: E) -> Option<Self> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).ok()?;
        v.resize(len, value);
        let ptr = Box::into_raw(v.into_boxed_slice()) as *mut E;
        let ptr = NonNull::new(ptr).expect("Box::into_raw is never null");
        Some(Self(Arc::new(Allocation { ptr, len })))
    }

    pub fn len(&self) -> usize {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Values `r`.
    #[inline]
    pub fn range(&self, r: Range<usize>) -> &[E] {
        assert!(
            r.start <= r.end && r.end <= self.0.len,
            "KV range {r:?} of {}",
            self.0.len
        );
        // SAFETY: in bounds (checked); the engine never holds a `&mut` range overlapping this
        // one (`&self`), and reserved blocks, which another thread may be writing, are not
        // read by the engine until the reservation is admitted.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr().add(r.start), r.len()) }
    }

    /// Values `r`, to write.
    #[inline]
    pub fn range_mut(&mut self, r: Range<usize>) -> &mut [E] {
        assert!(
            r.start <= r.end && r.end <= self.0.len,
            "KV range {r:?} of {}",
            self.0.len
        );
        // SAFETY: in bounds (checked); `&mut self` excludes every other range on the engine's
        // side, and the engine writes only blocks it owns, never one reserved for an import.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr.as_ptr().add(r.start), r.len()) }
    }

    /// The first value's address, for describing the memory to a transport.
    pub fn base(&self) -> NonNull<E> {
        self.0.ptr
    }

    /// Keeps the memory allocated after the arena is dropped.
    pub fn keep_alive(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_read_back_what_was_written_and_bounds_are_checked() {
        let mut a = KvArena::filled(10, 1.5f32).unwrap();
        assert_eq!(a.range(0..10), &[1.5; 10]);
        a.range_mut(3..5).copy_from_slice(&[7.0, 8.0]);
        assert_eq!(a.range(2..6), &[1.5, 7.0, 8.0, 1.5]);
        assert!(std::panic::catch_unwind(|| a.range(8..11).len()).is_err());
        let keep = a.keep_alive();
        drop(a);
        drop(keep);
        assert!(KvArena::filled(0, 0.0f32).unwrap().is_empty());
        let h = KvArena::filled(4, half::f16::from_f32(2.0)).unwrap();
        assert_eq!(h.range(1..3), &[half::f16::from_f32(2.0); 2]);
    }
}
