//! Device buffers for activations and per-step uploads, recycled instead of freed.
//!
//! Every op allocates its output, and a decode step of Qwen3-0.6B makes about 180 such
//! buffers (one per kernel or so). Allocated and freed on the stream (`cuMemAllocAsync`,
//! `cuMemFreeAsync`), each one costs the host a driver call, and each one stands between two
//! kernels in the stream: eagerly that is two stream operations per kernel; in a CUDA graph
//! two memory nodes, and a kernel launched programmatically dependent (`PD_CUDA_PDL`) only
//! overlaps the one before it when nothing but that kernel lies between them. So a dropped
//! buffer goes back to a pool here, keyed by element type and length, and the next op asking
//! for that shape takes it without touching the stream. This is safe because every user of
//! these buffers runs on the backend's one stream: whatever the next owner queues is ordered
//! after everything the last one queued.
//!
//! Two pools, because a graph replays fixed addresses:
//! - the **eager** pool serves steps run launch by launch. It keeps at most
//!   [`EAGER_IDLE_BYTES`] idle, giving up the longest idle first (freed on the stream), and
//!   is emptied to retry an allocation the device refused;
//! - the **graph** pool serves captures only, and never lends a buffer to anything else:
//!   a graph's temporaries keep their addresses for every replay, so no buffer outside the
//!   graphs may be at one of them. Graphs replay one at a time on the stream, so they share
//!   it. A capture that finds a shape missing records it, gets a graph allocation for now
//!   (a memory node), and is done again once the missing buffers are made
//!   ([`BufferPools::provision`]): the second recording finds them all.
//!
//! Owns the bookkeeping and the buffers; what is computed in them is the ops' business.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, LaunchArgs, PushKernelArg};

/// Most bytes the eager pool keeps idle: a few steps' activations of a large batch. Past it
/// the longest idle buffers are freed.
pub const EAGER_IDLE_BYTES: usize = 256 << 20;

/// A buffer's shape: its element type and length.
type Key = (TypeId, usize);

/// An idle buffer, type-erased (a `CudaSlice<T>` for the `T` of its key).
type Idle = Box<dyn Any + Send>;

/// Allocates a buffer of a key's shape (its element type fixed when the key was met), and
/// says its bytes.
type Make = fn(&Arc<CudaStream>, usize) -> Result<(Idle, usize), DriverError>;

fn make<T: DeviceRepr + 'static>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<(Idle, usize), DriverError> {
    // SAFETY: a pooled buffer holds unspecified contents; every op writes what it reads.
    let slice = unsafe { stream.alloc::<T>(len) }?;
    Ok((Box::new(slice), len * std::mem::size_of::<T>()))
}

/// Idle buffers by shape, each stamped with when it was given back, within an optional
/// byte bound. Taking is by shape (the most recent first), so its cost does not grow with the
/// number of idle buffers; only freeing past the bound looks across shapes.
#[derive(Debug)]
struct Shelf<B> {
    idle: HashMap<Key, Vec<(u64, usize, B)>>,
    given: u64,
    bytes: usize,
    cap: Option<usize>,
}

impl<B> Shelf<B> {
    fn new(cap: Option<usize>) -> Self {
        Self {
            idle: HashMap::new(),
            given: 0,
            bytes: 0,
            cap,
        }
    }

    /// The most recently given back buffer of `key`'s shape.
    fn take(&mut self, key: Key) -> Option<B> {
        let list = self.idle.get_mut(&key)?;
        let (_, bytes, b) = list.pop()?;
        if list.is_empty() {
            self.idle.remove(&key);
        }
        self.bytes -= bytes;
        Some(b)
    }

    fn give(&mut self, key: Key, bytes: usize, b: B) {
        self.given += 1;
        self.idle
            .entry(key)
            .or_default()
            .push((self.given, bytes, b));
        self.bytes += bytes;
    }

    /// The longest idle buffers past the bound, to be freed.
    fn over_cap(&mut self) -> Vec<B> {
        let mut out = Vec::new();
        while self.cap.is_some_and(|cap| self.bytes > cap) {
            let Some(key) = self
                .idle
                .iter()
                .min_by_key(|(_, list)| list[0].0)
                .map(|(key, _)| *key)
            else {
                break;
            };
            let list = self.idle.get_mut(&key).expect("found above");
            let (_, bytes, b) = list.remove(0);
            if list.is_empty() {
                self.idle.remove(&key);
            }
            self.bytes -= bytes;
            out.push(b);
        }
        out
    }

