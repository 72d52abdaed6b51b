//! The products of linear.rs against a naive f64 reference, on every instruction set this
//! CPU has, both paths (streaming and GEMM), odd shapes and unaligned weights.

use super::super::convert::tests::{Rng, random_weights};
use super::*;

/// Naive f64 reference on the exact (already rounded) weight values.
fn reference(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; rows * n];
    let mut mag = vec![0.0; rows * n];
    for r in 0..rows {
        for o in 0..n {
            let (mut s, mut m) = (0.0f64, 0.0f64);
            for i in 0..k {
                let p = x[r * k + i] as f64 * w[o * k + i] as f64;
                s += p;
                m += p.abs();
            }
            out[r * n + o] = s;
            mag[r * n + o] = m;
        }
    }
    (out, mag)
}

/// Which kernel a check runs.
#[derive(Debug, Clone, Copy)]
enum Path {
    /// `linear_with`'s own choice by batch size.
    Auto,
    /// The streaming kernel, whatever the batch size.
    Streaming,
    /// The tiled gemm, whatever the batch size.
    Gemm,
}

/// Runs one path on `isa` with the weight bytes at `offset` from an allocation's start,
/// and checks every output against the f64 reference (relative to Σ|x·w|).
#[allow(clippy::too_many_arguments)]
fn check(
    isa: Isa,
    path: Path,
    dtype: DType,
    rows: usize,
    n: usize,
    k: usize,
    offset: usize,
    rng: &mut Rng,
) {
    let (bytes, vals) = random_weights(dtype, n * k, rng);
    let mut buf = vec![0u8; offset];
    buf.extend_from_slice(&bytes);
    let w = WeightMatrix::new(dtype, n, k, &buf[offset..]);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.unit()).collect();
    let mut out = vec![f32::NAN; rows * n];
    match path {
        Path::Auto => linear_with(isa, &x, rows, w, &mut out),
        Path::Streaming => small_batch(isa, &x, rows, w, &mut out),
        Path::Gemm => large_batch(isa, &x, rows, w, &mut out),
    }
    let (want, mag) = reference(&x, rows, &vals, n, k);
    for i in 0..rows * n {
        let err = (out[i] as f64 - want[i]).abs();
        assert!(
            err <= 1e-5 * mag[i] + 1e-30,
            "{isa:?} {path:?} {dtype} rows={rows} n={n} k={k} off={offset} [{}][{}]: {} vs {} (Σ|x·w| {})",
            i / n,
            i % n,
            out[i],
            want[i],
            mag[i]
        );
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
/// Weight shapes `[n, k]`: odd and tiny column counts, partial blocks and vectors.
const SHAPES: [(usize, usize); 10] = [
    (1, 1),
    (3, 2),
    (5, 3),
    (6, 4),
    (7, 5),
    (9, 17),
    (13, 100),
    (8, 1023),
    (33, 64),
    (4, 16),
];

#[test]
fn streaming_path_matches_reference_on_every_isa() {
    let mut rng = Rng::new(1);
    for isa in Isa::all_available() {
        for dtype in DTYPES {
            for rows in [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, SMALL_BATCH_MAX_ROWS] {
                for (n, k) in SHAPES {
                    check(isa, Path::Auto, dtype, rows, n, k, 0, &mut rng);
                }
            }
        }
    }
}

#[test]
fn gemm_path_matches_reference_on_every_isa() {
    let mut rng = Rng::new(2);
    for isa in Isa::all_available() {
        for dtype in DTYPES {
            for rows in [SMALL_BATCH_MAX_ROWS + 1, 64, 300] {
                for (n, k) in [(1, 1), (5, 3), (7, 5), (37, 17), (70, 100), (19, 1023)] {
                    check(isa, Path::Auto, dtype, rows, n, k, 0, &mut rng);
                }
            }
            // Small batches through the gemm path too (it must not rely on big ones).
            for rows in [1, 2, 3, 7, 16, 17, 33] {
                for (n, k) in [(1, 1), (7, 5), (37, 17), (19, 1023)] {
                    check(isa, Path::Gemm, dtype, rows, n, k, 0, &mut rng);
                }
            }
        }
    }
}

#[test]
fn streaming_path_handles_big_batches_too() {
    let mut rng = Rng::new(7);
    for isa in Isa::all_available() {
        for dtype in DTYPES {
            check(isa, Path::Streaming, dtype, 300, 13, 100, 0, &mut rng);
        }
    }
}

#[test]
fn unaligned_weights_work_on_both_paths() {
    let mut rng = Rng::new(3);
    for isa in Isa::all_available() {
        for dtype in DTYPES {
            for offset in [1, 2, 3] {
                for rows in [1, 3, 16, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS + 1, 80] {
                    check(isa, Path::Auto, dtype, rows, 11, 37, offset, &mut rng);
                    check(isa, Path::Auto, dtype, rows, 9, 64, offset, &mut rng);
                }
            }
        }
    }
}

#[test]
fn many_tiles_and_parallel_tasks() {
    // Enough work for the parallel split, a tile count that is not a multiple of the
    // thread count, and a partial last tile / block.
    let mut rng = Rng::new(4);
    let isa = Isa::detect();
    for dtype in DTYPES {
        check(isa, Path::Auto, dtype, 1, 1027, 300, 0, &mut rng);
        check(isa, Path::Auto, dtype, 16, 263, 1031, 1, &mut rng);
        check(isa, Path::Auto, dtype, 70, 1101, 260, 0, &mut rng);
        check(isa, Path::Auto, dtype, 100, 3, 2000, 2, &mut rng); // few tiles: rows split
    }
}

#[test]
fn avx2_path_is_checked_when_present() {
    // Explicit, even on AVX-512 machines (where `detect` never picks AVX2).
    if !Isa::Avx2.available() {
        eprintln!("AVX2/FMA/F16C not available: their kernels are not exercised on this CPU");
        return;
    }
    let mut rng = Rng::new(5);
    for dtype in DTYPES {
        for rows in [1, 2, 3, 4, 7, 16, 33, 64] {
            check(Isa::Avx2, Path::Auto, dtype, rows, 21, 1023, 1, &mut rng);
        }
    }
}

#[test]
fn avx512_path_is_checked_when_present() {
    if !Isa::Avx512.available() {
        eprintln!("AVX-512F not available: its kernels are not exercised on this CPU");
        return;
    }
    let mut rng = Rng::new(6);
    for dtype in DTYPES {
        for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64] {
            check(Isa::Avx512, Path::Auto, dtype, rows, 21, 1023, 1, &mut rng);
        }
    }
}

