//! The element-wise and row-wise ops of the CUDA backend (`elementwise.cu`, `kv.cu`'s
//! `write_kv`): embedding gather, RMSNorm, RoPE, SiLU-and-multiply, residual add, row
//! selection, the KV write, and the copy of a tensor to the host. The `Backend` impl calls
//! these; the products, attention and sampling live in their own parts.

use cudarc::driver::PushKernelArg;
use pd_engine::backend::HostMatrix;
use pd_engine::weights::DType;

use super::DeviceBuffer;
use super::tensor::dtype_code;
use super::weights::weight_vector;
use super::{CudaBackend, CudaKvStorage, CudaTensor, CudaWeight, THREADS};

/// Kernel arguments of `silu_mul` / `silu_mul_16` (see [`CudaBackend::silu_mul_args`]).
pub(super) struct SiluMulArgs {
    pub(super) gate: u64,
    pub(super) up: u64,
    pub(super) n: u64,
    pub(super) cols: i32,
    pub(super) gate_stride: i32,
    pub(super) up_stride: i32,
}

/// Threads of an RMSNorm block: two warps for a head (q/k norms), more for a hidden row.
pub(super) fn norm_threads(group: usize) -> u32 {
    if group <= 128 { 64 } else { THREADS }
}

impl CudaBackend {
    /// The inputs of `silu_mul` / `silu_mul_16`: `gate` and `up` of one shape, each dense or a
    /// view (the two halves of one stacked gate/up product).
    pub(super) fn silu_mul_args(&self, gate: &CudaTensor, up: &CudaTensor) -> SiluMulArgs {
        assert_eq!(
            (gate.rows, gate.cols),
            (up.rows, up.cols),
            "silu_mul: shapes"
        );
        SiluMulArgs {
            gate: self.rows_ptr(gate),
            up: self.rows_ptr(up),
            n: gate.len() as u64,
            cols: gate.cols as i32,
            gate_stride: gate.stride() as i32,
            up_stride: up.stride() as i32,
        }
    }