    fn drain(&mut self) -> Vec<B> {
        self.bytes = 0;
        self.idle
            .drain()
            .flat_map(|(_, list)| list.into_iter().map(|(_, _, b)| b))
            .collect()
    }
}

/// What a capture lacked: per shape, how many more buffers the graph pool needs so that the
/// same recording finds one for every request (the most it held at once beyond the pool).
#[derive(Default)]
struct Tally {
    /// Graph allocations of the capture given back so far, per shape, that a later request
    /// of the capture could have reused had they been pool buffers.
    reusable: HashMap<Key, usize>,
    short: HashMap<Key, (usize, Make)>,
}

impl Tally {
    fn miss(&mut self, key: Key, make: Make) {
        match self.reusable.get_mut(&key) {
            Some(n) if *n > 0 => *n -= 1,
            _ => self.short.entry(key).or_insert((0, make)).0 += 1,
        }
    }
}

/// Buffers a capture lacked ([`BufferPools::end_capture`]).
pub(super) struct Shortfall(Vec<(Key, usize, Make)>);

impl Shortfall {
    /// Buffers to make.
    pub fn buffers(&self) -> usize {
        self.0.iter().map(|(_, n, _)| n).sum()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Eager,
    Graph,
    /// A graph allocation made during a capture (a memory node): freed, not kept.
    CaptureOnly,
}

struct State {
    eager: Shelf<Idle>,
    graph: Shelf<Idle>,
    /// Set while a graph is being recorded: requests go to the graph pool.
    capture: Option<Tally>,
}

/// The backend's two pools (see the module documentation). Clones share them.
#[derive(Clone)]
pub(super) struct BufferPools {
    state: Arc<Mutex<State>>,
}

impl BufferPools {
    pub fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                eager: Shelf::new(Some(EAGER_IDLE_BYTES)),
                graph: Shelf::new(None),
                capture: None,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A buffer of `len` elements (≥ 1) from the pool serving now, or a new one. `fresh`
    /// counts the buffers allocated on the stream.
    pub fn alloc<T: DeviceRepr + 'static>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
        fresh: &mut u64,
    ) -> Result<DeviceBuffer<T>, DriverError> {
        let key = (TypeId::of::<T>(), len);
        let mut state = self.lock();
        let home = if state.capture.is_some() {
            if let Some(b) = state.graph.take(key) {
                return Ok(self.wrap(b, Home::Graph));
            }
            state
                .capture
                .as_mut()
                .expect("capturing")
                .miss(key, make::<T>);
            Home::CaptureOnly
        } else {
            if let Some(b) = state.eager.take(key) {
                return Ok(self.wrap(b, Home::Eager));
            }
            Home::Eager
        };
        drop(state);
        *fresh += 1;
        // SAFETY: as in `make`.
        let slice = match unsafe { stream.alloc::<T>(len) } {
            Ok(s) => s,
            // Idle buffers of other shapes may hold the memory: free them, then try once more
            // (never while capturing: a free there would be recorded into the graph).
            Err(_) if home == Home::Eager => {
                let idle = self.lock().eager.drain();
                drop(idle);
                // SAFETY: as in `make`.
                unsafe { stream.alloc::<T>(len) }?
            }
            Err(e) => return Err(e),
        };
        Ok(DeviceBuffer {
            slice: Some(slice),
            home: Some((self.clone(), home)),
        })
    }

    fn wrap<T: 'static>(&self, b: Idle, home: Home) -> DeviceBuffer<T> {
        let slice = *b
            .downcast::<CudaSlice<T>>()
            .expect("a pooled buffer has its key's element type");
        DeviceBuffer {
            slice: Some(slice),
            home: Some((self.clone(), home)),
        }
    }

    fn give_back(&self, key: Key, bytes: usize, b: Idle, home: Home) {
        let freed = {
            let mut state = self.lock();
            match home {
                Home::Eager => {
                    state.eager.give(key, bytes, b);
                    // Nothing is freed while a capture records: the free would be recorded.
                    if state.capture.is_none() {
                        state.eager.over_cap()
                    } else {
                        Vec::new()
                    }
                }
                Home::Graph => {
                    state.graph.give(key, bytes, b);
                    Vec::new()
                }
                Home::CaptureOnly => {
                    if let Some(tally) = state.capture.as_mut() {
                        *tally.reusable.entry(key).or_default() += 1;
                    }
                    vec![b]
                }
            }
        };
        // Freed on the stream, outside the lock.
        drop(freed);
    }

    /// From now until [`Self::end_capture`], requests are served by the graph pool.
    pub fn begin_capture(&self) {
        self.lock().capture = Some(Tally::default());
    }

    /// Back to the eager pool; what the recording lacked.
    pub fn end_capture(&self) -> Shortfall {
        let tally = self.lock().capture.take().unwrap_or_default();
        Shortfall(
            tally
                .short
                .into_iter()
                .map(|(key, (n, make))| (key, n, make))
                .collect(),
        )
    }

    /// Make the buffers `short` lists into the graph pool (outside any capture).
    pub fn provision(&self, stream: &Arc<CudaStream>, short: Shortfall) -> Result<(), DriverError> {
        for ((ty, len), n, make) in short.0 {
            for _ in 0..n {
                let (b, bytes) = make(stream, len)?;
                self.lock().graph.give((ty, len), bytes, b);
            }
        }
        Ok(())
    }

    /// Idle bytes in the eager and graph pools.
    pub fn idle_bytes(&self) -> (usize, usize) {
        let state = self.lock();
        (state.eager.bytes, state.graph.bytes)
    }
}

