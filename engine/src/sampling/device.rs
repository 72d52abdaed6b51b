//! Sampling where the logits are: the part of [`super::Sampler`] that a backend runs itself
//! (on the GPU for the CUDA backend), so a step copies a token id per sequence to the host
//! instead of a `[sequences, vocab]` matrix of logits.
//!
//! Which requests qualify is decided by [`super::Sampler::device_plan`]: all of them —
//! greedy, temperature sampling with a top-k in `1..=`[`MAX_DEVICE_TOP_K`] (then min-p and
//! top-p over those k, [`DeviceSampling::TopK`]) and without one or with a larger one (the
//! host's dense path, [`DeviceSampling::Dense`]), with or without penalties, a logit bias,
//! allowed ids, bad words and the `min_tokens` mask (a [`Reshape`]) and top log-probabilities
//! — except a step whose edits would touch more than a quarter of the vocabulary. A dense
//! top-p over more than [`MAX_DEVICE_TOP_P_CANDIDATES`] tokens comes back to the host
//! ([`DeviceSample::needs_host`]).
//!
//! A [`Reshape`] carries the logits processors as *edits*: the host, which knows the token
//! history, turns the penalties, bias, masks and allowed ids into one [`TokenEdit`] per token
//! id they touch, so the backend needs no history, only the edits (a few bytes per touched
//! id instead of a row of logits).
//!
//! Reproducibility: the host takes the uniform draw of this output token from the request's
//! seeded RNG (each output position has its own place in the stream) and passes it in
//! [`DeviceSampling::TopK::uniform`]; the backend reports whether it used it
//! ([`DeviceSample::used_draw`]). So a request's token stream is the same whichever path each
//! step took, and on whichever node each token was sampled.
//!
//! [`sample_row`] is the contract: every backend must choose the same token as it, bit for bit
//! (it is built from the host sampler's own functions and tested to equal
//! [`super::Sampler::sample`]). The reported log-probability must match it to floating-point
//! accuracy (a GPU sums the softmax denominator in another order).

use super::sampler::{TokenLogprob, top_logprobs};
use super::truncation::{
    Buffers, SMALL_TOP_K, Survivors, TOP_P_SORT_MAX, Weights, argmax, dense_weights,
    draw_candidates, draw_weights, log_sum_exp, raw_logprob, top_k_sorted, top_p_sorted,
};

/// Largest top-k of [`DeviceSampling::TopK`], the host's small-k path (a sorted candidate
/// list); larger ones, and none, are [`DeviceSampling::Dense`].
pub const MAX_DEVICE_TOP_K: u32 = SMALL_TOP_K as u32;

/// Most tokens a [`DeviceSampling::Dense`] row's top-p sorts: the host sorts the tokens that
/// may survive top-p when there are at most this many and histograms the mass otherwise;
/// a backend does the first and hands the second back ([`DeviceSample::needs_host`]).
pub const MAX_DEVICE_TOP_P_CANDIDATES: usize = TOP_P_SORT_MAX;

