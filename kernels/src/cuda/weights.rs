//! Weights on the device: uploading them (norm vectors widened to f32, matrices as stored,
//! projections that share their input side by side in one buffer, a sparse layer's experts
//! one after another) and reading a weight back as a matrix or a vector. What a weight is:
//! [`super::CudaWeight`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::CudaSlice;
use pd_engine::backend::Backend as _;
use pd_engine::backend::moe::Expert;
use pd_engine::error::EngineError;
use pd_engine::weights::{DType, TensorView};

use super::{CudaBackend, CudaWeight};

/// `(dtype, rows, cols, buffer, byte offset of row 0 in it)` of a matrix weight.
pub(super) fn weight_matrix(w: &CudaWeight) -> (DType, usize, usize, &Arc<CudaSlice<u8>>, usize) {
    match w {
        CudaWeight::Matrix {
            dtype,
            rows,
            cols,
            data,
            offset,
        } => (*dtype, *rows, *cols, data, *offset),
        CudaWeight::Vector(_) => panic!("a vector weight used as a matrix"),
    }
}

pub(super) fn weight_vector(w: &CudaWeight) -> &CudaSlice<f32> {
    match w {
        CudaWeight::Vector(v) => v,
        CudaWeight::Matrix { .. } => panic!("a matrix weight used as a vector"),
    }
}

pub(super) fn engine_error(view: &TensorView, e: impl std::fmt::Display) -> EngineError {
    EngineError::Tensor {
        path: view.path().to_path_buf(),
        tensor: view.name.clone(),
        message: e.to_string(),
    }
}

impl CudaBackend {
    /// The error of a failed upload of `view`.
    fn upload_failed(&self, view: &TensorView, e: cudarc::driver::DriverError) -> EngineError {
        engine_error(view, format!("cannot upload to {}: {e}", self.name()))
    }

    /// [`Backend::load_weight`]: a vector widened to f32, a matrix uploaded as stored.
    ///
    /// [`Backend::load_weight`]: pd_engine::backend::Backend::load_weight
    pub(super) fn upload_weight(&self, view: TensorView) -> Result<CudaWeight, EngineError> {
        let upload_error = |e| self.upload_failed(&view, e);
        let weight = match view.shape.len() {
            1 => {
                let v = view.to_f32_vec();
                let data = self.dev.stream.clone_htod(&v).map_err(upload_error)?;
                CudaWeight::Vector(data)
            }
            2 => {
                let data = self
                    .dev
                    .stream
                    .clone_htod(view.bytes())
                    .map_err(upload_error)?;
                // The model's dtype, for `--kv-cache-dtype auto` (the first matrix's).
                let _ = self.matrix_dtype.set(view.dtype);
                CudaWeight::Matrix {
                    dtype: view.dtype,
                    rows: view.shape[0],
                    cols: view.shape[1],
                    data: Arc::new(data),
                    offset: 0,
                }
            }
            n => {
                return Err(engine_error(
                    &view,
                    format!("has {n} dimensions; the CUDA backend takes vectors and matrices"),
                ));
            }
        };
        self.weight_bytes
            .fetch_add(view.bytes().len(), Ordering::Relaxed);
        Ok(weight)
    }

    /// [`Backend::load_stacked`]: the parts side by side in one buffer when they are
    /// matrices of one dtype and width, else one by one.
    ///
    /// [`Backend::load_stacked`]: pd_engine::backend::Backend::load_stacked
    pub(super) fn upload_stacked<const N: usize>(
        &self,
        parts: [(&str, TensorView); N],
    ) -> Result<[CudaWeight; N], EngineError> {
        let side_by_side = parts.iter().all(|(_, v)| {
            let first = &parts[0].1;
            v.shape.len() == 2 && v.dtype == first.dtype && v.shape.get(1) == first.shape.get(1)
        });
        if N == 0 || !side_by_side {
            let mut weights = Vec::with_capacity(N);
            for (_, view) in parts {
                weights.push(self.upload_weight(view)?);
            }
            return Ok(weights
                .try_into()
                .unwrap_or_else(|_| unreachable!("one weight per part")));
        }
        let (first, dtype) = (&parts[0].1, parts[0].1.dtype);
        // One buffer, the parts side by side in order: one GEMM multiplies them all.
        let total: usize = parts.iter().map(|(_, v)| v.bytes().len()).sum();
        // SAFETY: every byte is written by the uploads below before any kernel reads it.
        let mut data = unsafe { self.dev.stream.alloc::<u8>(total.max(1)) }
            .map_err(|e| self.upload_failed(first, e))?;
        let mut offsets = [0usize; N];
        let mut at = 0;
        for (i, (_, view)) in parts.iter().enumerate() {
            let len = view.bytes().len();
            self.dev
                .stream
                .memcpy_htod(view.bytes(), &mut data.slice_mut(at..at + len))
                .map_err(|e| self.upload_failed(view, e))?;
            offsets[i] = at;
            at += len;
        }
        self.weight_bytes.fetch_add(total, Ordering::Relaxed);
        let _ = self.matrix_dtype.set(dtype);
        let data = Arc::new(data);
        Ok(std::array::from_fn(|i| CudaWeight::Matrix {
            dtype,
            rows: parts[i].1.shape[0],
            cols: parts[i].1.shape[1],
            data: data.clone(),
            offset: offsets[i],
        }))
    }

