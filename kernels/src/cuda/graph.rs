//! CUDA graphs for decode (`--cuda-graphs on`): one graph per batch-size bucket, captured the
//! first time a pure decode step of that bucket runs, replayed after that. A small model's
//! decode step is a few hundred short kernels; replaying them as one graph removes the host's
//! per-launch cost.
//!
//! A graph replays fixed launches on fixed addresses, so per bucket:
//! - the step's metadata (token ids, positions, KV slots, attention items, sequences and
//!   block tables padded to `max_blocks` per sequence) is packed on the host and copied into
//!   one fixed device buffer before every replay ([`stage`]); while the capture records,
//!   the ops read these addresses ([`Staged`]) instead of uploading;
//! - the attention launch shape is fixed for the longest context (`max_context`): each
//!   sequence spreads its own keys over as many of its key splits as its length asks
//!   (`plan::keys_per_split`), the others are empty blocks;
//! - activations come from the backend's graph pool (`pool.rs`), never lent outside the
//!   graphs: a bucket is recorded once to learn which buffers the pool lacks and, once they
//!   are made, again, so the graph holds kernels and copies only — no memory nodes between
//!   its kernels, which a programmatically dependent launch needs to overlap the kernel
//!   before it. The logits are copied into the bucket's fixed output buffer, from which each
//!   replay's result is copied out;
//! - cuBLAS gets a fixed workspace ([`CUBLAS_WORKSPACE`]) so it allocates nothing inside a
//!   capture.
//!
//! Padding rows (a bucket larger than the batch) read token 0 at position 0 of block 0 and
//! write no KV (slot `u32::MAX`, skipped by `write_kv`). Anything that fails while capturing
//! or launching is logged once and turns graphs off for this backend: steps run eagerly.
//!
//! Written and compiled without a GPU: never run on a device yet (docs/cuda.md).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, sys};
use pd_engine::backend::graph::DecodeGraphStep;
use pd_engine::backend::{AttentionMeta, SeqAttention};

use super::pool::Shortfall;
use super::{CudaBackend, CudaTensor, plan};

/// Bytes of cuBLAS workspace (NVIDIA's recommendation for Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// KV slot of a padding row: `write_kv` skips it.
const NO_SLOT: u32 = u32::MAX;

/// Graph state of one backend.
#[derive(Default)]
pub(super) struct Graphs {
    /// Set while a capture records: the ops read these inputs instead of uploading.
    pub capturing: Option<Staged>,
    buckets: HashMap<usize, Bucket>,
    /// After a failure every step runs eagerly.
    disabled: bool,
    workspace: Option<CudaSlice<u8>>,
    /// Buffers the latest capture still took as graph allocations (memory nodes) rather
    /// than from the graph pool.
    graph_allocations: usize,
}

/// The attention launch shape a bucket's graph is captured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Launch {
    pub items: usize,
    pub rows_per_item: usize,
    pub splits: usize,
    pub min_keys_per_split: usize,
}

/// Device addresses of one bucket's staged inputs (see [`Layout`]) and its launch shape.
#[derive(Debug, Clone, Copy)]
pub(super) struct Staged {
    pub ids: u64,
    pub positions: u64,
    pub slots: u64,
    pub select: u64,
    pub items: u64,
    pub seqs: u64,
    pub tables: u64,
    pub launch: Launch,
}

/// A captured graph that may move to another thread with the backend.
struct Graph(CudaGraph);

// SAFETY: CUDA graph objects need external serialisation, not thread affinity: a `Graph` is
// only reached through the backend's `Mutex<Graphs>`, and cudarc makes the context current on
// the calling thread before each launch.
unsafe impl Send for Graph {}

struct Bucket {
    /// Packed inputs ([`Layout`]), rewritten before every replay.
    inputs: CudaSlice<u32>,
    /// The graph copies its logits here.
    output: CudaSlice<f32>,
    launch: Launch,
    graph: Option<Graph>,
}

/// Offsets (in u32 words) of each array in a bucket's packed inputs, for `rows` rows and
/// `max_blocks` block-table entries per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    rows: usize,
    max_blocks: usize,
}

