//! Sampling where the logits are: the part of [`super::Sampler`] that a backend runs itself
//! (on the GPU for the CUDA backend), so a step copies a token id per sequence to the host
//! instead of a `[sequences, vocab]` matrix of logits.
//!
//! Which requests qualify is decided by [`super::Sampler::device_plan`]: greedy requests and
//! temperature sampling with a top-k in `1..=`[`MAX_DEVICE_TOP_K`] (then top-p over those k),
//! without a repetition penalty, min-p or `logprobs > 0`. Everything else (penalties need the
//! token history, min-p / dense top-p need the whole distribution, logprobs need the top
//! alternatives) keeps the host sampler.
//!
//! Reproducibility: the host peeks the request's next uniform draw from its seeded RNG and
//! passes it in [`DeviceSampling::TopK::uniform`]; the backend reports whether it used it
//! ([`DeviceSample::used_draw`]) and the host then advances the RNG by exactly that draw. So
//! a request's token stream is the same whichever path each step took.
//!
//! [`sample_row`] is the contract: every backend must choose the same token as it, bit for bit
//! (it is built from the host sampler's own functions, so it equals [`super::Sampler::sample`]).
//! The reported log-probability must match it to floating-point accuracy (a GPU sums the
//! softmax denominator in another order).

use super::truncation::{
    SMALL_TOP_K, Weights, argmax, draw_candidates, log_sum_exp, raw_logprob, top_k_sorted,
    top_p_sorted,
};

/// Largest top-k a backend samples itself; the host's small-k path (a sorted candidate list)
/// is what the backend reproduces.
pub const MAX_DEVICE_TOP_K: u32 = SMALL_TOP_K as u32;

/// How a backend chooses one row's token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceSampling {
    /// The largest logit; ties to the lower id, NaN ignored, id 0 if every logit is `-inf`.
    Greedy,
    /// The `k` largest logits (ties to the lower id; NaN and `-inf` never kept), sorted;
    /// weights `exp((l - lmax) * inv_temperature)`; then top-p over them when `top_p < 1`;
    /// then one draw: the first candidate, in order, whose cumulative weight exceeds
    /// `uniform × total`. A row whose largest logit is not finite gets its argmax and does
    /// not use the draw.
    TopK {
        /// `1..=`[`MAX_DEVICE_TOP_K`].
        k: u32,
        /// `1 / temperature`, computed in f32 on the host.
        inv_temperature: f32,
        /// In `(0, 1]`; `1` disables top-p.
        top_p: f32,
        /// The request's next uniform draw in `[0, 1)`.
        uniform: f64,
    },
}

/// One row of a step's logits to sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSampleRow {
    /// Row of the logits matrix.
    pub row: usize,
    pub method: DeviceSampling,
}

/// What a backend chose for one row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSample {
    pub token_id: u32,
    /// The token's log-probability under the raw logits (`log_softmax`, no temperature).
    pub logprob: f32,
    /// Whether the row's uniform draw was used (the host then advances the request's RNG).
    pub used_draw: bool,
}

