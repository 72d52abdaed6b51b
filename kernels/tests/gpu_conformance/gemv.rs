//! The `gemv16` kernels (`PD_CUDA_GEMV=kernel`): the plain product against a host reference
//! and against cuBLAS, for every decode batch size it takes (1-8 rows), both 16-bit types,
//! widths that leave a partial last round of loads, and the residual-accumulating form; the
//! norm-fused forms against the separate ops, and all of them launched programmatically
//! dependent (`PD_CUDA_PDL=on`) against the ordinary launch.

use pd_engine::backend::{Backend, NormMlp};
use pd_engine::weights::{Checkpoint, DType};
use pd_kernels::CudaBackend;
use pd_kernels::cuda::{CudaTensor, CudaWeight, SmallBatchLinear};

use super::stacked::{Layer0Projections, assert_same, layer0_projections};
use super::{narrow, unit, upload_matrix, widen};

/// A random `[n, k]` matrix in `dtype`, uploaded from a real safetensors file; also its
/// stored values, widened.
fn matrix(
    gpu: &CudaBackend,
    dtype: DType,
    (n, k): (usize, usize),
    seed: u64,
    dir: &std::path::Path,
) -> (CudaWeight, Vec<f32>) {
    let mut state = seed;
    let values: Vec<f32> = (0..n * k).map(|_| unit(&mut state) as f32).collect();
    let data = narrow(dtype, &values);
    (
        upload_matrix(gpu, dtype, (n, k), &data, dir),
        widen(dtype, &data),
    )
}

fn upload(gpu: &CudaBackend, rows: usize, cols: usize, host: &[f32]) -> CudaTensor {
    CudaTensor::new(
        rows,
        cols,
        gpu.device().stream.clone_htod(host).expect("upload"),
    )
}