impl Layout {
    fn ids(self) -> usize {
        0
    }
    fn positions(self) -> usize {
        self.rows
    }
    fn slots(self) -> usize {
        2 * self.rows
    }
    fn select(self) -> usize {
        3 * self.rows
    }
    /// `[sequence, first row]` per item (one item per row).
    fn items(self) -> usize {
        4 * self.rows
    }
    /// `[q_start, q_len, context_len, table offset]` per sequence.
    fn seqs(self) -> usize {
        6 * self.rows
    }
    fn tables(self) -> usize {
        10 * self.rows
    }
    fn len(self) -> usize {
        self.tables() + self.rows * self.max_blocks
    }
    /// Words that hold real data for a step of `real` rows (padding rows' tables follow).
    fn used(self, real: usize) -> usize {
        self.tables() + real * self.max_blocks
    }
}

/// The packed inputs of `step` (real rows, then padding), or `None` if a sequence does not
/// fit the bucket's fixed shape (then the step runs eagerly).
fn stage(step: &DecodeGraphStep<'_>) -> Option<Vec<u32>> {
    let layout = Layout {
        rows: step.bucket,
        max_blocks: step.graphs.max_blocks,
    };
    let bs = step.block_size;
    let n = step.tokens.len();
    if n == 0 || n > step.bucket || step.meta.seqs.len() != n {
        return None;
    }
    let mut p = vec![0u32; layout.len()];
    for row in 0..step.bucket {
        let table_at = (row * layout.max_blocks) as u32;
        let (id, ctx, slot) = match step.meta.seqs.get(row) {
            Some(seq) => {
                if seq.q_len != 1
                    || seq.context_len == 0
                    || seq.context_len > step.graphs.max_context
                    || seq.block_table.len() > layout.max_blocks
                {
                    return None;
                }
                let pos = seq.context_len - 1;
                let block = *seq.block_table.get(pos / bs)?;
                let at = layout.tables() + row * layout.max_blocks;
                p[at..at + seq.block_table.len()].copy_from_slice(&seq.block_table);
                let slot = block as usize * bs + pos % bs;
                (step.tokens[row], seq.context_len, u32::try_from(slot).ok()?)
            }
            None => (0, 1, NO_SLOT),
        };
        p[layout.ids() + row] = id;
        p[layout.positions() + row] = (ctx - 1) as u32;
        p[layout.slots() + row] = slot;
        p[layout.select() + row] = row as u32;
        p[layout.items() + 2 * row] = row as u32;
        p[layout.seqs() + 4 * row..layout.seqs() + 4 * row + 4]
            .copy_from_slice(&[row as u32, 1, ctx as u32, table_at]);
    }
    Some(p)
}

/// The attention shape for `rows` decode sequences of up to `max_context` keys.
fn launch_shape(step: &DecodeGraphStep<'_>, num_sms: usize, min_keys_per_split: usize) -> Launch {
    let meta = AttentionMeta {
        seqs: (0..step.bucket)
            .map(|row| SeqAttention {
                q_start: row,
                q_len: 1,
                context_len: step.graphs.max_context,
                block_table: Vec::new(),
            })
            .collect(),
        ..step.meta.clone()
    };
    let kernel = plan::AttentionKernel::CudaCores;
    let p = plan::plan_with(&meta, kernel, num_sms, min_keys_per_split);
    Launch {
        items: p.num_items(),
        rows_per_item: p.rows_per_item,
        splits: p.splits,
        min_keys_per_split: p.min_keys_per_split,
    }
}

impl CudaBackend {
    /// Buckets with a captured decode graph (0 when graphs are off or gave up), for the
    /// benchmark and the GPU tests to tell a replay from an eager fallback.
    pub fn decode_graphs_captured(&self) -> usize {
        let graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        graphs
            .buckets
            .values()
            .filter(|b| b.graph.is_some())
            .count()
    }

    /// Buffers the latest decode graph allocates as memory nodes of its own instead of
    /// taking them from the backend's graph pool: 0 when every op of the step found its
    /// buffer there, so the graph is kernels and copies only.
    pub fn decode_graph_allocations(&self) -> usize {
        self.graphs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .graph_allocations
    }

    /// The inputs of the capture being recorded, if one is.
    pub(super) fn capture_inputs(&self) -> Option<Staged> {
        self.graphs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .capturing
    }

