//! Summary statistics of latency samples: mean, median, p90, p99 (linear interpolation
//! between order statistics, as numpy's default and so vLLM's benchmark compute them), min,
//! max and standard deviation.

use serde::{Deserialize, Serialize};

/// A distribution in milliseconds; every field is 0 with no sample (`count` says so).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
    pub std: f64,
}

/// The q-th percentile (0..=100) of sorted samples.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = q / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

impl Distribution {
    pub fn of(samples: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = samples.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        Self {
            count: v.len(),
            mean,
            median: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            min: v[0],
            max: v[v.len() - 1],
            std: var.sqrt(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let d = Distribution::of([4.0, 1.0, 3.0, 2.0]);
        assert_eq!(d.count, 4);
        assert_eq!(d.mean, 2.5);
        assert_eq!(d.median, 2.5);
        // numpy.percentile([1,2,3,4], 90) == 3.7
        assert!((d.p90 - 3.7).abs() < 1e-12);
        assert!((d.p99 - 3.97).abs() < 1e-12);
        assert_eq!((d.min, d.max), (1.0, 4.0));
        assert_eq!(Distribution::of([]), Distribution::default());
        assert_eq!(Distribution::of([5.0]).p99, 5.0);
    }
}