/// Largest |a - b| over the largest |b|.
fn relative(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn small_batch_kernel_matches_the_host_and_cublas() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cublas = CudaBackend::open(0, 0.3).expect("cuda:0");
    let kernel = CudaBackend::open(0, 0.3).expect("cuda:0");
    kernel.set_small_batch_linear(SmallBatchLinear::Kernel);
    // (rows, n, k): k = 72 is 9 loads per column (one partial round of the warp's two),
    // k = 1032 a partial round after whole ones; n not a multiple of the block's 8 columns;
    // 9 rows is past the kernel (both use cuBLAS).
    let shapes = [
        (1, 13, 72),
        (2, 40, 1032),
        (5, 9, 512),
        (8, 64, 136),
        (9, 20, 64),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (i, &(rows, n, k)) in shapes.iter().enumerate() {
            let what = format!("{dtype:?} [{rows}x{k}]·[{n}x{k}]ᵀ");
            let seed = 1 + i as u64;
            let (w_cublas, w_host) = matrix(&cublas, dtype, (n, k), seed, dir.path());
            let (w_kernel, _) = matrix(&kernel, dtype, (n, k), seed, dir.path());
            let mut state = 100 + seed;
            let x: Vec<f32> = (0..rows * k).map(|_| unit(&mut state) as f32).collect();

            // Plain product, against the host in f64 over the same 16-bit inputs.
            let got = kernel.to_host(&kernel.linear(&upload(&kernel, rows, k, &x), &w_kernel));
            let by_cublas =
                cublas.to_host(&cublas.linear(&upload(&cublas, rows, k, &x), &w_cublas));
            let x16 = widen(dtype, &narrow(dtype, &x));
            let want: Vec<f32> = (0..rows * n)
                .map(|o| {
                    let (r, j) = (o / n, o % n);
                    (0..k)
                        .map(|c| x16[r * k + c] as f64 * w_host[j * k + c] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            let err = relative(&got.data, &want);
            assert!(err <= 1e-5, "{what}: off the host reference by {err:.2e}");
            let err = relative(&got.data, &by_cublas.data);
            assert!(err <= 1e-5, "{what}: off cuBLAS by {err:.2e}");

            // The residual-accumulating form (the down projection's), against cuBLAS's.
            let gate: Vec<f32> = (0..rows * k).map(|_| unit(&mut state) as f32).collect();
            let up: Vec<f32> = (0..rows * k).map(|_| unit(&mut state) as f32).collect();
            let residual: Vec<f32> = (0..rows * n).map(|_| unit(&mut state) as f32).collect();
            let down = |gpu: &CudaBackend, w: &CudaWeight| {
                let mut out = upload(gpu, rows, n, &residual);
                gpu.silu_mul_linear_add(
                    &mut out,
                    &upload(gpu, rows, k, &gate),
                    &upload(gpu, rows, k, &up),
                    w,
                );
                gpu.to_host(&out).data
            };
            let (a, b) = (down(&kernel, &w_kernel), down(&cublas, &w_cublas));
            let err = relative(&a, &b);
            assert!(err <= 1e-5, "{what} accumulated: off cuBLAS by {err:.2e}");
            assert!(
                relative(&a, &residual) > 1e-3,
                "{what} accumulated: the product was added"
            );
        }
    }
}

/// The decode-batch kernels with the layer norm (and, for gate / up, the SiLU) inside them
/// give bit for bit what the separate ops give with the same `gemv16` products: the norm
/// before q/k/v (one launch instead of four), the MLP block (two instead of four) and the
/// final norm before the logits (one instead of three), at 1, 5 and 8 rows, on the
/// qwen3-0.6b shape's own weights. The separate ops run when the projections are uploaded
/// one by one, which the fused kernels do not take. Launched with programmatic dependence
/// (`PD_CUDA_PDL=on`), the fused kernels give the same bits again.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn norm_fused_kernels_equal_the_separate_ops() {
    let files = super::files("synthetic:qwen3-0.6b");
    let c = &files.config;
    let ckpt = Checkpoint::open(&files.dir).expect("checkpoint");
    let gpu = CudaBackend::open(0, 0.5).expect("cuda:0");
    gpu.set_small_batch_linear(SmallBatchLinear::Kernel);
    let h = c.hidden_size;
    let load = |name: &str, shape: &[usize]| {
        gpu.load_weight(name, ckpt.tensor(name, shape).expect("tensor"))
            .expect("upload")
    };
    let Layer0Projections {
        stacked_qkv,
        single_qkv,
        stacked_mlp,
        single_mlp,
    } = layer0_projections(&gpu, &ckpt, c);
    let input_norm = load("model.layers.0.input_layernorm.weight", &[h]);
    let post_norm = load("model.layers.0.post_attention_layernorm.weight", &[h]);
    let down = load(
        "model.layers.0.mlp.down_proj.weight",
        &[h, c.intermediate_size],
    );
    let final_norm = load("model.norm.weight", &[h]);
    let lm_head = load("model.embed_tokens.weight", &[c.vocab_size, h]);
    let eps = c.rms_norm_eps;
    let (mlp_stacked, mlp_single) = [&stacked_mlp, &single_mlp]
        .map(|[gate, up]| NormMlp {
            hidden: h,
            norm: &post_norm,
            eps,
            gate,
            up,
            down: &down,
        })
        .into();

    for rows in [1, 5, 8] {
        let mut state = 7 + rows as u64;
        // Residual-stream-like rows: an RMS far from 1, so the norm matters.
        let host: Vec<f32> = (0..rows * h)
            .map(|_| 40.0 * unit(&mut state) as f32)
            .collect();
        let x = || upload(&gpu, rows, h, &host);
        let launches = |f: &mut dyn FnMut()| {
            let before = gpu.kernel_launches();
            f();
            gpu.kernel_launches() - before
        };

        let (x_fused, x_apart) = (x(), x());
        let (mut fused, mut apart) = (None, None);
        let n = launches(&mut || {
            fused =
                Some(gpu.norm_linear_shared(&x_fused, &input_norm, h, eps, stacked_qkv.each_ref()))
        });
        assert_eq!(n, 1, "{rows} rows: q/k/v with their norm in one launch");
        let m = launches(&mut || {
            apart =
                Some(gpu.norm_linear_shared(&x_apart, &input_norm, h, eps, single_qkv.each_ref()))
        });
        assert_eq!(m, 4, "{rows} rows: the norm, then one product each");
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            let (a, b) = (&fused.as_ref().unwrap()[i], &apart.as_ref().unwrap()[i]);
            assert_same(&format!("{rows} rows: {what}"), &gpu, a, b);
        }

        let (mut a, mut b) = (x(), x());
        let n = launches(&mut || gpu.norm_mlp_add(&mut a, &mlp_stacked));
        assert_eq!(n, 2, "{rows} rows: the MLP block in two launches");
        let m = launches(&mut || gpu.norm_mlp_add(&mut b, &mlp_single));
        assert_eq!(m, 5, "{rows} rows: norm, gate, up, SiLU, down");
        assert_same(&format!("{rows} rows: residual + MLP"), &gpu, &a, &b);
        let added = gpu.to_host(&a).data;
        assert!(
            relative(&added, &host) > 1e-3,
            "{rows} rows: the MLP's product was added to the residual"
        );

        // The same kernels launched programmatically dependent on the one before them
        // (`PD_CUDA_PDL=on`; compute capability 9.0 and later): the same bits.
        gpu.set_programmatic_launch(true);
        let before = gpu.programmatic_launches();
        let mut c = x();
        gpu.norm_mlp_add(&mut c, &mlp_stacked);
        let qkv = gpu.norm_linear_shared(&x(), &input_norm, h, eps, stacked_qkv.each_ref());
        gpu.set_programmatic_launch(false);
        let dependent = if gpu.device().cc.major >= 9 { 3 } else { 0 };
        assert_eq!(
            gpu.programmatic_launches() - before,
            dependent,
            "{rows} rows: launches with the programmatic-dependence attribute"
        );
        assert_same(&format!("{rows} rows: residual + MLP, PDL"), &gpu, &c, &a);
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            let fused = &fused.as_ref().unwrap()[i];
            assert_same(&format!("{rows} rows: {what}, PDL"), &gpu, &qkv[i], fused);
        }

        let (mut fused, mut apart) = (None, None);
        let n = launches(&mut || {
            fused = Some(gpu.norm_linear_shared(&x(), &final_norm, h, eps, [&lm_head]))
        });
        assert_eq!(
            n, 1,
            "{rows} rows: the final norm and the logits in one launch"
        );
        let m = launches(&mut || {
            apart = Some(gpu.linear(&gpu.rms_norm(&x(), &final_norm, h, eps), &lm_head))
        });
        assert_eq!(m, 3, "{rows} rows: norm, cast, product");
        let [fused] = fused.unwrap();
        assert_same(
            &format!("{rows} rows: logits"),
            &gpu,
            &fused,
            &apart.unwrap(),
        );
    }
}

