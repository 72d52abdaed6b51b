//! Qwen3-MoE's sparse layers on the CUDA backend ([`Backend::norm_moe_add`]), routed on the
//! device by `moe.cu` after the norm (into the experts' type) and the router's GEMM:
//!
//! - batches of up to [`MOE_MAX_ROWS`] rows — every decode step and decode graph, short
//!   prefills: `moe_route`, `moe_gate_up`, `moe_down`, weight streams on the CUDA cores. No
//!   host synchronisation, five launches whatever the number of experts chosen, each chosen
//!   expert's weights read once, and a step a CUDA graph can record;
//! - larger batches (prefill chunks), the grouped path: `moe_topk` and `moe_align` route,
//!   the slots come back to the host (one small copy, the one synchronisation), `moe_gather`
//!   lays each expert's rows together, cuBLAS multiplies them on the tensor cores, two
//!   GEMMs per chosen expert, and `moe_silu` / `moe_combine` finish: seven launches besides
//!   the GEMMs, no per-expert upload.
//!
//! Layers whose experts were not uploaded together ([`super::weights`]), or too many experts
//! for the kernels, take the host-routed path of `pd_engine::backend::moe`. Not here: one
//! grouped GEMM launch for all experts (cuBLAS's grouped GEMM wants the per-expert row
//! counts on the host anyway).
//!
//! [`Backend::norm_moe_add`]: pd_engine::backend::Backend::norm_moe_add

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use pd_engine::backend::moe::{self, Expert, NormMoe};
use pd_engine::weights::DType;

use super::gemm::{GemmType, Product};
use super::linear::Operand;
use super::{CudaBackend, CudaTensor, CudaWeight, DeviceBuffer};
use crate::CudaError;

/// Most rows the weight-streaming path takes (`MOE_MAX_ROWS` in moe.cu): the largest
/// decode-graph bucket, so every decode graph of a MoE model records it. Larger batches take
/// the grouped path.
pub(super) const MOE_MAX_ROWS: usize = 128;
/// Most experts a layer may have for the device path (`MOE_MAX_EXPERTS`).
const MOE_MAX_EXPERTS: usize = 512;
/// Most experts per token (`MOE_MAX_TOP_K`).
const MOE_MAX_TOP_K: usize = 16;
/// Warps per block of `moe_gate_up` and `moe_down`, one column each (`MOE_WARPS`).
const MOE_WARPS: usize = 8;
/// Threads of `moe_route`'s one block (`MOE_ROUTE_THREADS`).
const ROUTE_THREADS: u32 = 1024;

/// A sparse layer's experts as the kernels find them: `[experts, 2 · inter, hidden]` gate /
/// up and `[experts, hidden, inter]` down, at these device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackedExperts {
    dtype: DType,
    gate_up: u64,
    down: u64,
    hidden: usize,
    inter: usize,
}

/// `PD_CUDA_MOE` as set in the environment: `device` (unset: the default) routes Qwen3-MoE
/// layers on the device, `host` routes every batch on the host, expert by expert — a switch
/// to tell a defect of these kernels from any other on a GPU that has not run them, as
/// `PD_CUDA_ATTENTION=f32` is for attention.
pub(super) fn on_device_from_env() -> Result<bool, CudaError> {
    match std::env::var("PD_CUDA_MOE") {
        Err(_) => Ok(true),
        Ok(v) if v == "device" => Ok(true),
        Ok(v) if v == "host" => Ok(false),
        Ok(v) => Err(CudaError::BadMoeSetting(v)),
    }
}

/// The kernels' integer arguments for one layer call.
struct Dims {
    rows: i32,
    pairs: i32,
    experts: i32,
    top_k: i32,
    hidden: i32,
    inter: i32,
    dtype: i32,
    renorm: i32,
}