/// The reference: the token [`DeviceSampling`] chooses from `logits` (one row, already cut to
/// the columns that are real tokens).
///
/// # Panics
/// If `logits` is empty.
pub fn sample_row(logits: &[f32], method: DeviceSampling) -> DeviceSample {
    assert!(!logits.is_empty(), "sample_row: empty logits row");
    let (max_id, lmax) = argmax(logits);
    let (token_id, used_draw) = match method {
        DeviceSampling::Greedy => (max_id, false),
        DeviceSampling::TopK { .. } if !(lmax > f32::NEG_INFINITY && lmax < f32::INFINITY) => {
            (max_id, false)
        }
        DeviceSampling::TopK {
            k,
            inv_temperature,
            top_p,
            uniform,
        } => {
            let w = Weights {
                lmax,
                inv_t: inv_temperature,
                threshold: f32::NEG_INFINITY,
            };
            let mut candidates = Vec::with_capacity(k as usize);
            top_k_sorted(logits, k as usize, f32::NEG_INFINITY, &mut candidates);
            if top_p < 1.0 {
                top_p_sorted(logits, &mut candidates, top_p, w);
            }
            let token = draw_candidates(logits, &candidates, w, uniform).unwrap_or(max_id);
            (token, true)
        }
    };
    DeviceSample {
        token_id,
        logprob: raw_logprob(logits[token_id as usize], log_sum_exp(logits)),
        used_draw,
    }
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::sampling::{Sampler, SamplingParams};

    fn logits(n: usize, seed: u64, quantised: bool) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let x = rng.random::<f32>() * 16.0 - 8.0;
                if quantised {
                    (x * 2.0).round() / 2.0
                } else {
                    x
                }
            })
            .collect()
    }

    /// Runs `steps` steps of one request both ways: the host sampler alone, and the device
    /// plan + [`sample_row`] + accept (falling back to the host where there is no plan). The
    /// tokens and log-probabilities must be identical, step after step (so the RNG streams
    /// stay aligned).
    fn same_stream(params: &SamplingParams, vocab_limit: usize, quantised: bool) -> bool {
        let mut host = Sampler::new(params, 7, &[]);
        let mut dev = Sampler::new(params, 7, &[]);
        let mut planned = false;
        for step in 0..40 {
            let mut row = logits(1200, step, quantised);
            if step % 7 == 3 {
                row[5] = f32::NAN;
                row[9] = f32::NEG_INFINITY;
            }
            // The engine hides columns past the tokenizer's vocabulary this way.
            let mut masked = row.clone();
            masked[vocab_limit..].fill(f32::NEG_INFINITY);
            let expect = host.sample(&masked, &[1, 2], &[3]);
            let got = match dev.device_plan(1) {
                Some(method) => {
                    planned = true;
                    dev.accept(sample_row(&row[..vocab_limit], method))
                }
                None => dev.sample(&masked, &[1, 2], &[3]),
            };
            assert_eq!(got, expect, "step {step} {params:?}");
        }
        planned
    }

    #[test]
    fn device_path_matches_host_sampler() {
        let cases = [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.7,
                top_k: 20,
                top_p: 0.8,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.3,
                top_k: 1,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.05,
                top_k: 64,
                ..Default::default()
            },
            SamplingParams {
                temperature: 2.0,
                top_k: 64,
                top_p: 0.1,
                ..Default::default()
            },
        ];
        for params in &cases {
            for quantised in [false, true] {
                for limit in [1200, 1000] {
                    assert!(same_stream(params, limit, quantised), "{params:?} planned");
                }
            }
        }
    }

    #[test]
    fn host_only_features_get_no_plan() {
        let host_only = [
            SamplingParams {
                repetition_penalty: 1.1,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: -0.25,
                ..Default::default()
            },
            SamplingParams {
                min_tokens: 5,
                stop_token_ids: vec![4],
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(4, 1.0)],
                ..Default::default()
            },
            SamplingParams {
                allowed_token_ids: vec![4, 5],
                ..Default::default()
            },
            SamplingParams {
                bad_words_token_ids: vec![vec![4]],
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 20,
                min_p: 0.1,
                ..Default::default()
            },
            SamplingParams {
                logprobs: Some(3),
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 65,
                ..Default::default()
            },
        ];
        for params in &host_only {
            assert_eq!(
                Sampler::new(params, 1, &[]).device_plan(1),
                None,
                "{params:?}"
            );
            // They still produce the same tokens through the shared driver above.
            assert!(!same_stream(params, 1200, false));
        }
        let zero_logprobs = SamplingParams {
            logprobs: Some(0),
            ..Default::default()
        };
        assert_eq!(
            Sampler::new(&zero_logprobs, 1, &[]).device_plan(1),
            Some(DeviceSampling::Greedy)
        );
    }

    #[test]
    fn min_tokens_keeps_the_host_only_while_it_masks_something() {
        let p = SamplingParams {
            min_tokens: 3,
            ..Default::default()
        };
        // EOS is masked for the first three tokens: the host samples them.
        let s = Sampler::new(&p, 1, &[2]);
        assert_eq!(s.device_plan(2), None);
        assert_eq!(s.device_plan(3), Some(DeviceSampling::Greedy));
        // Nothing to mask (EOS ignored, no stop ids): the device samples from the start.
        let ignored = SamplingParams {
            ignore_eos: true,
            ..p
        };
        assert_eq!(
            Sampler::new(&ignored, 1, &[2]).device_plan(0),
            Some(DeviceSampling::Greedy)
        );
    }

    #[test]
    fn degenerate_rows_do_not_use_the_draw() {
        let method = DeviceSampling::TopK {
            k: 4,
            inv_temperature: 1.0,
            top_p: 1.0,
            uniform: 0.5,
        };
        let s = sample_row(&[f32::NEG_INFINITY; 5], method);
        assert_eq!((s.token_id, s.used_draw), (0, false));
        let s = sample_row(&[1.0, f32::INFINITY, f32::NAN], method);
        assert_eq!((s.token_id, s.used_draw), (1, false));
        let s = sample_row(&[1.0, 3.0, 3.0, f32::NAN], DeviceSampling::Greedy);
        assert_eq!((s.token_id, s.used_draw), (1, false));
    }

    #[test]
    fn negative_zero_ties_with_zero_by_id() {
        // -0.0 == 0.0: ids 0 and 1 tie; k = 1 keeps the lower id whatever the sign.
        let method = DeviceSampling::TopK {
            k: 1,
            inv_temperature: 1.0,
            top_p: 1.0,
            uniform: 0.99,
        };
        assert_eq!(sample_row(&[-0.0, 0.0, -1.0], method).token_id, 0);
        assert_eq!(sample_row(&[-1.0, 0.0, -0.0], method).token_id, 1);
    }
}
