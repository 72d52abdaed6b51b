//! How two runs of the model are held to agree: one backend against the CPU reference (the
//! CUDA conformance suite), or one KV cache type against f32. Per logits row: the relative
//! error ‖got − want‖ / ‖want‖ within the caller's tolerance, and the same greedy token
//! wherever `want`'s top-2 margin is clear, that is above [`CLEAR_MARGIN`] × tolerance × the
//! row's RMS. That bound does not depend on the error found: a margin compared with the
//! largest observed difference instead could never flip, and would test nothing. Used by
//! tests.

use super::HostMatrix;

/// A top-2 margin is clear above this many times the tolerance times the row's RMS: an
/// error within tolerance spread over the row moves the two top logits by far less, so a
/// flip there means error piled onto the tokens that decide the output.
pub const CLEAR_MARGIN: f64 = 4.0;

/// The index of the largest value of `row` and its margin over the second largest.
pub fn argmax(row: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0, best.1 - second)
}

/// The worst relative error of `got`'s rows against `want`'s, each within `tolerance`.
///
/// # Panics
/// On a shape mismatch, a non-finite value in `got`, a row beyond `tolerance`, or a greedy
/// token that differs where `want`'s margin is clear; `what` names the comparison.
pub fn compare_logits(what: &str, want: &HostMatrix, got: &HostMatrix, tolerance: f64) -> f64 {
    assert_eq!(
        (want.rows, want.cols),
        (got.rows, got.cols),
        "{what}: shape"
    );
    let mut worst: f64 = 0.0;
    for r in 0..want.rows {
        let (w, g) = (want.row(r), got.row(r));
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{what} row {r}: non-finite logits"
        );
        let diff: f64 = w.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let norm: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (diff / norm.max(1e-30)).sqrt();
        assert!(
            rel <= tolerance,
            "{what} row {r}: relative error {rel:.3e} > {tolerance}"
        );
        let rms = (norm / w.len().max(1) as f64).sqrt();
        let (wi, margin) = argmax(w);
        if f64::from(margin) > CLEAR_MARGIN * tolerance * rms {
            assert_eq!(
                argmax(g).0,
                wi,
                "{what} row {r}: greedy token differs (margin {margin}, row RMS {rms:.3})"
            );
        }
        worst = worst.max(rel);
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rows: &[&[f32]]) -> HostMatrix {
        HostMatrix::from_rows(rows)
    }

    #[test]
    fn errors_are_relative_to_the_row_and_clear_greedy_flips_fail() {
        assert_eq!(argmax(&[1.0, 3.0, 2.5]), (1, 0.5));
        // A row of 100 logits: RMS 1 once scaled, top-2 margin 0.49 (clear above 4 × 0.1 × 1 = 0.4).
        let mut w = vec![0.0f32; 100];
        w[0] = 9.0;
        w[1] = 8.4;
        let scale = (w.iter().map(|x| x * x).sum::<f32>() / 100.0).sqrt();
        w.iter_mut().for_each(|x| *x /= scale);
        let want = m(&[&w]);
        // The two top logits moved 0.35 toward each other: within 10 % of the row's norm...
        let mut g = w.clone();
        g[0] -= 0.35 / scale;
        g[1] += 0.35 / scale;
        let err = compare_logits("spread", &want, &m(&[&w]), 0.1);
        assert_eq!(err, 0.0);
        // ...but a clear margin flipped: that fails however small the error.
        let flipped = std::panic::catch_unwind(|| compare_logits("flip", &want, &m(&[&g]), 0.1));
        assert!(flipped.is_err(), "a clear greedy flip must fail");
        // Beyond the tolerance, or not finite: fails.
        assert!(
            std::panic::catch_unwind(|| compare_logits("tol", &want, &m(&[&g]), 0.01)).is_err()
        );
        let mut nan = w.clone();
        nan[5] = f32::NAN;
        assert!(
            std::panic::catch_unwind(|| compare_logits("nan", &want, &m(&[&nan]), 0.1)).is_err()
        );
    }
}