/// How a backend chooses one row's token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceSampling {
    /// The largest logit; ties to the lower id, NaN ignored, id 0 if every logit is `-inf`.
    Greedy,
    /// The `k` largest logits at or above `lmax + min_p_margin` (ties to the lower id; NaN
    /// and `-inf` never kept), sorted; weights `exp((l - lmax) * inv_temperature)`; then
    /// top-p over them when `top_p < 1`; then one draw: the first candidate, in order, whose
    /// cumulative weight exceeds `uniform × total`. A row whose largest logit is not finite
    /// gets its argmax and does not use the draw.
    TopK {
        /// `1..=`[`MAX_DEVICE_TOP_K`].
        k: u32,
        /// `1 / temperature`, computed in f32 on the host.
        inv_temperature: f32,
        /// In `(0, 1]`; `1` disables top-p.
        top_p: f32,
        /// min-p as a logit margin: `temperature × ln(min_p)` in f32 (`p >= min_p × p_max`
        /// is `l >= lmax + margin`); `-inf` disables min-p.
        min_p_margin: f32,
        /// The request's next uniform draw in `[0, 1)`.
        uniform: f64,
    },
    /// The host's dense path, for temperature sampling without a top-k or with one above
    /// [`MAX_DEVICE_TOP_K`]: every token's weight `exp((l - lmax) * inv_temperature)` (0
    /// below `lmax + min_p_margin`); with `top_k`, the weights outside the `top_k` best
    /// positive-weight logits (ties to the lower id) zeroed; the total summed in chunks of
    /// 64 (8 f32 lanes each, lanes in order, chunks in order in f64). Then without top-p one
    /// draw over the weights in id order; with top-p, the tokens whose weight is at least
    /// `(1 - top_p) × total / (2 × columns)` sorted (logit descending, id ascending), kept
    /// while the mass before them is below `top_p × total`, and one draw over those in
    /// order. More than [`MAX_DEVICE_TOP_P_CANDIDATES`] such tokens: the row goes back to
    /// the host. A row whose largest logit is not finite gets its argmax, no draw.
    Dense {
        /// 0 (none) or above [`MAX_DEVICE_TOP_K`].
        top_k: u32,
        inv_temperature: f32,
        top_p: f32,
        min_p_margin: f32,
        uniform: f64,
    },
}

/// What one [`TokenEdit`] does to its token's logit, as bits of [`TokenEdit::ops`], applied
/// in the order of the constants (the host sampler's order).
pub mod edit {
    /// The id is in `allowed_token_ids`: it keeps its logit under [`super::Reshape::allowed_only`].
    pub const ALLOWED: u32 = 1;
    /// Add [`super::TokenEdit::bias`] (`logit_bias`).
    pub const BIAS: u32 = 2;
    /// Set to `-inf` (a bad word it would complete, or an id masked until `min_tokens`).
    pub const MASK: u32 = 4;
    /// Repetition penalty: divide by it when positive, multiply otherwise (the id is in the
    /// prompt or the output).
    pub const REPEAT: u32 = 8;
    /// Subtract [`super::TokenEdit::frequency`], then the presence penalty (the id is in the
    /// output).
    pub const OUTPUT: u32 = 16;
}

/// Everything the logits processors do to one token id's logit this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenEdit {
    pub id: u32,
    /// Bits of [`edit`].
    pub ops: u32,
    /// The `logit_bias` added under [`edit::BIAS`].
    pub bias: f32,
    /// `frequency_penalty × count in the output` (an f32 product made on the host) under
    /// [`edit::OUTPUT`].
    pub frequency: f32,
}

impl TokenEdit {
    /// The edited logit, from the raw one: the reference every backend's kernel repeats
    /// operation for operation (IEEE f32, round to nearest, no fused multiply-add).
    pub fn apply(&self, raw: f32, reshape: &Reshape) -> f32 {
        let mut l = raw;
        if reshape.allowed_only && self.ops & edit::ALLOWED == 0 {
            l = f32::NEG_INFINITY;
        }
        if self.ops & edit::BIAS != 0 {
            l += self.bias;
        }
        if self.ops & edit::MASK != 0 {
            l = f32::NEG_INFINITY;
        }
        if self.ops & edit::REPEAT != 0 {
            let p = reshape.repetition_penalty;
            l = if l > 0.0 { l / p } else { l * p };
        }
        if self.ops & edit::OUTPUT != 0 {
            l = (l - self.frequency) - reshape.presence_penalty;
        }
        l
    }
}

/// The logits processors of one row as edits: ids without an edit keep their raw logit, or
/// get `-inf` when `allowed_only`; each edited id gets [`TokenEdit::apply`]. At most one edit
/// per id; ids at or past the row's vocabulary limit are never edited.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reshape {
    /// `allowed_token_ids` was given: ids without an [`edit::ALLOWED`] edit get `-inf`.
    pub allowed_only: bool,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub edits: Vec<TokenEdit>,
}

