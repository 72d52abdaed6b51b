//! Qwen3-MoE's sparse layer routed on the device (`moe.cu`) against the CPU backend's
//! host-routed one, on a layer written as a real safetensors checkpoint and loaded by both
//! (`load_experts`): bf16, f16 and f32 experts, with and without renormalised weights, decode
//! and short-prefill batch sizes (one expert serving more rows than one pass takes) and the
//! grouped path of larger batches, the host-routed path on the GPU, ties in the router, and
//! decode graphs of a MoE model against eager decode.

use pd_engine::backend::Backend;
use pd_engine::backend::cpu::{CpuBackend, CpuTensor};
use pd_engine::backend::moe::{Expert, NormMoe};
use pd_engine::weights::writer::{TensorSpec, write_checkpoint};
use pd_engine::weights::{Checkpoint, DType};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::CudaTensor;

use super::{BLOCK, executor, files, graphs_match_eager, narrow, unit};

const HIDDEN: usize = 256;
const INTER: usize = 64;
const EXPERTS: usize = 16;
const TOP_K: usize = 4;

/// One sparse layer's tensors as a backend holds them.
struct Layer<W> {
    norm: W,
    router: W,
    experts: Vec<Expert<W>>,
}

impl<W> Layer<W> {
    fn moe(&self, norm_topk_prob: bool) -> NormMoe<'_, W> {
        NormMoe {
            hidden: HIDDEN,
            norm: &self.norm,
            eps: 1e-6,
            router: &self.router,
            experts: &self.experts,
            top_k: TOP_K,
            norm_topk_prob,
        }
    }
}

/// A layer of random weights in `dtype` (the router all zeros with `flat_router`: every
/// expert equally likely) written under `dir`, as a checkpoint names them.
fn write_layer(dir: &std::path::Path, dtype: DType, flat_router: bool) -> Checkpoint {
    let random = move |n: usize, seed: u64, scale: f32| {
        let mut state = seed;
        let values: Vec<f32> = (0..n)
            .map(|_| (unit(&mut state) as f32 * 2.0 - 1.0) * scale)
            .collect();
        narrow(dtype, &values)
    };
    let spec = |name: String, shape: Vec<usize>, fill: Box<dyn Fn() -> Vec<u8> + Send + Sync>| {
        TensorSpec {
            name,
            dtype,
            shape,
            fill,
        }
    };
    let mut tensors = vec![
        spec(
            "norm".into(),
            vec![HIDDEN],
            Box::new(move || narrow(dtype, &[1.0; HIDDEN])),
        ),
        spec(
            "router".into(),
            vec![EXPERTS, HIDDEN],
            Box::new(move || random(EXPERTS * HIDDEN, 7, if flat_router { 0.0 } else { 0.5 })),
        ),
    ];
    for e in 0..EXPERTS {
        for (i, (m, shape)) in [
            ("gate", [INTER, HIDDEN]),
            ("up", [INTER, HIDDEN]),
            ("down", [HIDDEN, INTER]),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 100 + (3 * e + i) as u64;
            tensors.push(spec(
                format!("experts.{e}.{m}"),
                shape.to_vec(),
                Box::new(move || random(INTER * HIDDEN, seed, 0.1)),
            ));
        }
    }
    write_checkpoint(dir, &tensors, usize::MAX, &|_| {}).expect("write");
    Checkpoint::open(dir).expect("checkpoint")
}