/// A device buffer that goes back to the pool it came from when dropped (or, made outside
/// the pools, is freed on the stream as usual). Reads as the `CudaSlice` it holds.
pub struct DeviceBuffer<T: 'static> {
    slice: Option<CudaSlice<T>>,
    home: Option<(BufferPools, Home)>,
}

impl<T: 'static> DeviceBuffer<T> {
    /// A buffer of no pool.
    pub fn unpooled(slice: CudaSlice<T>) -> Self {
        Self {
            slice: Some(slice),
            home: None,
        }
    }
}

impl<T: 'static> Deref for DeviceBuffer<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        self.slice.as_ref().expect("present until dropped")
    }
}

impl<T: 'static> DerefMut for DeviceBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.slice.as_mut().expect("present until dropped")
    }
}

impl<T: 'static> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let (Some(slice), Some((pools, home))) = (self.slice.take(), self.home.take()) else {
            return;
        };
        let len = slice.len();
        let bytes = len * std::mem::size_of::<T>();
        pools.give_back((TypeId::of::<T>(), len), bytes, Box::new(slice), home);
    }
}

// SAFETY: the argument is the held slice, pushed exactly as cudarc pushes a `CudaSlice`.
unsafe impl<'a, 'b: 'a, T: 'static> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
        let slice: &'b CudaSlice<T> = arg;
        self.arg(slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(len: usize) -> Key {
        (TypeId::of::<f32>(), len)
    }

    #[test]
    fn a_shelf_lends_the_latest_of_a_shape_and_frees_the_oldest_past_its_bound() {
        let mut shelf = Shelf::new(Some(100));
        assert_eq!(shelf.take(key(4)), None::<&str>);
        shelf.give(key(4), 40, "a");
        shelf.give(key(8), 40, "b");
        shelf.give(key(4), 40, "c");
        assert_eq!(shelf.over_cap(), ["a"], "the longest idle goes first");
        assert_eq!(shelf.bytes, 80);
        assert_eq!(shelf.take(key(4)), Some("c"));
        assert_eq!(shelf.take(key(4)), None, "a was freed");
        assert_eq!(
            shelf.take((TypeId::of::<u16>(), 8)),
            None,
            "another element type is another shape"
        );
        assert_eq!(shelf.take(key(8)), Some("b"));
        assert_eq!(shelf.bytes, 0);
        shelf.give(key(1), 500, "d");
        assert_eq!(shelf.drain(), ["d"]);
        assert_eq!(shelf.bytes, 0);
        let mut unbounded = Shelf::new(None);
        unbounded.give(key(1), usize::MAX / 2, "e");
        assert!(unbounded.over_cap().is_empty());
    }

    fn no_make(_: &Arc<CudaStream>, _: usize) -> Result<(Idle, usize), DriverError> {
        unreachable!("the tally only counts")
    }

    #[test]
    fn a_capture_lacks_only_the_most_it_held_at_once() {
        let mut tally = Tally::default();
        // Two of shape 4 alive at once, then one given back and asked for again; one of
        // shape 8.
        tally.miss(key(4), no_make);
        tally.miss(key(4), no_make);
        *tally.reusable.entry(key(4)).or_default() += 1;
        tally.miss(key(4), no_make);
        tally.miss(key(8), no_make);
        let short: HashMap<Key, usize> = tally.short.iter().map(|(k, (n, _))| (*k, *n)).collect();
        assert_eq!(short, HashMap::from([(key(4), 2), (key(8), 1)]));
    }
}
