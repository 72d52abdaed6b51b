//! The `gemv16` kernel (`PD_CUDA_GEMV=kernel`) against a host reference and against cuBLAS,
//! for every decode batch size it takes (1-8 rows), both 16-bit types, widths that leave a
//! partial last round of loads, and the residual-accumulating form.

use pd_engine::backend::Backend;
use pd_engine::weights::DType;
use pd_kernels::CudaBackend;
use pd_kernels::cuda::{CudaTensor, CudaWeight, SmallBatchLinear};

use super::{enabled, narrow, unit, upload_matrix, widen};

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
fn small_batch_kernel_matches_the_host_and_cublas() {
    if !enabled("small_batch_kernel_matches_the_host_and_cublas") {
        return;
    }
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