    /// [`pd_engine::backend::Backend::decode_graph`]: stage, capture once, replay.
    pub(super) fn run_decode_graph(
        &self,
        step: &DecodeGraphStep<'_>,
        forward: &mut dyn FnMut() -> CudaTensor,
    ) -> Option<CudaTensor> {
        let inputs = stage(step)?;
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        if graphs.disabled {
            return None;
        }
        if self.routes_moe_on_host() {
            let why = "the model's Qwen3-MoE layers are routed on the host (PD_CUDA_MOE=host), \
                       which a graph cannot record";
            self.give_up(&mut graphs, why);
            return None;
        }
        let outcome = self.replay(&mut graphs, step, &inputs);
        match outcome {
            Ok(Some(logits)) => Some(logits),
            Ok(None) => {
                drop(graphs);
                self.capture(step, forward)
            }
            Err(why) => {
                self.give_up(&mut graphs, &why);
                None
            }
        }
    }

    /// Copy `inputs` into the bucket's buffers (creating them first) and launch its graph;
    /// `Ok(None)` if the bucket has no graph yet.
    fn replay(
        &self,
        graphs: &mut Graphs,
        step: &DecodeGraphStep<'_>,
        inputs: &[u32],
    ) -> Result<Option<CudaTensor>, String> {
        let stream = &self.dev.stream;
        let bucket = match graphs.buckets.entry(step.bucket) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                // Zeroed: padding rows' block tables point at block 0 until a real row's
                // table is left there (any block id is a valid read; padding rows write
                // nothing).
                let buf = stream.alloc_zeros::<u32>(inputs.len());
                // SAFETY: the graph writes the output before anything reads it.
                let output = unsafe { stream.alloc::<f32>(step.bucket * step.logits_cols) };
                e.insert(Bucket {
                    inputs: buf.map_err(|e| format!("allocating staged inputs: {e}"))?,
                    output: output.map_err(|e| format!("allocating the logits buffer: {e}"))?,
                    launch: launch_shape(
                        step,
                        self.dev.num_sms as usize,
                        self.min_keys_per_split(),
                    ),
                    graph: None,
                })
            }
        };
        // Only up to the last real row's block table: the rest is padding.
        let used = Layout {
            rows: step.bucket,
            max_blocks: step.graphs.max_blocks,
        }
        .used(step.tokens.len());
        stream
            .memcpy_htod(&inputs[..used], &mut bucket.inputs)
            .map_err(|e| format!("staging inputs: {e}"))?;
        self.launch_graph(bucket, step)
    }

    /// Launch the bucket's graph, if captured, and copy its logits out.
    fn launch_graph(
        &self,
        bucket: &Bucket,
        step: &DecodeGraphStep<'_>,
    ) -> Result<Option<CudaTensor>, String> {
        let Some(Graph(graph)) = &bucket.graph else {
            return Ok(None);
        };
        graph
            .launch()
            .map_err(|e| format!("launching the graph of bucket {}: {e}", step.bucket))?;
        let mut out = self.alloc::<f32>(step.bucket * step.logits_cols);
        self.dev
            .stream
            .memcpy_dtod(&bucket.output, &mut *out)
            .map_err(|e| format!("copying the graph's logits: {e}"))?;
        Ok(Some(CudaTensor::in_buffer(
            step.bucket,
            step.logits_cols,
            out,
        )))
    }

    /// Record `forward` into the bucket's graph (its inputs are already staged), then replay
    /// it once to compute this step.
    fn capture(
        &self,
        step: &DecodeGraphStep<'_>,
        forward: &mut dyn FnMut() -> CudaTensor,
    ) -> Option<CudaTensor> {
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(why) = self.set_workspace(&mut graphs) {
            self.give_up(&mut graphs, &why);
            return None;
        }
        let bucket = graphs.buckets.get(&step.bucket).expect("created by replay");
        let layout = Layout {
            rows: step.bucket,
            max_blocks: step.graphs.max_blocks,
        };
        let base = bucket.inputs.device_ptr(&self.dev.stream).0;
        let at = |words: usize| base + 4 * words as u64;
        graphs.capturing = Some(Staged {
            ids: at(layout.ids()),
            positions: at(layout.positions()),
            slots: at(layout.slots()),
            select: at(layout.select()),
            items: at(layout.items()),
            seqs: at(layout.seqs()),
            tables: at(layout.tables()),
            launch: bucket.launch,
        });
        // The ops read `capturing` through the lock while they record.
        drop(graphs);
        // The first recording learns which buffers the graph pool lacks; once they are made,
        // a second one finds them all and the graph holds kernels and copies only.
        let mut left = 0;
        let recorded = match self.record(step, forward) {
            (Ok(graph), short) if short.buffers() > 0 => {
                drop(graph);
                let made = short.buffers();
                self.allocations.fetch_add(made as u64, Ordering::Relaxed);
                match self.pools.provision(&self.dev.stream, short) {
                    Ok(()) => {
                        let (second, still) = self.record(step, forward);
                        left = still.buffers();
                        if left > 0 {
                            tracing::debug!(
                                bucket = step.bucket,
                                buffers = left,
                                "a decode graph keeps graph allocations its first recording \
                                 did not ask for"
                            );
                        }
                        second
                    }
                    Err(e) => Err(format!("allocating {made} buffers for the graph: {e}")),
                }
            }
            (first, _) => first,
        };
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        graphs.capturing = None;
        graphs.graph_allocations = left;
        let graph = match recorded {
            Ok(graph) => graph,
            Err(why) => {
                self.give_up(&mut graphs, &why);
                return None;
            }
        };
        tracing::info!(bucket = step.bucket, "captured a CUDA graph for decode");
        let bucket = graphs.buckets.get_mut(&step.bucket).expect("created");
        bucket.graph = Some(Graph(graph));
        match self.launch_graph(bucket, step) {
            Ok(logits) => logits,
            Err(why) => {
                self.give_up(&mut graphs, &why);
                None
            }
        }
    }

    /// Record `forward` and the copy of its logits into the bucket's output as a graph, its
    /// buffers from the graph pool; also what that pool lacked for it.
    fn record(
        &self,
        step: &DecodeGraphStep<'_>,
        forward: &mut dyn FnMut() -> CudaTensor,
    ) -> (Result<CudaGraph, String>, Shortfall) {
        let stream = &self.dev.stream;
        self.pools.begin_capture();
        let recorded = stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("beginning a capture: {e}"))
            .and_then(|()| {
                catch_unwind(AssertUnwindSafe(|| {
                    let logits = forward();
                    let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
                    let bucket = graphs.buckets.get_mut(&step.bucket).expect("created");
                    let n = step.bucket * step.logits_cols;
                    stream
                        .memcpy_dtod(&logits.dense().slice(..n), &mut bucket.output)
                        .map_err(|e| format!("copying logits inside the capture: {e}"))
                }))
                .unwrap_or_else(|_| {
                    Err("an op failed while capturing (see the panic above)".into())
                })
            });
        // End the capture whatever happened, so the stream is usable again.
        let ended = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        let short = self.pools.end_capture();
        let graph = match (recorded, ended) {
            (Ok(()), Ok(Some(graph))) => Ok(graph),
            (Err(why), _) => Err(why),
            (Ok(()), Ok(None)) => Err("the capture recorded no graph".into()),
            (Ok(()), Err(e)) => Err(format!("ending the capture: {e}")),
        };
        (graph, short)
    }

    /// Give cuBLAS a fixed workspace once, before the first capture.
    fn set_workspace(&self, graphs: &mut Graphs) -> Result<(), String> {
        if graphs.workspace.is_some() {
            return Ok(());
        }
        // SAFETY: cuBLAS only ever writes the workspace it is given.
        let ws = unsafe { self.dev.stream.alloc::<u8>(CUBLAS_WORKSPACE) }
            .map_err(|e| format!("allocating the cuBLAS workspace: {e}"))?;
        let ptr = ws.device_ptr(&self.dev.stream).0;
        // SAFETY: the handle is live; the workspace is a device buffer of the stated size that
        // `graphs.workspace` keeps alive as long as the handle (both live in this backend).
        let status = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *self.dev.blas.handle(),
                ptr as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE,
            )
        };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(format!("cublasSetWorkspace failed: {status:?}"));
        }
        graphs.workspace = Some(ws);
        Ok(())
    }

    /// Forget every captured graph (the next decode step of each bucket captures again):
    /// what a graph launches was fixed when it was captured.
    pub(super) fn drop_captured_graphs(&self) {
        let mut graphs = self.graphs.lock().unwrap_or_else(PoisonError::into_inner);
        graphs.buckets.clear();
    }

    /// Turn graphs off for this backend, saying why once.
    fn give_up(&self, graphs: &mut Graphs, why: &str) {
        if !graphs.disabled {
            tracing::warn!(
                device = %format!("cuda:{}", self.dev.ordinal),
                "CUDA graphs turned off, decode runs eagerly: {why}"
            );
        }
        graphs.disabled = true;
        graphs.capturing = None;
        graphs.buckets.clear();
    }
}

