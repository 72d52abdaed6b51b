//! One Qwen3-30B-A3B sparse layer alone (its real shape: hidden 2,048, 128 experts of width
//! 768, 8 per token, renormalised; random bf16 weights from a real safetensors file): routed
//! on the device (`moe.cu`) against routed on the host expert by expert, at decode batches of
//! 1, 8 and 64 (the weight-streaming kernels; the share of the copy bandwidth each path
//! reaches reading the weights of the experts the batch chose) and prefill batches of 512 and
//! 2,048 rows (the grouped path; the share of the GEMM rate its expert FLOPs reach). The whole
//! model (61 GB) does not fit the GPU host's disk; one layer is what a step repeats 48 times.

use pd_engine::backend::moe::{NormMoe, route};
use pd_engine::backend::{Backend, HostMatrix};
use pd_engine::weights::writer::{TensorSpec, write_checkpoint};
use pd_engine::weights::{Checkpoint, DType};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::CudaTensor;
use serde_json::{Value, json};

use super::{Sizes, timed_ms};

/// A sparse layer's shape: hidden, experts, expert width, experts per token.
#[derive(Clone, Copy)]
pub(crate) struct MoeShape {
    pub(crate) hidden: usize,
    pub(crate) experts: usize,
    pub(crate) inter: usize,
    pub(crate) top_k: usize,
}

/// Qwen3-30B-A3B's.
pub(crate) const QWEN3_30B_A3B: MoeShape = MoeShape {
    hidden: 2048,
    experts: 128,
    inter: 768,
    top_k: 8,
};

/// bf16 patterns of magnitude about 2⁻⁷, sign and mantissa varied by a hash of the index.
fn random_bf16(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .flat_map(|i| {
            let r = (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9)
                >> 40;
            (0x3c00u16 | (r as u16 & 0x80ff)).to_le_bytes()
        })
        .collect()
}

/// The layer's tensors written under `dir`.
fn write_layer(dir: &std::path::Path, s: MoeShape) -> Checkpoint {
    let tensor = |name: String, shape: Vec<usize>, seed: u64| {
        let len = shape.iter().product();
        TensorSpec {
            name,
            dtype: DType::BF16,
            shape,
            fill: Box::new(move || random_bf16(len, seed)),
        }
    };
    let norm = TensorSpec {
        name: "norm".into(),
        dtype: DType::BF16,
        shape: vec![s.hidden],
        fill: Box::new(move || {
            (0..s.hidden)
                .flat_map(|_| 0x3f80u16.to_le_bytes())
                .collect()
        }),
    };
    let mut tensors = vec![norm, tensor("router".into(), vec![s.experts, s.hidden], 1)];
    for e in 0..s.experts {
        for (i, (m, shape)) in [
            ("gate", vec![s.inter, s.hidden]),
            ("up", vec![s.inter, s.hidden]),
            ("down", vec![s.hidden, s.inter]),
        ]
        .into_iter()
        .enumerate()
        {
            tensors.push(tensor(format!("e{e}.{m}"), shape, (2 + 3 * e + i) as u64));
        }
    }
    write_checkpoint(dir, &tensors, usize::MAX, &|_| {}).expect("write the layer");
    Checkpoint::open(dir).expect("open the layer")
}

/// The layer at `sizes.moe_layer`'s shape, device against host routing per batch.
pub(crate) fn bench_moe_layer(bandwidth: f64, flops: f64, sizes: &Sizes) -> Value {
    let s = sizes.moe_layer;
    let dir = tempfile::tempdir().expect("tempdir");
    let ckpt = write_layer(dir.path(), s);
    let backend = CudaBackend::open(0, 0.9).expect("cuda:0");
    let view = |name: &str, shape: &[usize]| ckpt.tensor(name, shape).expect("tensor");
    let norm = backend
        .load_weight("norm", view("norm", &[s.hidden]))
        .expect("norm");
    let router = backend
        .load_weight("router", view("router", &[s.experts, s.hidden]))
        .expect("router");
    let names: Vec<[String; 3]> = (0..s.experts)
        .map(|e| ["gate", "up", "down"].map(|m| format!("e{e}.{m}")))
        .collect();
    let views = names
        .iter()
        .map(|[g, u, d]| {
            [
                (g.as_str(), view(g, &[s.inter, s.hidden])),
                (u.as_str(), view(u, &[s.inter, s.hidden])),
                (d.as_str(), view(d, &[s.hidden, s.inter])),
            ]
        })
        .collect();
    let experts = backend.load_experts(views).expect("experts");
    let moe = NormMoe {
        hidden: s.hidden,
        norm: &norm,
        eps: 1e-6,
        router: &router,
        experts: &experts,
        top_k: s.top_k,
        norm_topk_prob: true,
    };
    let matrix_bytes = (s.hidden * s.inter * 2) as f64;
    let mut batches = Vec::new();
    let [short, long] = sizes.moe_prefill;
    for batch in [1, 8, 64, short, long] {
        let host: Vec<f32> = (0..batch * s.hidden)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let mut x = CudaTensor::new(
            batch,
            s.hidden,
            backend.device().stream.clone_htod(&host).expect("upload"),
        );
        // The experts this batch chose (the residual grows a little over the timed calls;
        // the routing is read once, from the first input).
        let logits: HostMatrix = {
            let n = backend.rms_norm(&x, &norm, s.hidden, 1e-6);
            backend.to_host(&backend.linear(&n, &router))
        };
        let chosen = route(&logits, s.top_k, true)
            .iter()
            .filter(|r| !r.rows.is_empty())
            .count();
        let bytes = (s.experts * s.hidden * 2) as f64 + 3.0 * chosen as f64 * matrix_bytes;
        let work = 2.0 * (batch * s.top_k) as f64 * 3.0 * (s.hidden * s.inter) as f64;
        let mut measure = |on_device: bool| {
            backend.set_moe_on_device(on_device);
            let before = backend.kernel_launches();
            backend.norm_moe_add(&mut x, &moe);
            let launches = backend.kernel_launches() - before;
            let ms = timed_ms(&backend, sizes.reps, || backend.norm_moe_add(&mut x, &moe));
            (ms, launches)
        };
        let (device_ms, device_launches) = measure(true);
        let (host_ms, host_launches) = measure(false);
        backend.set_moe_on_device(true);
        batches.push(json!({
            "batch": batch,
            "experts_read": chosen,
            "weight_bytes": bytes,
            "device_ms": device_ms,
            "device_launches": device_launches,
            "device_bandwidth_fraction": bytes / (device_ms / 1e3) / bandwidth,
            "host_ms": host_ms,
            "host_launches": host_launches,
            "host_bandwidth_fraction": bytes / (host_ms / 1e3) / bandwidth,
            "expert_flops": work,
            "device_gemm_fraction": work / (device_ms / 1e3) / flops,
            "host_gemm_fraction": work / (host_ms / 1e3) / flops,
        }));
    }
    json!({
        "hidden": s.hidden,
        "experts": s.experts,
        "expert_width": s.inter,
        "top_k": s.top_k,
        "batches": batches,
    })
}