    /// [`Backend::load_experts`]: every expert's gate and up side by side, expert after
    /// expert, in one buffer (`[experts, 2 · inter, hidden]`, as vLLM's fused MoE holds them)
    /// and every down in another (`[experts, hidden, inter]`), so the MoE kernels find expert
    /// `e` at `e` strides from the start (`moe.rs`). Experts of mixed dtypes or shapes are
    /// uploaded one by one instead (and then routed on the host).
    ///
    /// [`Backend::load_experts`]: pd_engine::backend::Backend::load_experts
    pub(super) fn upload_experts(
        &self,
        experts: Vec<[(&str, TensorView); 3]>,
    ) -> Result<Vec<Expert<CudaWeight>>, EngineError> {
        let Some(first) = experts.first() else {
            return Ok(Vec::new());
        };
        self.moe_layers.store(true, Ordering::Relaxed);
        let dtype = first[0].1.dtype;
        let alike = |parts: &[(&str, TensorView); 3]| {
            parts.iter().zip(first).all(|((_, v), (_, f))| {
                v.shape.len() == 2 && v.dtype == dtype && v.shape == f.shape
            })
        };
        let [gate, up, down] = [0, 1, 2].map(|i| &first[i].1.shape);
        let swiglu = gate.len() == 2
            && gate == up
            && down.len() == 2
            && (down[0], down[1]) == (gate[1], gate[0]);
        if !swiglu || !experts.iter().all(alike) {
            return experts
                .into_iter()
                .map(|[gate, up, down]| {
                    let [gate, up] = self.upload_stacked([gate, up])?;
                    let down = self.upload_weight(down.1)?;
                    Ok(Expert { gate, up, down })
                })
                .collect();
        }
        let matrix = first[0].1.bytes().len();
        let count = experts.len();
        let alloc = |len: usize, view: &TensorView| {
            // SAFETY: every byte is written by the uploads below before any kernel reads it.
            unsafe { self.dev.stream.alloc::<u8>(len.max(1)) }
                .map_err(|e| self.upload_failed(view, e))
        };
        let mut gate_up = alloc(count * 2 * matrix, &first[0].1)?;
        let mut downs = alloc(count * matrix, &first[2].1)?;
        for (e, parts) in experts.iter().enumerate() {
            for (i, (_, view)) in parts.iter().enumerate() {
                let (buffer, at) = match i {
                    0 | 1 => (&mut gate_up, (2 * e + i) * matrix),
                    _ => (&mut downs, e * matrix),
                };
                self.dev
                    .stream
                    .memcpy_htod(view.bytes(), &mut buffer.slice_mut(at..at + matrix))
                    .map_err(|e| self.upload_failed(view, e))?;
            }
        }
        self.weight_bytes
            .fetch_add(3 * count * matrix, Ordering::Relaxed);
        let _ = self.matrix_dtype.set(dtype);
        let (gate_up, downs) = (Arc::new(gate_up), Arc::new(downs));
        let (inter, hidden) = (gate[0], gate[1]);
        let view = |data: &Arc<CudaSlice<u8>>, rows, cols, offset| CudaWeight::Matrix {
            dtype,
            rows,
            cols,
            data: data.clone(),
            offset,
        };
        Ok((0..count)
            .map(|e| Expert {
                gate: view(&gate_up, inter, hidden, 2 * e * matrix),
                up: view(&gate_up, inter, hidden, (2 * e + 1) * matrix),
                down: view(&downs, hidden, inter, e * matrix),
            })
            .collect())
    }
}