#[cfg(test)]
mod tests {
    use pd_engine::backend::graph::DecodeGraphs;

    use super::*;

    fn meta(seqs: &[(usize, Vec<u32>)]) -> AttentionMeta {
        AttentionMeta {
            seqs: seqs
                .iter()
                .enumerate()
                .map(|(i, (ctx, table))| SeqAttention {
                    q_start: i,
                    q_len: 1,
                    context_len: *ctx,
                    block_table: table.clone(),
                })
                .collect(),
            num_heads: 16,
            num_kv_heads: 8,
            head_dim: 128,
            scale: 0.088,
        }
    }

    fn step<'a>(meta: &'a AttentionMeta, tokens: &'a [u32], bucket: usize) -> DecodeGraphStep<'a> {
        DecodeGraphStep {
            bucket,
            graphs: DecodeGraphs::new(8, 64, 4),
            block_size: 4,
            logits_cols: 10,
            tokens,
            meta,
        }
    }

    #[test]
    fn staging_packs_real_rows_then_inert_padding() {
        let m = meta(&[(6, vec![9, 3]), (1, vec![7])]);
        let p = stage(&step(&m, &[11, 12], 4)).expect("fits");
        let l = Layout {
            rows: 4,
            max_blocks: 16,
        };
        assert_eq!(p.len(), l.len());
        assert_eq!(&p[l.ids()..l.ids() + 4], &[11, 12, 0, 0]);
        assert_eq!(&p[l.positions()..l.positions() + 4], &[5, 0, 0, 0]);
        // Position 5 is offset 1 of logical block 1 (physical 3); position 0 of block 7.
        assert_eq!(&p[l.slots()..l.slots() + 4], &[13, 28, NO_SLOT, NO_SLOT]);
        assert_eq!(&p[l.select()..l.select() + 4], &[0, 1, 2, 3]);
        assert_eq!(&p[l.items()..l.items() + 8], &[0, 0, 1, 0, 2, 0, 3, 0]);
        assert_eq!(&p[l.seqs()..l.seqs() + 8], &[0, 1, 6, 0, 1, 1, 1, 16]);
        assert_eq!(&p[l.seqs() + 8..l.seqs() + 12], &[2, 1, 1, 32]);
        assert_eq!(&p[l.tables()..l.tables() + 3], &[9, 3, 0]);
        assert_eq!(p[l.tables() + 16], 7);
    }

    #[test]
    fn steps_that_do_not_fit_the_fixed_shape_run_eagerly() {
        // Context beyond max_context (64).
        let m = meta(&[(65, vec![0; 17])]);
        assert_eq!(stage(&step(&m, &[1], 1)), None);
        // A prefill chunk.
        let mut m = meta(&[(6, vec![1, 2])]);
        m.seqs[0].q_len = 2;
        assert_eq!(stage(&step(&m, &[1], 1)), None);
        // More rows than the bucket.
        let m = meta(&[(6, vec![1, 2]), (6, vec![3, 4])]);
        assert_eq!(stage(&step(&m, &[1, 2], 1)), None);
    }

    #[test]
    fn the_launch_shape_covers_the_longest_context() {
        let m = meta(&[(6, vec![1, 2])]);
        let s = step(&m, &[1], 2);
        let l = launch_shape(&s, 132, plan::MIN_KEYS_PER_SPLIT);
        assert_eq!(l.items, 2);
        let max = s.graphs.max_context;
        assert!(l.splits * plan::keys_per_split(max, l.splits, l.min_keys_per_split) >= max);
    }
}
