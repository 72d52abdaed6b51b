//! Qwen3-MoE's sparse layers on the CUDA backend ([`Backend::norm_moe_add`]). Batches of up
//! to [`MOE_MAX_ROWS`] rows — every decode step and decode graph, short prefills — are routed
//! and run on the device by `moe.cu` (the norm into the experts' type, the router's GEMM,
//! then `moe_route`, `moe_gate_up`, `moe_down`): no host synchronisation, five launches
//! whatever the number of experts chosen, each chosen expert's weights read once, and a step
//! a CUDA graph can record. Larger batches (prefill chunks), and layers whose experts were
//! not uploaded together ([`super::weights`]), take the host-routed path of
//! `pd_engine::backend::moe`: per expert a gather, the GEMMs on the tensor cores, and an add.
//! Not here: a grouped tensor-core GEMM for prefill-sized batches.
//!
//! [`Backend::norm_moe_add`]: pd_engine::backend::Backend::norm_moe_add

use cudarc::driver::{LaunchConfig, PushKernelArg};
use pd_engine::backend::moe::{self, Expert, NormMoe};
use pd_engine::weights::DType;

use super::linear::Operand;
use super::{CudaBackend, CudaTensor, CudaWeight};

/// Most rows the device path takes (`MOE_MAX_ROWS` in moe.cu): the largest decode-graph
/// bucket, so every decode graph of a MoE model records it.
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

/// Whether a batch of `rows` over `experts` experts, `top_k` per token, fits the kernels.
fn fits(rows: usize, experts: usize, top_k: usize) -> bool {
    (1..=MOE_MAX_ROWS).contains(&rows)
        && (1..=MOE_MAX_EXPERTS).contains(&experts)
        && (1..=MOE_MAX_TOP_K.min(experts)).contains(&top_k)
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
        if !on || !fits(x.rows, experts, moe.top_k) || x.cols != moe.hidden {
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
        self.run_experts(x, moe, &packed, &logits, input);
        true
    }

    /// `moe_route`, `moe_gate_up` and `moe_down` over the router's `logits` (`[rows,
    /// experts]`) and the normalised rows at `input` (`[rows, hidden]` in the experts' type).
    fn run_experts(
        &self,
        x: &mut CudaTensor,
        moe: &NormMoe<'_, CudaWeight>,
        packed: &PackedExperts,
        logits: &CudaTensor,
        input: u64,
    ) {
        let (rows, experts, top_k) = (x.rows, moe.experts.len(), moe.top_k);
        let pairs = rows * top_k;
        let plan = self.alloc::<u32>(plan_len(experts, pairs));
        let weights = self.alloc::<f32>(pairs);
        let act = self.alloc::<u8>(pairs * packed.inter * packed.dtype.size_in_bytes());
        let int = |v: usize| i32::try_from(v).expect("MoE dimension fits in i32");
        let (rows_i, experts_i, top_k_i) = (int(rows), int(experts), int(top_k));
        let (hidden_i, inter_i) = (int(packed.hidden), int(packed.inter));
        let dtype = super::tensor::dtype_code(packed.dtype);
        let renorm = i32::from(moe.norm_topk_prob);

        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.moe_route);
        b.arg(logits.dense())
            .arg(&rows_i)
            .arg(&experts_i)
            .arg(&top_k_i)
            .arg(&renorm)
            .arg(&plan)
            .arg(&weights);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (ROUTE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("moe_route", b, one_block);

        // One block row per possible slot: the routed count is only known on the device.
        let slots = pairs.min(experts) as u32;
        let mut b = self
            .dev
            .stream
            .launch_builder(&self.dev.kernels.moe_gate_up);
        b.arg(&input)
            .arg(&packed.gate_up)
            .arg(&act)
            .arg(&plan)
            .arg(&experts_i)
            .arg(&dtype)
            .arg(&hidden_i)
            .arg(&inter_i)
            .arg(&top_k_i);
        self.launch("moe_gate_up", b, columns(packed.inter, slots));

        let mut b = self.dev.stream.launch_builder(&self.dev.kernels.moe_down);
        b.arg(&act)
            .arg(&packed.down)
            .arg(x.dense())
            .arg(&plan)
            .arg(&weights)
            .arg(&experts_i)
            .arg(&dtype)
            .arg(&hidden_i)
            .arg(&inter_i)
            .arg(&top_k_i)
            .arg(&rows_i);
        self.launch("moe_down", b, columns(packed.hidden, 1));
    }

    /// The host-routed path ([`moe::norm_moe_add_on_host`]). A graph cannot record it (it
    /// reads the routing on the host), so while one records this panics with the reason, and
    /// the capture gives up: graphs off, the step run eagerly (`graph.rs`).
    pub(super) fn route_moe_on_host(&self, x: &mut CudaTensor, moe: &NormMoe<'_, CudaWeight>) {
        if self.capture_inputs().is_some() {
            panic!(
                "a Qwen3-MoE layer of {} rows, {} experts ({} per token) is routed on the host, \
                 which a CUDA graph cannot record (the device path takes up to {MOE_MAX_ROWS} \
                 rows, {MOE_MAX_EXPERTS} experts, {MOE_MAX_TOP_K} per token, uploaded together)",
                x.rows,
                moe.experts.len(),
                moe.top_k
            );
        }
        moe::norm_moe_add_on_host(self, x, moe);
    }
}

/// One warp per column of `columns`, [`MOE_WARPS`] per block; `slots` block rows.
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
    fn decode_sized_batches_fit_the_device_path() {
        assert!(fits(1, 128, 8), "Qwen3-30B-A3B, batch 1");
        assert!(fits(MOE_MAX_ROWS, 128, 8), "the largest graph bucket");
        assert!(!fits(MOE_MAX_ROWS + 1, 128, 8), "a prefill-sized batch");
        assert!(!fits(0, 128, 8));
        assert!(
            !fits(4, 1024, 8),
            "more experts than a warp's registers hold"
        );
        assert!(!fits(4, 128, 17));
        assert!(!fits(4, 4, 5), "more choices than experts");
        assert_eq!(plan_len(128, 64), 2 + 256 + 64);
    }
}