impl Reshape {
    /// The edited copy of a row (the reference; a backend writes it in device memory).
    pub fn apply(&self, raw: &[f32]) -> Vec<f32> {
        let mut out = if self.allowed_only {
            vec![f32::NEG_INFINITY; raw.len()]
        } else {
            raw.to_vec()
        };
        for e in &self.edits {
            if let Some(&l) = raw.get(e.id as usize) {
                out[e.id as usize] = e.apply(l, self);
            }
        }
        out
    }
}

/// What [`super::Sampler::device_plan`] hands the backend for one request's next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplePlan {
    pub method: DeviceSampling,
    /// The logits processors, when any applies this step.
    pub reshape: Option<Reshape>,
    /// How many of the most likely raw tokens to report with theirs log-probabilities
    /// (`logprobs`, at most [`super::MAX_LOGPROBS`]); 0 for none.
    pub top_logprobs: u32,
}

/// One row of a step's logits to sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSampleRow<'a> {
    /// Row of the logits matrix.
    pub row: usize,
    pub method: DeviceSampling,
    /// Edits to make to (a copy of) the row before choosing; the log-probability is still
    /// that of the raw row.
    pub reshape: Option<&'a Reshape>,
    /// How many of the most likely raw tokens to report ([`DeviceSample::top`]).
    pub top_logprobs: u32,
}

impl<'a> DeviceSampleRow<'a> {
    /// Row `row` sampled following `plan`.
    pub fn planned(row: usize, plan: &'a SamplePlan) -> Self {
        Self {
            row,
            method: plan.method,
            reshape: plan.reshape.as_ref(),
            top_logprobs: plan.top_logprobs,
        }
    }
}

/// What a backend chose for one row.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSample {
    pub token_id: u32,
    /// The token's log-probability under the raw logits (`log_softmax`, no temperature).
    pub logprob: f32,
    /// Whether the row's uniform draw was used (greedy rows and degenerate ones use none).
    pub used_draw: bool,
    /// The backend did not choose (a [`DeviceSampling::Dense`] top-p over more than
    /// [`MAX_DEVICE_TOP_P_CANDIDATES`] tokens): the host samples this row from its logits.
    /// `token_id` and `logprob` mean nothing then, and the draw is unused.
    pub needs_host: bool,
    /// The [`DeviceSampleRow::top_logprobs`] most likely tokens by raw logit, as
    /// [`super::SampledToken::top`] lists them.
    pub top: Vec<TokenLogprob>,
}

impl DeviceSample {
    /// A choice the backend hands back to the host.
    pub const NEEDS_HOST: Self = Self {
        token_id: 0,
        logprob: 0.0,
        used_draw: false,
        needs_host: true,
        top: Vec::new(),
    };
}

/// The reference: the token [`DeviceSampling`] chooses from `logits` (one row, every column
/// a candidate) after `row.reshape`'s edits, with `row.top_logprobs` alternatives (`row.row`
/// is not read): [`sample_row_within`] with the whole row.
///
/// # Panics
/// If `logits` is empty.
pub fn sample_row(logits: &[f32], row: &DeviceSampleRow<'_>) -> DeviceSample {
    sample_row_within(logits, logits.len(), row)
}