fn load<B: Backend>(backend: &B, ckpt: &Checkpoint) -> Layer<B::Weight> {
    let one = |name: &str, shape: &[usize]| {
        let view = ckpt.tensor(name, shape).expect("tensor");
        backend.load_weight(name, view).expect("upload")
    };
    let names: Vec<[String; 3]> = (0..EXPERTS)
        .map(|e| ["gate", "up", "down"].map(|m| format!("experts.{e}.{m}")))
        .collect();
    let views = names
        .iter()
        .map(|[g, u, d]| {
            [
                (g.as_str(), ckpt.tensor(g, &[INTER, HIDDEN]).expect("gate")),
                (u.as_str(), ckpt.tensor(u, &[INTER, HIDDEN]).expect("up")),
                (d.as_str(), ckpt.tensor(d, &[HIDDEN, INTER]).expect("down")),
            ]
        })
        .collect();
    Layer {
        norm: one("norm", &[HIDDEN]),
        router: one("router", &[EXPERTS, HIDDEN]),
        experts: backend.load_experts(views).expect("experts"),
    }
}

/// Worst per-row relative error ‖gpu − cpu‖ / ‖cpu‖ of the layer's output.
fn worst_row_error(cpu: &[f32], gpu: &[f32]) -> f64 {
    assert!(gpu.iter().all(|v| v.is_finite()), "non-finite output");
    cpu.chunks(HIDDEN)
        .zip(gpu.chunks(HIDDEN))
        .map(|(c, g)| {
            let diff: f64 = c.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let norm: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum();
            (diff / norm).sqrt()
        })
        .fold(0.0, f64::max)
}

/// What one layer call over `rows` random rows gave on the GPU: its worst row's relative
/// error against the CPU backend and against the GPU's own host-routed path (the same
/// 16-bit inputs to the router, so the same routing), and its kernel launches.
struct Outcome {
    cpu_error: f64,
    host_error: f64,
    launches: u64,
}