/// Rows too wide for the 48 KiB of shared memory a launch gets by default (qwen3-8b's 4,096
/// at batch 7 and 8: 56 and 64 KiB normalised): the norm-fused kernels opted in to more, so
/// the norm and the product are still one launch, with the separate ops' bits.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn wide_rows_are_norm_fused_in_opted_in_shared_memory() {
    use pd_engine::weights::writer::{TensorSpec, write_checkpoint};
    let (k, n) = (4096, 128);
    let dir = tempfile::tempdir().expect("temp dir");
    let random = |len: usize, seed: u64, scale: f32| {
        let mut state = seed;
        let values: Vec<f32> = (0..len).map(|_| scale * unit(&mut state) as f32).collect();
        narrow(DType::BF16, &values)
    };
    let spec = |name: &str, shape: Vec<usize>, seed: u64| TensorSpec {
        name: name.into(),
        dtype: DType::BF16,
        shape: shape.clone(),
        fill: Box::new(move || random(shape.iter().product(), seed, 1.0)),
    };
    let tensors = [spec("norm", vec![k], 3), spec("w", vec![n, k], 4)];
    write_checkpoint(dir.path(), &tensors, usize::MAX, &|_| {}).expect("checkpoint");
    let ckpt = Checkpoint::open(dir.path()).expect("checkpoint");
    let gpu = CudaBackend::open(0, 0.3).expect("cuda:0");
    gpu.set_small_batch_linear(SmallBatchLinear::Kernel);
    let load = |name: &str, shape: &[usize]| {
        gpu.load_weight(name, ckpt.tensor(name, shape).expect("tensor"))
            .expect("upload")
    };
    let (norm, w) = (load("norm", &[k]), load("w", &[n, k]));
    for rows in [7, 8] {
        let mut state = 11 + rows as u64;
        let host: Vec<f32> = (0..rows * k)
            .map(|_| 40.0 * unit(&mut state) as f32)
            .collect();
        let x = || upload(&gpu, rows, k, &host);
        let before = gpu.kernel_launches();
        let [fused] = gpu.norm_linear_shared(&x(), &norm, k, 1e-6, [&w]);
        assert_eq!(
            gpu.kernel_launches() - before,
            1,
            "{rows} rows of {k}: the norm and the product in one launch"
        );
        let before = gpu.kernel_launches();
        let apart = gpu.linear(&gpu.rms_norm(&x(), &norm, k, 1e-6), &w);
        assert_eq!(gpu.kernel_launches() - before, 3, "norm, cast, product");
        assert_same(&format!("{rows} rows of {k}"), &gpu, &fused, &apart);
    }
}
