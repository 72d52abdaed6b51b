//! Qwen3's q/k step on the CUDA backend: the `qk_norm_rope` kernel's launch (per-head RMSNorm
//! and RoPE of q and k), alone or with the layer's KV write fused in (the rotated k and v
//! into their slots, as `write_kv` writes them). The kernel is in `elementwise.cu`.

use pd_engine::backend::QkNormRope;

use super::pdl::arg;
use super::tensor::dtype_code;
use super::weights::weight_vector;
use super::{CudaBackend, CudaKvStorage, CudaTensor, CudaWeight, cached};

/// Where `qk_norm_rope` puts the rotated k: a tensor, or (with v) the layer's KV slots.
pub(super) enum KOut<'a> {
    Tensor(&'a CudaTensor),
    Cache {
        kv: &'a CudaKvStorage,
        layer: usize,
        v: &'a CudaTensor,
        slots: &'a [u32],
    },
}

impl CudaBackend {
    /// The device address of `slots`: the staged copy while a graph captures, else an
    /// upload shared by every op of the step that takes the same slots.
    pub(super) fn slots_ptr(&self, slots: &[u32]) -> u64 {
        match self.capture_inputs() {
            Some(staged) => staged.slots,
            None => {
                let mut uploads = self.uploads.lock().expect("uploads lock");
                self.ptr(cached(&mut uploads.slots, slots, |h| self.upload(h)))
            }
        }
    }

    /// The `qk_norm_rope` kernel: the rotated q as a new tensor, the rotated k into `k_out`.
    pub(super) fn norm_rope(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        p: &QkNormRope<'_, CudaWeight>,
        k_out: KOut<'_>,
    ) -> CudaTensor {
        let head_dim = p.head_dim;
        assert_eq!(p.positions.len(), q.rows);
        assert_eq!(q.rows, k.rows, "q and k have the same rows");
        assert!(
            q.cols.is_multiple_of(head_dim) && k.cols.is_multiple_of(head_dim),
            "q/k widths are whole heads"
        );
        let q_out = self.tensor(q.rows, q.cols);
        if q.rows == 0 {
            return q_out;
        }
        let pos = self.positions_ptr(p.positions);
        let (q_heads, k_heads) = (q.cols / head_dim, k.cols / head_dim);
        let (rows, qh, kh, hd, th) = (
            q.rows as i32,
            q_heads as i32,
            k_heads as i32,
            head_dim as i32,
            p.theta as f32,
        );
        // The KV write, when fused: k rows to the cache (no k tensor), v heads copied.
        let (k_ptr, kcache, vcache, kv_code, v_ptr, v_stride, slots_ptr, v_heads) = match k_out {
            KOut::Tensor(t) => (self.ptr(t.dense()), 0u64, 0u64, 0i32, 0u64, 0i32, 0u64, 0),
            KOut::Cache {
                kv,
                layer,
                v,
                slots,
            } => (
                0,
                self.ptr(&kv.k[layer]),
                self.ptr(&kv.v[layer]),
                dtype_code(kv.dtype),
                self.rows_ptr(v),
                v.stride() as i32,
                self.slots_ptr(slots),
                k_heads,
            ),
        };
        // One thread per rotated pair, in whole warps (block_sum needs them).
        let threads = (head_dim / 2).div_ceil(32).max(1) as u32 * 32;
        // q and k may be views of one stacked q/k/v product; the outputs are dense.
        let (q_in, k_in) = (self.rows_ptr(q), self.rows_ptr(k));
        let (q_stride, k_stride) = (q.stride() as i32, k.stride() as i32);
        let (wq, wk) = (
            self.ptr(weight_vector(p.q_norm)),
            self.ptr(weight_vector(p.k_norm)),
        );
        let q_ptr = self.ptr(q_out.dense());
        let mut args = [
            arg(&q_in),
            arg(&k_in),
            arg(&q_stride),
            arg(&k_stride),
            arg(&wq),
            arg(&wk),
            arg(&q_ptr),
            arg(&k_ptr),
            arg(&pos),
            arg(&rows),
            arg(&qh),
            arg(&kh),
            arg(&hd),
            arg(&p.eps),
            arg(&th),
            arg(&kcache),
            arg(&vcache),
            arg(&kv_code),
            arg(&v_ptr),
            arg(&v_stride),
            arg(&slots_ptr),
        ];
        let cfg = Self::per_row(q.rows * (q_heads + k_heads + v_heads), threads);
        // SAFETY: qk_norm_rope's parameters, in order, with the types it declares; the
        // buffers cover the grid's rows and heads and outlive the queued launch; the kernel
        // waits before it reads or writes anything.
        unsafe {
            self.launch_dependent(
                "qk_norm_rope",
                &self.dev.kernels.qk_norm_rope,
                cfg,
                &mut args,
            )
        };
        q_out
    }
}
