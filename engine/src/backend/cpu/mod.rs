//! The CPU backend: f32 compute over weights kept in their stored dtype, multi-threaded with
//! rayon. Matrix kernels live in [`linear`] / [`convert`]; paged attention in [`attention`];
//! the KV cache is f32, or f16 / bf16 with `--kv-cache-dtype` ([`kv_elem`]). Every kernel
//! runs on the instruction set the backend was built with ([`isa`]: AMX tiles for bf16
//! prefill products beside AVX-512, AVX-512, AVX2 or portable, the best the host has unless
//! `PD_CPU_ISA` says otherwise). It is the reference
//! every other backend is compared against.

#[cfg(target_arch = "x86_64")]
mod amx;
pub mod attention;
pub mod convert;
#[cfg(target_arch = "x86_64")]
mod gemm512;
pub mod isa;
pub mod kv_arena;
pub mod kv_elem;
pub mod linear;
mod matrix;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::backend::{AttentionMeta, Backend, HostMatrix};
use crate::error::EngineError;
use crate::kv::KvLayout;
use crate::kv::handoff::placement::{HostKvMemory, HostSegment};
use crate::sampling::device::sample_row_within;
use crate::sampling::{
    DeviceSample, DeviceSampleRow, PromptLogprob, PromptLogprobRow, prompt_logprobs_within,
};
use crate::weights::{DType, TensorView};

pub use isa::{CpuFeatures, Isa, IsaError};
pub use kv_arena::KvArena;
pub use kv_elem::KvElem;
pub use matrix::WeightMatrix;

/// Element-wise work below this many elements runs on the calling thread: forking costs more.
const PAR_THRESHOLD: usize = 1 << 16;

/// The CPU backend. Threads come from rayon's global pool (all cores by default).
#[derive(Debug, Clone, Copy)]
pub struct CpuBackend {
    /// How the KV cache is stored.
    kv_dtype: DType,
    /// The instruction set every kernel runs on (available on this CPU).
    isa: Isa,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend keeping its KV cache in f32.
    pub fn new() -> Self {
        Self::with_kv_dtype(DType::F32)
    }

    /// A backend keeping its KV cache in `kv_dtype`: 16-bit halves the cache's memory and
    /// attention's reads of it, at the rounding of K and V to that type. Its kernels run on
    /// the instruction set `PD_CPU_ISA` asks for, or the best this host has when it is unset
    /// or names one the host cannot run (servers and `pdctl` build theirs with
    /// [`CpuBackend::from_env`], which refuses that instead).
    pub fn with_kv_dtype(kv_dtype: DType) -> Self {
        Self {
            kv_dtype,
            isa: Isa::from_env().unwrap_or_else(|_| Isa::best()),
        }
    }

    /// [`CpuBackend::with_kv_dtype`] on the instruction set `PD_CPU_ISA` asks for (unset: the
    /// best this host has), or the sentence saying why the host cannot run it.
    pub fn from_env(kv_dtype: DType) -> Result<Self, IsaError> {
        Ok(Self {
            kv_dtype,
            isa: Isa::from_env()?,
        })
    }

    /// This backend with its kernels on `isa`; `None` if this CPU cannot run it.
    pub fn on_isa(self, isa: Isa) -> Option<Self> {
        isa.available().then_some(Self { isa, ..self })
    }