impl Dims {
    fn of(x: &CudaTensor, moe: &NormMoe<'_, CudaWeight>, packed: &PackedExperts) -> Self {
        let int = |v: usize| i32::try_from(v).expect("MoE dimension fits in i32");
        Self {
            rows: int(x.rows),
            pairs: int(x.rows * moe.top_k),
            experts: int(moe.experts.len()),
            top_k: int(moe.top_k),
            hidden: int(packed.hidden),
            inter: int(packed.inter),
            dtype: super::tensor::dtype_code(packed.dtype),
            renorm: i32::from(moe.norm_topk_prob),
        }
    }
}

/// One layer call once routed inputs exist: the experts, the router's `logits` (`[rows,
/// experts]`) and the normalised rows at `input` (`[rows, hidden]` in the experts' type).
struct Call<'a> {
    dims: Dims,
    packed: PackedExperts,
    logits: &'a CudaTensor,
    input: u64,
}

/// Whether the experts at these addresses, each `(gate/up stacked: dtype, 2 · inter, hidden,
/// address; down: dtype, hidden, inter, address)`, lie as the kernels index them: one after
/// another at whole strides, of one dtype and shape, in 16-byte aligned 8-element loads.
fn packed(experts: &[[(DType, usize, usize, u64); 2]]) -> Option<PackedExperts> {
    let [(dtype, inter2, hidden, gate_up), (_, _, _, down)] = *experts.first()?;
    let inter = inter2 / 2;
    let stride = (inter2 * hidden * dtype.size_in_bytes()) as u64 / 2;
    let lies_packed = experts.iter().enumerate().all(|(e, [gu, d])| {
        let e = e as u64;
        *gu == (dtype, 2 * inter, hidden, gate_up + 2 * e * stride)
            && *d == (dtype, hidden, inter, down + e * stride)
    });
    let aligned = gate_up.is_multiple_of(16)
        && down.is_multiple_of(16)
        && hidden.is_multiple_of(8)
        && inter.is_multiple_of(8)
        && inter2 == 2 * inter;
    (lies_packed && aligned && i32::try_from(hidden.max(inter)).is_ok()).then_some(PackedExperts {
        dtype,
        gate_up,
        down,
        hidden,
        inter,
    })
}

/// How a batch of `rows` over `experts` experts, `top_k` per token, runs on the device, if it
/// does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DevicePath {
    /// `moe_route`, `moe_gate_up`, `moe_down`.
    Streamed,
    /// `moe_topk`, `moe_align`, then a GEMM pair per chosen expert.
    Grouped,
}

fn device_path(rows: usize, experts: usize, top_k: usize) -> Option<DevicePath> {
    let routable = rows >= 1
        && (1..=MOE_MAX_EXPERTS).contains(&experts)
        && (1..=MOE_MAX_TOP_K.min(experts)).contains(&top_k)
        && i32::try_from(rows * top_k).is_ok();
    match rows {
        _ if !routable => None,
        1..=MOE_MAX_ROWS => Some(DevicePath::Streamed),
        _ => Some(DevicePath::Grouped),
    }
}

/// Length of the `plan` buffer of moe.cu for `experts` experts and `pairs` (row, choice)
/// pairs.
fn plan_len(experts: usize, pairs: usize) -> usize {
    2 + 2 * experts + pairs
}

impl CudaBackend {
    /// The experts' layout if the device path can index them.
    fn packed_experts(&self, experts: &[Expert<CudaWeight>]) -> Option<PackedExperts> {
        let layout: Option<Vec<_>> = experts
            .iter()
            .map(|e| Some([self.stacked(&[&e.gate, &e.up])?, self.matrix(&e.down)]))
            .collect();
        packed(&layout?)
    }