#[test]
fn amx_path_is_checked_when_present() {
    if !Isa::Amx.available() {
        eprintln!("AMX not available: its kernels are not exercised on this CPU");
        return;
    }
    let mut rng = Rng::new(7);
    // Tile-aligned shapes: a single weight tile after the pairs (n = 48), several depth
    // blocks with a short last one (k = 1056), odd activation blocks, unaligned weights.
    for (n, k) in [(16, 32), (48, 1056), (64, 512)] {
        for rows in [8, 9, 16, 17, 33, 64] {
            check(Isa::Amx, Path::Auto, DType::BF16, rows, n, k, 1, &mut rng);
        }
    }
    // Shapes and types the tiles do not take run on AVX-512 under the same name.
    for dtype in DTYPES {
        for rows in [1, 7, 8, 33, 64] {
            check(Isa::Amx, Path::Auto, dtype, rows, 21, 1023, 1, &mut rng);
        }
    }
}

#[test]
fn degenerate_shapes() {
    let w = WeightMatrix::new(DType::BF16, 3, 0, &[]);
    let mut out = vec![f32::NAN; 6];
    linear(&[], 2, w, &mut out);
    assert_eq!(out, vec![0.0; 6]);
    let w = WeightMatrix::new(DType::F32, 0, 4, &[]);
    linear(&[0.0; 8], 2, w, &mut []);
    let w = WeightMatrix::new(DType::F16, 2, 4, &[0; 16]);
    linear(&[], 0, w, &mut []);
}

#[test]
#[should_panic(expected = "x is not")]
fn wrong_x_length_panics() {
    let w = WeightMatrix::new(DType::BF16, 2, 4, &[0; 16]);
    linear(&[0.0; 7], 2, w, &mut [0.0; 4]);
}