    /// The instruction set the kernels run on.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

/// A row-major `f32` matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols);
        Self { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A weight as the CPU backend keeps it: matrices stay in the mapped checkpoint in their
/// stored dtype; 1-D vectors (norm weights, a few KiB) are widened to f32 once.
#[derive(Debug, Clone)]
pub enum CpuWeight {
    Matrix(TensorView),
    Vector(Vec<f32>),
}

impl CpuWeight {
    fn matrix(&self) -> WeightMatrix<'_> {
        match self {
            CpuWeight::Matrix(view) => {
                WeightMatrix::new(view.dtype, view.shape[0], view.shape[1], view.bytes())
            }
            CpuWeight::Vector(_) => panic!("a vector weight used as a matrix"),
        }
    }

    fn vector(&self) -> &[f32] {
        match self {
            CpuWeight::Vector(v) => v,
            CpuWeight::Matrix(_) => panic!("a matrix weight used as a vector"),
        }
    }
}

/// K and V of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]` each.
#[derive(Debug)]
pub struct CpuLayerKv<E: KvElem = f32> {
    pub k: KvArena<E>,
    pub v: KvArena<E>,
}

impl<E: KvElem> CpuLayerKv<E> {
    /// `len` values each for K and V, set to `fill`; `None` if the memory cannot be had.
    pub fn filled(len: usize, fill: f32) -> Option<Self> {
        let fill = E::from_f32(fill);
        Some(Self {
            k: KvArena::filled(len, fill)?,
            v: KvArena::filled(len, fill)?,
        })
    }
}

/// Every layer's K and V, in the cache's element type.
#[derive(Debug)]
pub enum CpuKvLayers {
    F32(Vec<CpuLayerKv<f32>>),
    F16(Vec<CpuLayerKv<f16>>),
    Bf16(Vec<CpuLayerKv<bf16>>),
}

impl CpuKvLayers {
    pub fn len(&self) -> usize {
        match self {
            CpuKvLayers::F32(l) => l.len(),
            CpuKvLayers::F16(l) => l.len(),
            CpuKvLayers::Bf16(l) => l.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `num_layers` layers of `len` values each for K and V, set to `fill`.
    pub fn filled(dtype: DType, num_layers: usize, len: usize, fill: f32) -> Option<Self> {
        fn layers<E: KvElem>(n: usize, len: usize, fill: f32) -> Option<Vec<CpuLayerKv<E>>> {
            (0..n).map(|_| CpuLayerKv::filled(len, fill)).collect()
        }
        Some(match dtype {
            DType::F32 => CpuKvLayers::F32(layers(num_layers, len, fill)?),
            DType::F16 => CpuKvLayers::F16(layers(num_layers, len, fill)?),
            DType::BF16 => CpuKvLayers::Bf16(layers(num_layers, len, fill)?),
        })
    }
}

/// Paged KV storage for all layers.
#[derive(Debug)]
pub struct CpuKvStorage {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub layers: CpuKvLayers,
}

/// Writes rows of `k` / `v` into `slots` of one layer, rounded to the cache's type.
fn write_rows<E: KvElem>(
    store: &mut CpuLayerKv<E>,
    width: usize,
    k: &CpuTensor,
    v: &CpuTensor,
    slots: &[u32],
) {
    for (r, &slot) in slots.iter().enumerate() {
        let at = slot as usize * width;
        E::store_f32(k.row(r), store.k.range_mut(at..at + width));
        E::store_f32(v.row(r), store.v.range_mut(at..at + width));
    }
}

/// [`Backend::read_block`] on layers of element type `E`: the stored bytes, as they are.
fn read_block_of<E: KvElem>(layers: &[CpuLayerKv<E>], n: usize, block: u32, dst: &mut [u8]) {
    let bytes = n * size_of::<E>();
    assert_eq!(dst.len(), 2 * bytes * layers.len(), "block buffer length");
    let at = block as usize * n;
    for (layer, out) in layers.iter().zip(dst.chunks_exact_mut(2 * bytes)) {
        let (k, v) = out.split_at_mut(bytes);
        k.copy_from_slice(bytemuck::cast_slice(layer.k.range(at..at + n)));
        v.copy_from_slice(bytemuck::cast_slice(layer.v.range(at..at + n)));
    }
}

/// [`Backend::write_block`] on layers of element type `E`. `src` may have any alignment: it
/// is copied into the (aligned) KV memory byte for byte.
fn write_block_of<E: KvElem>(layers: &mut [CpuLayerKv<E>], n: usize, block: u32, src: &[u8]) {
    let bytes = n * size_of::<E>();
    assert_eq!(src.len(), 2 * bytes * layers.len(), "block buffer length");
    let at = block as usize * n;
    for (layer, data) in layers.iter_mut().zip(src.chunks_exact(2 * bytes)) {
        bytemuck::cast_slice_mut(layer.k.range_mut(at..at + n)).copy_from_slice(&data[..bytes]);
        bytemuck::cast_slice_mut(layer.v.range_mut(at..at + n)).copy_from_slice(&data[bytes..]);
    }
}

/// [`Backend::host_kv_memory`] of layers of element type `E`.
fn host_memory_of<E: KvElem>(layers: &[CpuLayerKv<E>], kv: &CpuKvStorage) -> HostKvMemory {
    let size = size_of::<E>();
    let stride = kv.layout.block_size * kv.layout.token_width() * size;
    let mut regions = Vec::with_capacity(2 * layers.len());
    let mut keep = Vec::with_capacity(2 * layers.len());
    for layer in layers {
        for arena in [&layer.k, &layer.v] {
            // SAFETY: the arena's whole allocation, kept alive by `keep`; the engine
            // touches it only through block ranges (`KvArena::range`/`range_mut`).
            regions.push(unsafe { HostSegment::new(arena.base().cast(), arena.len() * size) });
            keep.push(arena.keep_alive());
        }
    }
    HostKvMemory::new(regions, stride, kv.num_blocks, std::sync::Arc::new(keep))
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type KvStorage = CpuKvStorage;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn load_weight(&self, _name: &str, view: TensorView) -> Result<CpuWeight, EngineError> {
        match view.shape.len() {
            1 => Ok(CpuWeight::Vector(view.to_f32_vec())),
            2 => Ok(CpuWeight::Matrix(view)),
            n => Err(EngineError::Tensor {
                path: view.path().to_path_buf(),
                tensor: view.name.clone(),
                message: format!("has {n} dimensions; the CPU backend takes vectors and matrices"),
            }),
        }
    }

    fn alloc_kv(&self, layout: &KvLayout, num_blocks: usize) -> Result<CpuKvStorage, EngineError> {
        if layout.dtype != self.kv_dtype {
            return Err(EngineError::InvalidRequest(format!(
                "a KV layout of {} asked of a CPU backend storing KV as {}",
                layout.dtype.torch_name(),
                self.kv_dtype.torch_name()
            )));
        }
        // Checked here, at start-up, so a model beyond it fails with a sentence, not in a step.
        if layout.head_dim == 0 || layout.head_dim > attention::MAX_HEAD_DIM {
            return Err(EngineError::InvalidRequest(format!(
                "head_dim {} is not supported by the CPU attention (it takes 1 to {})",
                layout.head_dim,
                attention::MAX_HEAD_DIM
            )));
        }
        let len = num_blocks
            .checked_mul(layout.block_size * layout.token_width())
            .ok_or_else(|| EngineError::OutOfBlocks("KV cache size overflows".into()))?;
        let layers =
            CpuKvLayers::filled(self.kv_dtype, layout.num_layers, len, 0.0).ok_or_else(|| {
                EngineError::OutOfBlocks(format!(
                    "cannot allocate {num_blocks} KV blocks ({} MiB) in host memory",
                    num_blocks.saturating_mul(layout.block_bytes()) >> 20
                ))
            })?;
        Ok(CpuKvStorage {
            layout: layout.clone(),
            num_blocks,
            layers,
        })
    }

    fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> CpuTensor {
        let m = table.matrix();
        let mut out = CpuTensor::zeros(ids.len(), m.cols);
        for (row, &id) in out.data.chunks_mut(m.cols).zip(ids) {
            convert::to_f32_with(self.isa, m.dtype, m.row_bytes(id as usize), row);
        }
        out
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuWeight, group: usize, eps: f32) -> CpuTensor {
        let w = weight.vector();
        assert_eq!(w.len(), group);
        assert_eq!(x.cols % group, 0);
        let mut out = x.clone();
        let norm = |chunk: &mut [f32]| {
            let ss: f32 = chunk.iter().map(|v| v * v).sum();
            let inv = 1.0 / (ss / group as f32 + eps).sqrt();
            for (v, w) in chunk.iter_mut().zip(w) {
                *v = *v * inv * w;
            }
        };
        if out.data.len() >= PAR_THRESHOLD {
            out.data.par_chunks_mut(group).for_each(norm);
        } else {
            out.data.chunks_mut(group).for_each(norm);
        }
        out
    }

    fn linear(&self, x: &CpuTensor, weight: &CpuWeight) -> CpuTensor {
        let m = weight.matrix();
        assert_eq!(x.cols, m.cols, "linear: input width");
        let mut out = CpuTensor::zeros(x.rows, m.rows);
        linear::linear_with(self.isa, &x.data, x.rows, m, &mut out.data);
        out
    }

    fn rope(&self, x: &mut CpuTensor, positions: &[u32], head_dim: usize, theta: f64) {
        assert_eq!(positions.len(), x.rows);
        let half = head_dim / 2;
        // Frequencies in f32 as transformers computes them, so long positions round alike.
        let inv_freq: Vec<f32> = (0..half)
            .map(|j| 1.0 / (theta as f32).powf((2 * j) as f32 / head_dim as f32))
            .collect();
        let cols = x.cols;
        let apply = |(row, &pos): (&mut [f32], &u32)| {
            let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq
                .iter()
                .map(|f| {
                    let a = pos as f32 * f;
                    (a.cos(), a.sin())
                })
                .unzip();
            for head in row.chunks_mut(head_dim) {
                let (lo, hi) = head.split_at_mut(half);
                for j in 0..half {
                    let (a, b) = (lo[j], hi[j]);
                    lo[j] = a * cos[j] - b * sin[j];
                    hi[j] = b * cos[j] + a * sin[j];
                }
            }
        };
        if x.data.len() >= PAR_THRESHOLD {
            x.data.par_chunks_mut(cols).zip(positions).for_each(apply);
        } else {
            x.data.chunks_mut(cols).zip(positions).for_each(apply);
        }
    }

    fn write_kv(
        &self,
        kv: &mut CpuKvStorage,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        slots: &[u32],
    ) {
        let width = kv.layout.token_width();
        assert_eq!(k.cols, width);
        assert_eq!(v.cols, width);
        assert_eq!(slots.len(), k.rows);
        match &mut kv.layers {
            CpuKvLayers::F32(l) => write_rows(&mut l[layer], width, k, v, slots),
            CpuKvLayers::F16(l) => write_rows(&mut l[layer], width, k, v, slots),
            CpuKvLayers::Bf16(l) => write_rows(&mut l[layer], width, k, v, slots),
        }
    }

    fn paged_attention(
        &self,
        q: &CpuTensor,
        kv: &CpuKvStorage,
        layer: usize,
        meta: &AttentionMeta,
    ) -> CpuTensor {
        attention::paged_attention_with(self.isa, q, kv, layer, meta)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        assert_eq!(gate.data.len(), up.data.len());
        let mut out = gate.clone();
        let f = |(g, u): (&mut f32, &f32)| *g = *g / (1.0 + (-*g).exp()) * u;
        if out.data.len() >= PAR_THRESHOLD {
            out.data.par_iter_mut().zip(&up.data).for_each(f);
        } else {
            out.data.iter_mut().zip(&up.data).for_each(f);
        }
        out
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) {
        assert_eq!(x.data.len(), y.data.len());
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn add_rows_scaled(&self, x: &mut CpuTensor, y: &CpuTensor, rows: &[usize], scales: &[f32]) {
        assert_eq!((y.rows, y.cols), (rows.len(), x.cols));
        assert_eq!(rows.len(), scales.len());
        for (i, (&r, &s)) in rows.iter().zip(scales).enumerate() {
            for (a, b) in x.data[r * x.cols..(r + 1) * x.cols]
                .iter_mut()
                .zip(y.row(i))
            {
                *a += s * b;
            }
        }
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(x.row(r));
        }
        CpuTensor::from_vec(rows.len(), x.cols, data)
    }

    fn to_host(&self, x: &CpuTensor) -> HostMatrix {
        HostMatrix {
            rows: x.rows,
            cols: x.cols,
            data: x.data.clone(),
        }
    }

    fn sample(
        &self,
        logits: &CpuTensor,
        rows: &[DeviceSampleRow],
        vocab_limit: usize,
    ) -> Vec<DeviceSample> {
        // Rows are independent: one per core, as the engine samples on the host.
        rows.par_iter()
            .map(|r| sample_row_within(logits.row(r.row), vocab_limit, r))
            .collect()
    }

    fn prompt_logprobs(
        &self,
        logits: &CpuTensor,
        rows: &[PromptLogprobRow],
        vocab_limit: usize,
    ) -> Vec<PromptLogprob> {
        rows.par_iter()
            .map(|r| prompt_logprobs_within(logits.row(r.row), vocab_limit, r.next_token, r.top))
            .collect()
    }

    fn read_block(&self, kv: &CpuKvStorage, block: u32, dst: &mut [u8]) {
        let n = kv.layout.block_size * kv.layout.token_width();
        match &kv.layers {
            CpuKvLayers::F32(l) => read_block_of(l, n, block, dst),
            CpuKvLayers::F16(l) => read_block_of(l, n, block, dst),
            CpuKvLayers::Bf16(l) => read_block_of(l, n, block, dst),
        }
    }

    fn write_block(&self, kv: &mut CpuKvStorage, block: u32, src: &[u8]) {
        let n = kv.layout.block_size * kv.layout.token_width();
        match &mut kv.layers {
            CpuKvLayers::F32(l) => write_block_of(l, n, block, src),
            CpuKvLayers::F16(l) => write_block_of(l, n, block, src),
            CpuKvLayers::Bf16(l) => write_block_of(l, n, block, src),
        }
    }

    /// Every cache type: blocks travel as stored, so the KV memory is the transfer layout.
    fn host_kv_memory(&self, kv: &CpuKvStorage) -> Option<HostKvMemory> {
        Some(match &kv.layers {
            CpuKvLayers::F32(l) => host_memory_of(l, kv),
            CpuKvLayers::F16(l) => host_memory_of(l, kv),
            CpuKvLayers::Bf16(l) => host_memory_of(l, kv),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_for_a_head_dim_beyond_the_attention_kernel_is_refused_at_allocation() {
        let layout = |head_dim| KvLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim,
            block_size: 16,
            dtype: DType::F32,
        };
        let err = CpuBackend::new().alloc_kv(&layout(1024), 4).unwrap_err();
        assert!(err.to_string().contains("head_dim 1024"), "{err}");
        assert_eq!(err.kind(), crate::error::ErrorKind::InvalidArgument);
        assert!(
            CpuBackend::new()
                .alloc_kv(&layout(attention::MAX_HEAD_DIM), 4)
                .is_ok()
        );
    }

    #[test]
    fn a_layout_of_another_kv_type_is_refused_and_blocks_are_stored_bytes() {
        let layout = |dtype| KvLayout {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 8,
            block_size: 4,
            dtype,
        };
        let f16 = CpuBackend::with_kv_dtype(DType::F16);
        let err = f16.alloc_kv(&layout(DType::F32), 4).unwrap_err();
        assert!(err.to_string().contains("float32"), "{err}");
        let mut kv = f16.alloc_kv(&layout(DType::F16), 4).unwrap();
        let bytes = layout(DType::F16).block_bytes();
        assert_eq!(bytes, 2 * 2 * 4 * 8 * 2);
        let block: Vec<u8> = (0..bytes).map(|i| (i * 7) as u8).collect();
        f16.write_block(&mut kv, 2, &block);
        let mut back = vec![0u8; bytes];
        f16.read_block(&kv, 2, &mut back);
        assert_eq!(back, block, "a block round-trips byte for byte");
        // The host memory the transport lands blocks in holds the same bytes in the same
        // order (a piece per layer's K and V).
        let memory = f16.host_kv_memory(&kv).expect("host memory");
        assert_eq!(memory.block_bytes(), bytes);
        // SAFETY: nothing writes the KV while the slices are read.
        let pieces = unsafe { memory.block_slices(2) };
        assert_eq!(pieces.concat(), block);
    }
}
