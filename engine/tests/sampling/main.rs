//! Sampling parameters, the sampler and stop conditions (vLLM semantics).
//!
//! One test binary: the tests are grouped by concept in the modules below; the shared
//! helpers (deterministic logits, a reference log-softmax, empirical counts, chi-square)
//! live here.

mod bias_and_allowed;
mod logprobs;
mod min_tokens;
mod penalties;
mod sampler;
mod stop;
mod validation;

use pd_engine::sampling::{Sampler, SamplingParams};

const VOCAB: usize = 1000;

fn params() -> SamplingParams {
    SamplingParams::default()
}

/// Deterministic, well spread logits (no RNG involved).
fn spread_logits(n: usize, salt: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = (i ^ salt)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(17);
            (x % 10_000) as f32 / 500.0 - 10.0
        })
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
    l.iter().map(|&x| x as f64 - m - s.ln()).collect()
}

/// A sampler for one independent draw: a token's draw depends only on the seed and its place
/// in the output, so repeated calls at the same place repeat the draw. Statistical tests draw
/// the first token under `n` different seeds instead.
fn first_draw(p: &SamplingParams, seed: u64) -> Sampler {
    Sampler::new(p, seed, &[])
}

fn counts(p: &SamplingParams, seed: u64, logits: &[f32], n: usize) -> Vec<usize> {
    let mut c = vec![0; logits.len()];
    for i in 0..n {
        c[first_draw(p, seed + i as u64)
            .sample(logits, &[], &[])
            .token_id as usize] += 1;
    }
    c
}

/// Pearson chi-square statistic of observed counts against expected probabilities
/// (categories with zero expected probability must have zero counts).
fn chi_square(obs: &[usize], probs: &[f64]) -> f64 {
    let n: usize = obs.iter().sum();
    obs.iter()
        .zip(probs)
        .map(|(&o, &p)| {
            if p == 0.0 {
                assert_eq!(o, 0, "sampled a token with zero probability");
                0.0
            } else {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            }
        })
        .sum()
}