    /// [`pd_engine::backend::Backend::norm_moe_add`] on the device, if this batch and layer
    /// qualify (see the module); else `false`, nothing launched.
    pub(super) fn norm_moe_on_device(
        &self,
        x: &mut CudaTensor,
        moe: &NormMoe<'_, CudaWeight>,
    ) -> bool {
        let experts = moe.experts.len();
        let on = self
            .moe_on_device
            .load(std::sync::atomic::Ordering::Relaxed);
        let Some(path) = device_path(x.rows, experts, moe.top_k).filter(|_| on) else {
            return false;
        };
        if x.cols != moe.hidden {
            return false;
        }
        let Some(packed) = self.packed_experts(moe.experts) else {
            return false;
        };
        let (router_dtype, router_rows, router_cols, _) = self.matrix(moe.router);
        let router_fits =
            (router_dtype, router_rows, router_cols) == (packed.dtype, experts, x.cols);
        if !router_fits || packed.hidden != x.cols {
            return false;
        }
        // The normalised rows in the experts' type feed the router's GEMM and the experts,
        // as the host path's GEMMs would round them.
        let (normed_f32, normed_16);
        let (logits, input) = match packed.dtype {
            DType::F32 => {
                normed_f32 = self.launch_rms_norm(x, moe.norm, moe.hidden, moe.eps);
                let logits = self.linear_with(Operand::F32(&normed_f32), moe.router);
                (logits, self.ptr(normed_f32.dense()))
            }
            dtype => {
                normed_16 = self.launch_rms_norm_16(x, moe.norm, moe.hidden, moe.eps, dtype);
                let logits = self.linear_with(Operand::bits16(&normed_16, x), moe.router);
                (logits, self.ptr(&normed_16))
            }
        };
        let call = Call {
            dims: Dims::of(x, moe, &packed),
            packed,
            logits: &logits,
            input,
        };
        match path {
            DevicePath::Streamed => self.run_streamed(x, &call),
            DevicePath::Grouped => self.run_grouped(x, &call),
        }
        true
    }

    /// `moe_route` or `moe_topk` (they share their parameters): the router's logits routed
    /// into `out` (the plan, or each pair's expert) and each pair's `weights`.
    fn launch_routing(
        &self,
        name: &str,
        func: &CudaFunction,
        cfg: LaunchConfig,
        call: &Call<'_>,
        out: &DeviceBuffer<u32>,
        weights: &DeviceBuffer<f32>,
    ) {
        let d = &call.dims;
        let mut b = self.dev.stream.launch_builder(func);
        b.arg(call.logits.dense())
            .arg(&d.rows)
            .arg(&d.experts)
            .arg(&d.top_k)
            .arg(&d.renorm)
            .arg(out)
            .arg(weights);
        self.launch(name, b, cfg);
    }