    /// Looks up `ids` in `table`: one row per id.
    pub(super) fn launch_embedding(&self, table: &CudaWeight, ids: &[u32]) -> CudaTensor {
        let (dtype, _, cols, table_ptr) = self.matrix(table);
        let out = self.tensor(ids.len(), cols);
        if ids.is_empty() {
            return out;
        }
        // An eager upload lives until the end of the call, after the launch is queued.
        let ids_dev;
        let ids_ptr = match self.capture_inputs() {
            Some(staged) => staged.ids,
            None => {
                ids_dev = self.upload(ids);
                self.ptr(&ids_dev)
            }
        };
        let (code, rows, cols_i) = (dtype_code(dtype), ids.len() as i32, cols as i32);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.embedding);
        b.arg(&table_ptr)
            .arg(&code)
            .arg(&ids_ptr)
            .arg(out.dense())
            .arg(&rows)
            .arg(&cols_i);
        self.launch("embedding", b, Self::per_row(ids.len(), THREADS));
        out
    }

    /// RMSNorm over groups of `group` columns (a hidden row, or one head).
    pub(super) fn launch_rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        group: usize,
        eps: f32,
    ) -> CudaTensor {
        let w = weight_vector(weight);
        assert_eq!(x.cols % group, 0, "rms_norm: width is whole groups");
        let out = self.tensor(x.rows, x.cols);
        let groups = x.len() / group;
        if groups == 0 {
            return out;
        }
        let (groups_i, group_i) = (groups as i32, group as i32);
        let threads = norm_threads(group);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.rms_norm);
        b.arg(x.dense())
            .arg(w)
            .arg(out.dense())
            .arg(&groups_i)
            .arg(&group_i)
            .arg(&eps);
        self.launch("rms_norm", b, Self::per_row(groups, threads));
        out
    }

    /// Rotates `x` in place by `positions` (NeoX halves).
    pub(super) fn launch_rope(
        &self,
        x: &mut CudaTensor,
        positions: &[u32],
        head_dim: usize,
        theta: f64,
    ) {
        assert_eq!(positions.len(), x.rows);
        if x.is_empty() {
            return;
        }
        let pos = self.positions_ptr(positions);
        let (rows, cols, hd, th) = (x.rows as i32, x.cols as i32, head_dim as i32, theta as f32);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.rope);
        b.arg(x.dense())
            .arg(&pos)
            .arg(&rows)
            .arg(&cols)
            .arg(&hd)
            .arg(&th);
        self.launch("rope", b, Self::elements(x.len() / 2));
    }

    /// Writes `k` and `v` at `slots` of `layer`.
    pub(super) fn launch_write_kv(
        &self,
        kv: &mut CudaKvStorage,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        slots: &[u32],
    ) {
        let width = kv.layout.token_width();
        assert_eq!(k.cols, width);
        assert_eq!(v.cols, width);
        assert_eq!(slots.len(), k.rows);
        if slots.is_empty() {
            return;
        }
        let slots_dev = self.slots_ptr(slots);
        let (rows, width_i) = (k.rows as i32, width as i32);
        // v (and k) may be views of one stacked q/k/v product.
        let (k_in, v_in) = (self.rows_ptr(k), self.rows_ptr(v));
        let (k_stride, v_stride) = (k.stride() as i32, v.stride() as i32);
        let code = dtype_code(kv.dtype);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.write_kv);
        b.arg(&kv.k[layer])
            .arg(&kv.v[layer])
            .arg(&code)
            .arg(&k_in)
            .arg(&v_in)
            .arg(&k_stride)
            .arg(&v_stride)
            .arg(&slots_dev)
            .arg(&rows)
            .arg(&width_i);
        self.launch("write_kv", b, Self::per_row(k.rows, 128));
    }

    /// `silu(gate) * up`.
    pub(super) fn launch_silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        assert_eq!(gate.len(), up.len());
        let out = self.tensor(gate.rows, gate.cols);
        if out.is_empty() {
            return out;
        }
        let a = self.silu_mul_args(gate, up);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.silu_mul);
        b.arg(&a.gate)
            .arg(&a.up)
            .arg(out.dense())
            .arg(&a.n)
            .arg(&a.cols)
            .arg(&a.gate_stride)
            .arg(&a.up_stride);
        self.launch("silu_mul", b, Self::elements(out.len()));
        out
    }

    /// `rms_norm(x)` over groups of `group` features, written in the 16-bit `dtype` as a
    /// GEMM's input (rounded as `cast_bf16` / `cast_f16` round the f32 value).
    pub(super) fn launch_rms_norm_16(
        &self,
        x: &CudaTensor,
        norm: &CudaWeight,
        group: usize,
        eps: f32,
        dtype: DType,
    ) -> DeviceBuffer<u16> {
        assert_eq!(x.cols % group, 0, "rms_norm: width is whole groups");
        let x16 = self.alloc::<u16>(x.len());
        let groups = x.len() / group;
        let (groups_i, group_i, code) = (groups as i32, group as i32, dtype_code(dtype));
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.rms_norm_16);
        b.arg(x.dense())
            .arg(weight_vector(norm))
            .arg(&x16)
            .arg(&groups_i)
            .arg(&group_i)
            .arg(&eps)
            .arg(&code);
        self.launch("rms_norm_16", b, Self::per_row(groups, norm_threads(group)));
        x16
    }

    /// `x += y`.
    pub(super) fn launch_add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        assert_eq!(x.len(), y.len());
        if x.is_empty() {
            return;
        }
        let n = x.len() as u64;
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.add_assign);
        b.arg(x.dense()).arg(y.dense()).arg(&n);
        self.launch("add_assign", b, Self::elements(x.len()));
    }

    /// `x[rows[i]] += scales[i] · y[i]` (a Qwen3-MoE expert's output on the host-routed path,
    /// which a graph never records: `moe.rs`).
    pub(super) fn launch_add_rows_scaled(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        rows: &[usize],
        scales: &[f32],
    ) {
        assert_eq!((y.rows, y.cols), (rows.len(), x.cols));
        assert_eq!(rows.len(), scales.len());
        assert!(
            rows.iter().all(|&r| r < x.rows),
            "add_rows_scaled: row in range"
        );
        if y.is_empty() {
            return;
        }
        let host: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let rows_dev = self.upload(&host);
        let scales_dev = self.upload(scales);
        let (rows_ptr, scales_ptr) = (self.ptr(&rows_dev), self.ptr(&scales_dev));
        let (n, cols) = (rows.len() as i32, x.cols as i32);
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.add_rows_scaled);
        b.arg(x.dense())
            .arg(y.dense())
            .arg(&rows_ptr)
            .arg(&scales_ptr)
            .arg(&n)
            .arg(&cols);
        self.launch("add_rows_scaled", b, Self::per_row(rows.len(), THREADS));
    }

    /// The rows `rows` of `x`, in that order.
    pub(super) fn launch_select_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let out = self.tensor(rows.len(), x.cols);
        if out.is_empty() {
            return out;
        }
        assert!(
            rows.iter().all(|&r| r < x.rows),
            "select_rows: row in range"
        );
        let idx_dev;
        let idx = match self.capture_inputs() {
            Some(staged) => staged.select,
            None => {
                let host: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                idx_dev = self.upload(&host);
                self.ptr(&idx_dev)
            }
        };
        let (n, cols) = (rows.len() as i32, x.cols as i32);
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.select_rows);
        b.arg(x.dense())
            .arg(&idx)
            .arg(out.dense())
            .arg(&n)
            .arg(&cols);
        self.launch("select_rows", b, Self::per_row(rows.len(), THREADS));
        out
    }

    /// Copies `x` to the host (waits for the device).
    pub(super) fn copy_to_host(&self, x: &CudaTensor) -> HostMatrix {
        // A view (columns of a stacked product) is copied with the rows' gaps, which are
        // dropped here: the host is the only reader.
        let span = if x.is_empty() {
            0
        } else {
            (x.rows - 1) * x.stride() + x.cols
        };
        let mut copied = vec![0f32; span];
        if span > 0 {
            let src = x.buffer().slice(x.offset()..x.offset() + span);
            self.dev
                .stream
                .memcpy_dtoh(&src, &mut copied)
                .unwrap_or_else(|e| self.fail("copy to host", e));
        }
        self.synchronize();
        let data = if span == x.len() {
            copied
        } else {
            (0..x.rows)
                .flat_map(|r| &copied[r * x.stride()..r * x.stride() + x.cols])
                .copied()
                .collect()
        };
        HostMatrix {
            rows: x.rows,
            cols: x.cols,
            data,
        }
    }
}