/// [`sample_row`] choosing among the first `vocab_limit` columns (the tokenizer's ids), with
/// log-probabilities normalized over the whole row, as [`super::Sampler::sample_within`].
///
/// # Panics
/// If the first `vocab_limit` columns of `all` are empty.
pub fn sample_row_within(
    all: &[f32],
    vocab_limit: usize,
    row: &DeviceSampleRow<'_>,
) -> DeviceSample {
    let logits = &all[..vocab_limit.min(all.len())];
    let (method, reshape) = (row.method, row.reshape);
    assert!(!logits.is_empty(), "sample_row: empty logits row");
    let shaped = reshape.map(|r| r.apply(logits));
    let work = shaped.as_deref().unwrap_or(logits);
    let (max_id, lmax) = argmax(work);
    let (token_id, used_draw) = match method {
        DeviceSampling::Greedy => (max_id, false),
        DeviceSampling::TopK { .. } if !(lmax > f32::NEG_INFINITY && lmax < f32::INFINITY) => {
            (max_id, false)
        }
        DeviceSampling::TopK {
            k,
            inv_temperature,
            top_p,
            min_p_margin,
            uniform,
        } => {
            let w = Weights {
                lmax,
                inv_t: inv_temperature,
                threshold: lmax + min_p_margin,
            };
            let mut candidates = Vec::with_capacity(k as usize);
            top_k_sorted(work, k as usize, w.threshold, &mut candidates);
            if top_p < 1.0 {
                top_p_sorted(work, &mut candidates, top_p, w);
            }
            let token = draw_candidates(work, &candidates, w, uniform).unwrap_or(max_id);
            (token, true)
        }
        DeviceSampling::Dense { .. } if !(lmax > f32::NEG_INFINITY && lmax < f32::INFINITY) => {
            (max_id, false)
        }
        DeviceSampling::Dense {
            top_k,
            inv_temperature,
            top_p,
            min_p_margin,
            uniform,
        } => {
            let w = Weights {
                lmax,
                inv_t: inv_temperature,
                threshold: lmax + min_p_margin,
            };
            let mut bufs = Buffers::default();
            let token = match dense_weights(work, w, top_k as usize, top_p, &mut bufs) {
                Survivors::Candidates => draw_candidates(work, &bufs.candidates, w, uniform),
                // Top-p through the mass histogram: the host's own path.
                Survivors::Dense if top_p < 1.0 => return DeviceSample::NEEDS_HOST,
                Survivors::Dense => draw_weights(&bufs.dense, uniform),
            };
            (token.unwrap_or(max_id), true)
        }
    };
    let lse = log_sum_exp(all);
    DeviceSample {
        token_id,
        logprob: raw_logprob(logits[token_id as usize], lse),
        used_draw,
        needs_host: false,
        top: if row.top_logprobs > 0 {
            top_logprobs(logits, row.top_logprobs, lse)
        } else {
            Vec::new()
        },
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

    const PROMPT: [u32; 6] = [1, 2, 3, 2, 40, 1100];

    fn plain<'a>(method: DeviceSampling, reshape: Option<&'a Reshape>) -> DeviceSampleRow<'a> {
        DeviceSampleRow {
            row: 0,
            method,
            reshape,
            top_logprobs: 0,
        }
    }

    /// Runs `steps` steps of one request both ways: the host sampler alone, and the device
    /// plan + [`sample_row`] + accept (falling back to the host where there is no plan), the
    /// output growing with the chosen tokens. The tokens and log-probabilities must be
    /// identical, step after step (so the RNG streams stay aligned). Returns how many steps
    /// had a plan.
    fn same_stream(params: &SamplingParams, vocab_limit: usize, quantised: bool) -> usize {
        let eos = [7];
        let mut host = Sampler::new(params, 7, &eos);
        let mut dev = Sampler::new(params, 7, &eos);
        let mut output = Vec::new();
        let mut planned = 0;
        for step in 0..40 {
            let mut row = logits(1200, step, quantised);
            if step % 7 == 3 {
                row[5] = f32::NAN;
                row[9] = f32::NEG_INFINITY;
            }
            if step % 2 == 1 {
                // The ids the processors below touch lead the row: their edits decide.
                for (j, id) in [3, 4, 7, 12, 13, 40, 1100].into_iter().enumerate() {
                    row[id] = 7.5 + j as f32 * 0.25;
                }
            }
            if step % 5 == 1 {
                // Ties and a repeated token's logit on both sides of zero.
                row[3] = 0.0;
                row[2] = -0.0;
                row[40] = row[41];
            }
            // The engine hides columns past the tokenizer's vocabulary this way.
            let mut masked = row.clone();
            masked[vocab_limit..].fill(f32::NEG_INFINITY);
            let expect = host.sample(&masked, &PROMPT, &output);
            let plan = dev.device_plan(&PROMPT, &output, vocab_limit);
            let sample = plan
                .as_ref()
                .map(|p| sample_row(&row[..vocab_limit], &DeviceSampleRow::planned(0, p)));
            let got = match sample {
                Some(s) if !s.needs_host => {
                    planned += 1;
                    dev.accept(s)
                }
                _ => dev.sample(&masked, &PROMPT, &output),
            };
            assert_eq!(got, expect, "step {step} {params:?}");
            output.push(got.token_id);
        }
        planned
    }

    fn sampling(temperature: f32, top_k: u32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            ..Default::default()
        }
    }

    #[test]
    fn device_path_matches_host_sampler() {
        let cases = [
            SamplingParams::default(),
            SamplingParams {
                top_p: 0.8,
                ..sampling(0.7, 20)
            },
            sampling(1.3, 1),
            sampling(0.05, 64),
            SamplingParams {
                top_p: 0.1,
                ..sampling(2.0, 64)
            },
            // The logits processors, one at a time and all together.
            SamplingParams {
                repetition_penalty: 1.7,
                ..sampling(0.9, 40)
            },
            SamplingParams {
                repetition_penalty: 0.6,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 1.5,
                ..sampling(1.0, 20)
            },
            SamplingParams {
                frequency_penalty: 2.0,
                presence_penalty: -0.3,
                ..sampling(1.2, 64)
            },
            SamplingParams {
                frequency_penalty: 1.0,
                ..Default::default()
            },
            SamplingParams {
                min_tokens: 30,
                stop_token_ids: vec![4, 1100],
                ..sampling(0.8, 8)
            },
            SamplingParams {
                logit_bias: vec![(4, 9.0), (900, -100.0), (4, 0.3), (1199, 100.0)],
                ..sampling(1.0, 30)
            },
            SamplingParams {
                allowed_token_ids: vec![3, 4, 5, 6, 7, 8, 1100, 1190],
                ..sampling(1.0, 3)
            },
            SamplingParams {
                allowed_token_ids: vec![5, 9],
                ..Default::default()
            },
            SamplingParams {
                bad_words_token_ids: vec![vec![3], vec![2, 40], vec![9, 9, 9]],
                ..sampling(1.5, 50)
            },
            SamplingParams {
                min_p: 0.2,
                ..sampling(1.0, 64)
            },
            SamplingParams {
                min_p: 1.0,
                top_p: 0.5,
                ..sampling(3.0, 10)
            },
            // The dense path: no top-k, or one above 64.
            sampling(1.0, 0),
            sampling(0.3, 0),
            SamplingParams {
                top_p: 0.9,
                ..sampling(0.8, 0)
            },
            SamplingParams {
                top_p: 0.05,
                ..sampling(2.5, 0)
            },
            SamplingParams {
                min_p: 0.1,
                ..sampling(1.0, 0)
            },
            sampling(1.0, 65),
            SamplingParams {
                top_p: 0.7,
                min_p: 0.01,
                ..sampling(1.7, 500)
            },
            SamplingParams {
                top_p: 0.95,
                presence_penalty: 1.5,
                repetition_penalty: 1.1,
                ..sampling(0.7, 0)
            },
            // The most likely alternatives, on every path.
            SamplingParams {
                logprobs: Some(5),
                ..Default::default()
            },
            SamplingParams {
                logprobs: Some(20),
                top_p: 0.8,
                ..sampling(1.0, 20)
            },
            SamplingParams {
                logprobs: Some(1),
                frequency_penalty: 1.0,
                ..sampling(0.9, 0)
            },
            SamplingParams {
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.25,
                logit_bias: vec![(10, 5.0), (11, -5.0)],
                bad_words_token_ids: vec![vec![12]],
                min_tokens: 10,
                stop_token_ids: vec![13],
                min_p: 0.01,
                top_p: 0.9,
                ..sampling(0.7, 20)
            },
        ];
        for params in &cases {
            for quantised in [false, true] {
                for limit in [1200, 1000] {
                    let planned = same_stream(params, limit, quantised);
                    assert_eq!(planned, 40, "{params:?} on the device every step");
                }
            }
        }
    }

    #[test]
    fn only_edits_past_a_quarter_of_the_vocabulary_keep_the_host() {
        // Edits for more than a quarter of the vocabulary: the only request left to the host.
        let long_allowed = SamplingParams {
            allowed_token_ids: (0..400).collect(),
            ..Default::default()
        };
        assert_eq!(
            Sampler::new(&long_allowed, 1, &[]).device_plan(&PROMPT, &[], 1200),
            None
        );
        // It still produces the same tokens through the shared driver above.
        assert_eq!(same_stream(&long_allowed, 1200, false), 0);
        let logprobs = SamplingParams {
            logprobs: Some(3),
            ..Default::default()
        };
        assert_eq!(
            Sampler::new(&logprobs, 1, &[]).device_plan(&PROMPT, &[], 1200),
            Some(SamplePlan {
                method: DeviceSampling::Greedy,
                reshape: None,
                top_logprobs: 3,
            })
        );
    }

    #[test]
    fn a_dense_top_p_over_too_many_tokens_goes_back_to_the_host() {
        // 20,000 nearly equal logits: top-p 0.99 keeps far more than 8,192 candidates.
        let flat: Vec<f32> = (0..20_000).map(|i| (i % 7) as f32 * 1e-3).collect();
        let dense = |top_p: f32| DeviceSampling::Dense {
            top_k: 0,
            inv_temperature: 1.0,
            top_p,
            min_p_margin: f32::NEG_INFINITY,
            uniform: 0.5,
        };
        assert_eq!(
            sample_row(&flat, &plain(dense(0.99), None)),
            DeviceSample::NEEDS_HOST
        );
        // Without top-p, or over a peaked row, the backend draws itself.
        assert!(!sample_row(&flat, &plain(dense(1.0), None)).needs_host);
        let mut peaked = flat.clone();
        peaked[77] = 40.0;
        let s = sample_row(&peaked, &plain(dense(0.99), None));
        assert_eq!((s.token_id, s.used_draw, s.needs_host), (77, true, false));
    }

    #[test]
    fn edits_merge_every_processor_per_id_and_skip_ids_past_the_vocabulary() {
        let params = SamplingParams {
            repetition_penalty: 1.5,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(2, 1.0), (9, 3.0), (2, 0.5), (50, 1.0)],
            allowed_token_ids: vec![2, 3, 9, 70],
            bad_words_token_ids: vec![vec![3], vec![8, 9], vec![1, 4]],
            min_tokens: 5,
            stop_token_ids: vec![6],
            ..Default::default()
        };
        let mut s = Sampler::new(&params, 1, &[5]);
        let plan = s.device_plan(&[1, 2], &[2, 2, 8], 40).expect("a plan");
        let r = plan.reshape.expect("edits");
        assert!(r.allowed_only);
        let ops = |id: u32| r.edits.iter().find(|e| e.id == id).map(|e| e.ops);
        use edit::*;
        assert_eq!(ops(2), Some(ALLOWED | BIAS | REPEAT | OUTPUT));
        assert_eq!(ops(3), Some(ALLOWED | MASK));
        assert_eq!(ops(9), Some(ALLOWED | BIAS | MASK), "8 9 completes after 8");
        assert_eq!(ops(4), None, "1 4 needs a 1 last");
        assert_eq!(ops(5), Some(MASK), "EOS before min_tokens");
        assert_eq!(ops(6), Some(MASK), "stop id before min_tokens");
        assert_eq!(ops(1), Some(REPEAT));
        assert_eq!(ops(8), Some(REPEAT | OUTPUT));
        assert_eq!(ops(50), None);
        assert_eq!(ops(70), None);
        assert_eq!(r.edits.len(), 7, "one edit per id: {:?}", r.edits);
        let two = r.edits.iter().find(|e| e.id == 2).unwrap();
        assert_eq!(
            (two.bias, two.frequency),
            (1.5, 0.5),
            "bias summed, 0.25 × 2"
        );
        // The map is clean for the next step: nothing carried over.
        let next = s.device_plan(&[1, 2], &[], 40).unwrap().reshape.unwrap();
        assert_eq!(next.edits.iter().filter(|e| e.ops & OUTPUT != 0).count(), 0);
    }

    #[test]
    fn min_tokens_edits_only_while_it_masks_something() {
        let p = SamplingParams {
            min_tokens: 3,
            ..Default::default()
        };
        // EOS is masked for the first three tokens.
        let mut s = Sampler::new(&p, 1, &[2]);
        let masked = s.device_plan(&[9], &[4, 4], 10).unwrap();
        assert_eq!(masked.reshape.unwrap().edits.len(), 1);
        assert_eq!(s.device_plan(&[9], &[4, 4, 4], 10).unwrap().reshape, None);
        // Nothing to mask (EOS ignored, no stop ids): no edits from the start.
        let ignored = SamplingParams {
            ignore_eos: true,
            ..p
        };
        let mut s = Sampler::new(&ignored, 1, &[2]);
        assert_eq!(s.device_plan(&[9], &[], 10).unwrap().reshape, None);
    }

    #[test]
    fn degenerate_rows_do_not_use_the_draw() {
        let method = DeviceSampling::TopK {
            k: 4,
            inv_temperature: 1.0,
            top_p: 1.0,
            min_p_margin: f32::NEG_INFINITY,
            uniform: 0.5,
        };
        let s = sample_row(&[f32::NEG_INFINITY; 5], &plain(method, None));
        assert_eq!((s.token_id, s.used_draw), (0, false));
        let s = sample_row(&[1.0, f32::INFINITY, f32::NAN], &plain(method, None));
        assert_eq!((s.token_id, s.used_draw), (1, false));
        let s = sample_row(
            &[1.0, 3.0, 3.0, f32::NAN],
            &plain(DeviceSampling::Greedy, None),
        );
        assert_eq!((s.token_id, s.used_draw), (1, false));
        // Everything masked by the edits: id 0, and the raw row's log-probability.
        let all_out = Reshape {
            allowed_only: true,
            ..Default::default()
        };
        let s = sample_row(&[1.0, 3.0], &plain(method, Some(&all_out)));
        assert_eq!((s.token_id, s.used_draw), (0, false));
        assert!((s.logprob - (1.0 - (1f32.exp() + 3f32.exp()).ln())).abs() < 1e-6);
    }

    #[test]
    fn negative_zero_ties_with_zero_by_id() {
        // -0.0 == 0.0: ids 0 and 1 tie; k = 1 keeps the lower id whatever the sign.
        let method = DeviceSampling::TopK {
            k: 1,
            inv_temperature: 1.0,
            top_p: 1.0,
            min_p_margin: f32::NEG_INFINITY,
            uniform: 0.99,
        };
        assert_eq!(
            sample_row(&[-0.0, 0.0, -1.0], &plain(method, None)).token_id,
            0
        );
        assert_eq!(
            sample_row(&[-1.0, 0.0, -0.0], &plain(method, None)).token_id,
            1
        );
    }
}