    /// `moe_route`, `moe_gate_up` and `moe_down`.
    fn run_streamed(&self, x: &mut CudaTensor, call: &Call<'_>) {
        let (packed, d) = (&call.packed, &call.dims);
        let (experts, pairs) = (d.experts as usize, d.pairs as usize);
        let plan = self.alloc::<u32>(plan_len(experts, pairs));
        let weights = self.alloc::<f32>(pairs);
        let act = self.alloc::<u8>(pairs * packed.inter * packed.dtype.size_in_bytes());
        let route = &self.dev.kernels.moe_route;
        self.launch_routing("moe_route", route, one_block(), call, &plan, &weights);

        // One block row per possible slot: the routed count is only known on the device.
        let slots = pairs.min(experts) as u32;
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.moe_gate_up);
        b.arg(&call.input)
            .arg(&packed.gate_up)
            .arg(&act)
            .arg(&plan)
            .arg(&d.experts)
            .arg(&d.dtype)
            .arg(&d.hidden)
            .arg(&d.inter)
            .arg(&d.top_k);
        self.launch("moe_gate_up", b, columns(packed.inter, slots));

        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.moe_down);
        b.arg(&act)
            .arg(&packed.down)
            .arg(x.dense())
            .arg(&plan)
            .arg(&weights)
            .arg(&d.experts)
            .arg(&d.dtype)
            .arg(&d.hidden)
            .arg(&d.inter)
            .arg(&d.top_k)
            .arg(&d.rows);
        self.launch("moe_down", b, columns(packed.hidden, 1));
    }

    /// The grouped path: routed on the device, each chosen expert's rows multiplied by
    /// cuBLAS.
    fn run_grouped(&self, x: &mut CudaTensor, call: &Call<'_>) {
        let (packed, d) = (&call.packed, &call.dims);
        let (experts, pairs) = (d.experts as usize, d.pairs as usize);
        let (hidden, inter, elem) = (packed.hidden, packed.inter, packed.dtype.size_in_bytes());
        let pair_expert = self.alloc::<u32>(pairs);
        let weights = self.alloc::<f32>(pairs);
        let topk = &self.dev.kernels.moe_topk;
        let cfg = columns(x.rows, 1);
        self.launch_routing("moe_topk", topk, cfg, call, &pair_expert, &weights);
        let plan = self.alloc::<u32>(plan_len(experts, pairs));
        let pair_pos = self.alloc::<u32>(pairs);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.moe_align);
        b.arg(&pair_expert)
            .arg(&d.pairs)
            .arg(&d.experts)
            .arg(&plan)
            .arg(&pair_pos);
        self.launch("moe_align", b, one_block());

        // The slots, for one GEMM pair per chosen expert: the one synchronisation.
        let head_len = 2 + 2 * experts;
        let mut head = vec![0u32; head_len];
        self.dev
            .stream
            .memcpy_dtoh(&plan.slice(..head_len), &mut head)
            .unwrap_or_else(|e| self.fail("copy the MoE routing to the host", e));
        self.synchronize();
        let slots = head[0] as usize;
        let (slot_expert, slot_start) = (&head[1..1 + slots], &head[1 + experts..]);

        let xs = self.alloc::<u8>(pairs * hidden * elem);
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.moe_gather);
        b.arg(&call.input)
            .arg(&xs)
            .arg(&plan)
            .arg(&d.experts)
            .arg(&d.hidden)
            .arg(&d.dtype)
            .arg(&d.top_k);
        let gather = LaunchConfig {
            grid_dim: (pairs as u32, 1, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("moe_gather", b, gather);

        // Gate / up, then down, of each chosen expert over its rows of the sorted order.
        let gu = self.alloc::<f32>(pairs * 2 * inter);
        let act = self.alloc::<u8>(pairs * inter * elem);
        let y = self.alloc::<f32>(pairs * hidden);
        let ty = GemmType::of(packed.dtype);
        let matrix = (hidden * inter * elem) as u64;
        let per_expert = |product: &dyn Fn(u64, u64, usize) -> Product| {
            for (s, &expert) in slot_expert.iter().enumerate() {
                let (start, end) = (slot_start[s], slot_start[s + 1]);
                let rows = (end - start) as usize;
                self.product(&product(u64::from(expert), u64::from(start), rows));
            }
        };
        let (xs_at, gu_at) = (self.ptr(&xs), self.ptr(&gu));
        per_expert(&|e, start, rows| Product {
            ty,
            x: xs_at + start * (hidden * elem) as u64,
            rows,
            w: packed.gate_up + 2 * e * matrix,
            n: 2 * inter,
            k: hidden,
            out: gu_at + start * (2 * inter * 4) as u64,
            accumulate: false,
        });
        let n = (pairs * inter) as u64;
        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.moe_silu);
        b.arg(&gu).arg(&act).arg(&n).arg(&d.inter).arg(&d.dtype);
        self.launch("moe_silu", b, Self::elements(pairs * inter));
        let (act_at, y_at) = (self.ptr(&act), self.ptr(&y));
        per_expert(&|e, start, rows| Product {
            ty,
            x: act_at + start * (inter * elem) as u64,
            rows,
            w: packed.down + e * matrix,
            n: hidden,
            k: inter,
            out: y_at + start * (hidden * 4) as u64,
            accumulate: false,
        });

        let n = x.len() as u64;
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.moe_combine);
        b.arg(x.dense())
            .arg(&y)
            .arg(&pair_pos)
            .arg(&weights)
            .arg(&n)
            .arg(&d.hidden)
            .arg(&d.top_k);
        self.launch("moe_combine", b, Self::elements(x.len()));
    }

    /// Whether this backend holds Qwen3-MoE experts and routes them on the host
    /// (`PD_CUDA_MOE=host`): then no decode step can be recorded in a graph.
    pub(super) fn routes_moe_on_host(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.moe_layers.load(Relaxed) && !self.moe_on_device.load(Relaxed)
    }

    /// The host-routed path ([`moe::norm_moe_add_on_host`]). A graph cannot record it (it
    /// reads the routing on the host), so while one records this panics with the reason, and
    /// the capture gives up: graphs off, the step run eagerly (`graph.rs`).
    pub(super) fn route_moe_on_host(&self, x: &mut CudaTensor, moe: &NormMoe<'_, CudaWeight>) {
        if self.capture_inputs().is_some() {
            panic!(
                "a Qwen3-MoE layer of {} experts ({} per token) is routed on the host, which a \
                 CUDA graph cannot record (the device takes up to {MOE_MAX_EXPERTS} experts, \
                 {MOE_MAX_TOP_K} per token, uploaded together)",
                moe.experts.len(),
                moe.top_k
            );
        }
        moe::norm_moe_add_on_host(self, x, moe);
    }
}