fn run(
    cpu: (&CpuBackend, &Layer<<CpuBackend as Backend>::Weight>),
    gpu: (&CudaBackend, &Layer<pd_kernels::cuda::CudaWeight>),
    rows: usize,
    norm_topk_prob: bool,
) -> Outcome {
    let mut state = rows as u64 * 31 + 5;
    let x: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| unit(&mut state) as f32 * 2.0 - 1.0)
        .collect();
    let mut c = CpuTensor::from_vec(rows, HIDDEN, x.clone());
    cpu.0.norm_moe_add(&mut c, &cpu.1.moe(norm_topk_prob));
    let c = cpu.0.to_host(&c).data;
    let (g_backend, g_layer) = gpu;
    let on_gpu = |on_device: bool| {
        g_backend.set_moe_on_device(on_device);
        let mut g = CudaTensor::new(
            rows,
            HIDDEN,
            g_backend.device().stream.clone_htod(&x).expect("upload"),
        );
        let before = g_backend.kernel_launches();
        g_backend.norm_moe_add(&mut g, &g_layer.moe(norm_topk_prob));
        let launches = g_backend.kernel_launches() - before;
        g_backend.set_moe_on_device(true);
        (g_backend.to_host(&g).data, launches)
    };
    let (host, host_launches) = on_gpu(false);
    let (device, launches) = on_gpu(true);
    assert!(
        host_launches > 2 * TOP_K as u64,
        "the host path runs expert by expert ({host_launches} launches)"
    );
    Outcome {
        cpu_error: worst_row_error(&c, &device),
        host_error: worst_row_error(&host, &device),
        launches,
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn device_routing_matches_the_cpu() {
    let gpu = CudaBackend::open(0, 0.3).expect("cuda:0");
    let cpu = CpuBackend::new();
    // (dtype, tolerance against the CPU, against the GPU's host path)
    for (dtype, tolerance, same_routing) in [
        (DType::BF16, 1e-2, 1e-4),
        (DType::F16, 2e-3, 1e-4),
        (DType::F32, 1e-5, 1e-6),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let ckpt = write_layer(dir.path(), dtype, false);
        let (c_layer, g_layer) = (load(&cpu, &ckpt), load(&gpu, &ckpt));
        // 37 rows send ~9 pairs to each expert: more than one pass of the kernels (8); past
        // 128 rows the grouped path.
        for rows in [1, 3, 8, 37, 128, 129, 300] {
            for renorm in [true, false] {
                let o = run((&cpu, &c_layer), (&gpu, &g_layer), rows, renorm);
                let what = format!("{dtype:?}, {rows} rows, renormalised {renorm}");
                eprintln!(
                    "{what}: {:.3e} against the CPU, {:.3e} against the host path, {} launches",
                    o.cpu_error, o.host_error, o.launches
                );
                assert!(o.host_error <= same_routing, "{what}: {:.3e}", o.host_error);
                // The CPU routes the unrounded rows: over 300 random rows of a 16-bit model
                // some row's k-th and (k+1)-th experts are close enough for the rounding to
                // swap them (the GPU's host path swaps them too), so there only the GPU's own
                // host path is the reference.
                if dtype == DType::F32 || rows <= 129 {
                    assert!(o.cpu_error <= tolerance, "{what}: {:.3e}", o.cpu_error);
                }
                // Up to 128 rows: the norm, moe_route, moe_gate_up, moe_down; more: the norm,
                // moe_topk, moe_align, moe_gather, moe_silu, moe_combine (the GEMMs are
                // cuBLAS's, uncounted).
                let expected = if rows <= 128 { 4 } else { 6 };
                assert_eq!(o.launches, expected, "{what}: routed on the device");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn router_ties_go_to_the_lower_expert_on_the_device() {
    // A router of zeros: every expert has probability 1/16; the host takes experts 0..4.
    let gpu = CudaBackend::open(0, 0.3).expect("cuda:0");
    let cpu = CpuBackend::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let ckpt = write_layer(dir.path(), DType::F32, true);
    let (c_layer, g_layer) = (load(&cpu, &ckpt), load(&gpu, &ckpt));
    for rows in [1, 40, 200] {
        for renorm in [true, false] {
            let o = run((&cpu, &c_layer), (&gpu, &g_layer), rows, renorm);
            let what = format!("{rows} rows, renormalised {renorm}");
            assert_eq!(o.launches, if rows <= 128 { 4 } else { 6 }, "{what}");
            assert!(o.cpu_error <= 1e-5, "{what}: {:.3e}", o.cpu_error);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn moe_decode_graphs_match_eager_decode() {
    // Every sparse layer routed inside the graph: captured, not an eager fallback.
    graphs_match_eager("synthetic:tiny-moe", [9, 14, 19], 4);
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn moe_decode_graphs_turn_off_when_routed_on_the_host() {
    use pd_engine::backend::graph::DecodeGraphs;
    use pd_engine::executor::ExecItem;

    // PD_CUDA_MOE=host: no capture is tried (it could not record the host's routing): the
    // steps run eagerly, with eager decode's launches and logits.
    let files = files("synthetic:tiny-moe");
    let open = || CudaBackend::open(0, 0.4).expect("cuda:0");
    let (mut eager, mut host) = (executor(open(), &files, 3), executor(open(), &files, 3));
    eager.backend().set_moe_on_device(false);
    host.backend().set_moe_on_device(false);
    host.set_decode_graphs(Some(DecodeGraphs::new(8, 2 * BLOCK, BLOCK)));
    let table = [0u32, 1];
    let mut tokens: Vec<u32> = (0..9).map(|i| i * 97 + 5).collect();
    let mut start = 0;
    for step in 0..3 {
        let item = [ExecItem {
            tokens: &tokens[start..],
            start,
            block_table: &table,
            all_logits: false,
        }];
        let (e, h) = (
            eager.execute(&item).remove(0),
            host.execute(&item).remove(0),
        );
        super::compare(&format!("step {step}"), &e, &h);
        start = tokens.len();
        tokens.push(pd_engine::backend::conformance::argmax(e.row(0)).0 as u32);
    }
    assert_eq!(
        host.backend().decode_graphs_captured(),
        0,
        "no graph captured"
    );
    assert_eq!(
        host.backend().kernel_launches(),
        eager.backend().kernel_launches(),
        "no capture was tried (a capture records launches before it fails)"
    );
}