/// The routing kernels' one block.
fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (ROUTE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per column of `columns` (or row, for `moe_topk`), [`MOE_WARPS`] per block;
/// `slots` block rows.
fn columns(columns: usize, slots: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (columns.div_ceil(MOE_WARPS) as u32, slots, 1),
        block_dim: ((MOE_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Experts of `bf16 [2 · 16, 64]` gate/up and `[64, 16]` down at whole strides.
    fn layout(count: u64, gate_up: u64, down: u64) -> Vec<[(DType, usize, usize, u64); 2]> {
        let stride = 16 * 64 * 2;
        (0..count)
            .map(|e| {
                [
                    (DType::BF16, 32, 64, gate_up + 2 * e * stride),
                    (DType::BF16, 64, 16, down + e * stride),
                ]
            })
            .collect()
    }

    #[test]
    fn experts_at_whole_strides_are_indexed_by_the_kernels() {
        let p = packed(&layout(4, 1 << 20, 1 << 24)).expect("packed");
        assert_eq!((p.hidden, p.inter, p.dtype), (64, 16, DType::BF16));
        assert_eq!((p.gate_up, p.down), (1 << 20, 1 << 24));
    }

    #[test]
    fn experts_out_of_place_or_misaligned_take_the_host_path() {
        let mut l = layout(4, 1 << 20, 1 << 24);
        l[2][1].3 += 4096;
        assert_eq!(packed(&l), None, "one down elsewhere");
        let mut l = layout(4, 1 << 20, 1 << 24);
        l.swap(1, 2);
        assert_eq!(packed(&l), None, "experts out of order");
        let mut l = layout(4, 1 << 20, 1 << 24);
        l[3][0].0 = DType::F16;
        assert_eq!(packed(&l), None, "mixed dtypes");
        assert_eq!(
            packed(&layout(4, (1 << 20) + 8, 1 << 24)),
            None,
            "unaligned"
        );
        assert_eq!(packed(&[]), None, "no experts");
        let odd = vec![[(DType::F32, 2 * 12, 64, 0), (DType::F32, 64, 12, 1 << 20)]];
        assert_eq!(packed(&odd), None, "width 12 is not whole 8-element loads");
    }

    #[test]
    fn decode_batches_stream_the_weights_and_prefill_batches_are_grouped() {
        let path = device_path;
        assert_eq!(
            path(1, 128, 8),
            Some(DevicePath::Streamed),
            "Qwen3-30B-A3B, batch 1"
        );
        assert_eq!(
            path(MOE_MAX_ROWS, 128, 8),
            Some(DevicePath::Streamed),
            "the largest graph bucket"
        );
        assert_eq!(path(MOE_MAX_ROWS + 1, 128, 8), Some(DevicePath::Grouped));
        assert_eq!(
            path(8192, 128, 8),
            Some(DevicePath::Grouped),
            "a prefill chunk"
        );
        assert_eq!(path(0, 128, 8), None);
        assert_eq!(
            path(4, 1024, 8),
            None,
            "more experts than a warp's registers hold"
        );
        assert_eq!(path(4, 128, 17), None);
        assert_eq!(path(4, 4, 5), None, "more choices than experts");
        assert_eq!(plan_len(128, 64), 2 + 256 + 64);
    }
}
