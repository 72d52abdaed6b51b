//! Per-request token sampler: repetition penalty, greedy / temperature, min-p, top-k,
//! top-p, seeded draw, and raw log-probabilities.
//!
//! Cost per token for a 151,936-entry vocabulary is a few linear passes; nothing sorts
//! the whole vocabulary. Top-k uses a bounded insertion buffer (`k <= 64`) or
//! `select_nth_unstable`. Top-p first drops every token that provably cannot survive
//! (few remain in a peaked distribution, and those are sorted); otherwise it histograms
//! the probability mass by logit and sorts only the bucket where the cumulative mass
//! crosses `top_p`. Exponentials use a branch-free polynomial (relative error < 5e-7)
//! that the compiler vectorises, summed in f32 lanes and accumulated in f64.

use std::cmp::Ordering;
use std::fmt;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::device::{DeviceSample, DeviceSampling, MAX_DEVICE_TOP_K};
use super::params::{GREEDY_TEMPERATURE_EPS, SamplingParams};

/// One token and its raw log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    /// Vocabulary id.
    pub token_id: u32,
    /// `log_softmax` of the raw logits (before penalties and temperature) at this id.
    pub logprob: f32,
}

/// What [`Sampler::sample`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The chosen token.
    pub token_id: u32,
    /// The chosen token's raw log-probability (see [`TokenLogprob::logprob`]).
    pub logprob: f32,
    /// The `K` most likely tokens by raw logit, most likely first, ties by lower id, when
    /// the request asked for `logprobs = Some(K)`; empty otherwise. The chosen token is
    /// not necessarily among them. Tokens with a `-inf` or NaN logit are never listed.
    pub top: Vec<TokenLogprob>,
}

/// The log-probability of one prompt token given the prompt before it, see
/// [`prompt_logprobs`].
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    /// The actual next prompt token.
    pub token_id: u32,
    /// Its raw log-probability (`-inf` if the id is outside the logits).
    pub logprob: f32,
    /// The `K` most likely tokens, as in [`SampledToken::top`].
    pub top: Vec<TokenLogprob>,
}

/// Chooses the tokens of one request.
///
/// Processing order (vLLM v1): repetition penalty → greedy argmax when the temperature is
/// below [`GREEDY_TEMPERATURE_EPS`] (ties to the lower id) → temperature → min-p → top-k →
/// top-p → one draw from the renormalised distribution with the request's ChaCha RNG.
/// Reported log-probabilities are always those of the *raw* logits.
///
/// The sampler keeps scratch buffers sized to the vocabulary, so after the first call a
/// step allocates nothing except the returned `top` vector (and nothing at all when
/// logprobs are off). NaN logits are treated as `-inf`.
///
/// Tie-breaking is deterministic where vLLM's batched GPU kernels are not: top-k keeps
/// exactly `k` tokens (equal logits ordered by lower id) and top-p ranks tokens the same
/// way.
pub struct Sampler {
    greedy: bool,
    temperature: f32,
    top_p: f32,
    top_k: u32,
    min_p: f32,
    repetition_penalty: f32,
    logprobs: Option<u32>,
    rng: ChaCha8Rng,
    penalty: Penalty,
    bufs: Buffers,
}

/// The penalised copy of the logits, reused from step to step.
#[derive(Default)]
struct Penalty {
    /// Penalised copy of the logits.
    logits: Vec<f32>,
    /// `seen[id] == stamp` marks ids already penalised in this call.
    seen: Vec<u32>,
    stamp: u32,
}

/// Filtering buffers reused from step to step.
#[derive(Default)]
struct Buffers {
    /// Dense path: the weight of every token, zeroed outside top-k / top-p.
    dense: Vec<f32>,
    /// Candidate token ids (small top-k path, or to select the k-th token).
    candidates: Vec<u32>,
    /// Top-p: probability mass per logit bucket.
    hist: Vec<f64>,
    /// Top-p: the tokens of the bucket where the mass crosses `top_p`.
    boundary: Vec<u32>,
}

impl fmt::Debug for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler")
            .field("greedy", &self.greedy)
            .field("temperature", &self.temperature)
            .field("top_p", &self.top_p)
            .field("top_k", &self.top_k)
            .field("min_p", &self.min_p)
            .field("repetition_penalty", &self.repetition_penalty)
            .field("logprobs", &self.logprobs)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for one request. `seed` is used as given: pass
    /// [`SamplingParams::effective_seed`] so that unseeded requests are still reproducible
    /// for a given engine seed. `params` should have passed [`SamplingParams::validate`];
    /// out-of-range values are neutralised (NaN temperature → greedy, bad `top_p`,
    /// `min_p` or penalty → disabled), never trusted.
    pub fn new(params: &SamplingParams, seed: u64) -> Self {
        let penalty = params.repetition_penalty;
        Self {
            greedy: params.temperature.is_nan() || params.temperature < GREEDY_TEMPERATURE_EPS,
            temperature: params.temperature,
            top_p: if params.top_p > 0.0 && params.top_p < 1.0 {
                params.top_p
            } else {
                1.0
            },
            top_k: params.top_k,
            min_p: if params.min_p > 0.0 {
                params.min_p.min(1.0)
            } else {
                0.0
            },
            repetition_penalty: if penalty > 0.0 && penalty.is_finite() {
                penalty
            } else {
                1.0
            },
            logprobs: params.logprobs,
            rng: ChaCha8Rng::seed_from_u64(seed),
            penalty: Penalty::default(),
            bufs: Buffers::default(),
        }
    }

    /// Whether this sampler decodes greedily (it then never touches its RNG).
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// How a backend may choose this request's next token where the logits are (see
    /// [`super::device`]), or `None` when it needs the host: a repetition penalty, min-p,
    /// `logprobs > 0`, or temperature sampling without a top-k in
    /// `1..=`[`MAX_DEVICE_TOP_K`]. The uniform draw is *peeked* from the request's RNG;
    /// [`Sampler::accept`] consumes it only if the backend used it, so the stream stays the
    /// one [`Sampler::sample`] would have used.
    pub fn device_plan(&self) -> Option<DeviceSampling> {
        if self.repetition_penalty != 1.0
            || self.min_p > 0.0
            || self.logprobs.is_some_and(|k| k > 0)
        {
            return None;
        }
        if self.greedy {
            return Some(DeviceSampling::Greedy);
        }
        if self.top_k == 0 || self.top_k > MAX_DEVICE_TOP_K {
            return None;
        }
        Some(DeviceSampling::TopK {
            k: self.top_k,
            inv_temperature: 1.0 / self.temperature,
            top_p: self.top_p,
            uniform: self.rng.clone().random::<f64>(),
        })
    }

    /// The token a backend chose for this request following [`Sampler::device_plan`]. Advances
    /// the RNG by the one draw the backend used, if it used it.
    pub fn accept(&mut self, sample: DeviceSample) -> SampledToken {
        if sample.used_draw {
            let _: f64 = self.rng.random();
        }
        SampledToken {
            token_id: sample.token_id,
            logprob: sample.logprob,
            top: Vec::new(),
        }
    }

    /// Chooses the next token from one row of logits (`vocab_size` entries).
    ///
    /// `prompt_tokens` and `output_tokens` are the request's tokens so far; they only feed
    /// the repetition penalty (ids outside the logits are ignored).
    ///
    /// # Panics
    /// If `logits` is empty or longer than `u32::MAX`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> SampledToken {
        assert!(!logits.is_empty(), "Sampler::sample: empty logits row");
        assert!(
            u32::try_from(logits.len()).is_ok(),
            "Sampler::sample: vocabulary larger than u32::MAX"
        );
        let token_id = self.choose(logits, prompt_tokens, output_tokens);
        let lse = log_sum_exp(logits);
        let top = match self.logprobs {
            Some(k) if k > 0 => top_logprobs(logits, k, lse),
            _ => Vec::new(),
        };
        SampledToken {
            token_id,
            logprob: raw_logprob(logits[token_id as usize], lse),
            top,
        }
    }

    fn choose(&mut self, logits: &[f32], prompt_tokens: &[u32], output_tokens: &[u32]) -> u32 {
        let work: &[f32] = if self.repetition_penalty != 1.0
            && !(prompt_tokens.is_empty() && output_tokens.is_empty())
        {
            let pen = &mut self.penalty;
            pen.logits.clear();
            pen.logits.extend_from_slice(logits);
            apply_repetition_penalty(
                &mut pen.logits,
                &mut pen.seen,
                &mut pen.stamp,
                self.repetition_penalty,
                prompt_tokens,
                output_tokens,
            );
            &pen.logits
        } else {
            logits
        };
        if self.greedy {
            return argmax(work).0;
        }

        let (max_id, lmax) = argmax(work);
        if !(lmax > f32::NEG_INFINITY && lmax < f32::INFINITY) {
            // Degenerate row: all -inf / NaN, or an infinite logit dominating.
            return max_id;
        }
        // min-p keeps p >= min_p * p_max  <=>  (l - lmax) / t >= ln(min_p).
        let threshold = if self.min_p > 0.0 {
            lmax + self.temperature * self.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        let w = Weights {
            lmax,
            inv_t: 1.0 / self.temperature,
            threshold,
        };
        let rng = &mut self.rng;
        let k = self.top_k as usize;

        if k > 0 && k <= SMALL_TOP_K {
            // At most k candidates, already sorted: everything after this is tiny.
            let cand = &mut self.bufs.candidates;
            top_k_sorted(work, k, threshold, cand);
            if self.top_p < 1.0 {
                top_p_sorted(work, cand, self.top_p, w);
            }
            return draw_candidates(work, cand, w, rng.random::<f64>()).unwrap_or(max_id);
        }
        match dense_weights(work, w, k, self.top_p, &mut self.bufs) {
            Survivors::Dense => draw_weights(&self.bufs.dense, rng),
            Survivors::Candidates => {
                draw_candidates(work, &self.bufs.candidates, w, rng.random::<f64>())
            }
        }
        .unwrap_or(max_id)
    }
}

/// Up to this `k`, top-k runs as one pass with a sorted insertion buffer (and a backend may
/// sample the request itself, see [`super::device`]).
pub(super) const SMALL_TOP_K: usize = 64;

/// Buckets of the top-p mass histogram, over `(lmax - l) / t` in `[0, 88)` (a token
/// further below has weight 0).
const TOP_P_BUCKETS: usize = 2048;

/// vLLM's repetition penalty: every id present in the prompt or the output, counted once,
/// has its logit divided by `penalty` when positive and multiplied by it otherwise.
fn apply_repetition_penalty(
    logits: &mut [f32],
    seen: &mut Vec<u32>,
    stamp: &mut u32,
    penalty: f32,
    prompt_tokens: &[u32],
    output_tokens: &[u32],
) {
    if seen.len() < logits.len() {
        seen.resize(logits.len(), 0);
    }
    *stamp = stamp.wrapping_add(1);
    if *stamp == 0 {
        seen.fill(0);
        *stamp = 1;
    }
    for &t in prompt_tokens.iter().chain(output_tokens) {
        let i = t as usize;
        if i < logits.len() && seen[i] != *stamp {
            seen[i] = *stamp;
            let l = logits[i];
            logits[i] = if l > 0.0 { l / penalty } else { l * penalty };
        }
    }
}

/// Index and value of the largest logit, ties to the lower id, NaN ignored. Returns
/// `(0, -inf)` when nothing is larger than `-inf`.
pub(super) fn argmax(logits: &[f32]) -> (u32, f32) {
    // Two simple passes (a max reduction, then a search) vectorise far better than one
    // pass tracking the index.
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return (0, m);
    }
    let i = logits.iter().position(|&l| l == m).unwrap_or(0);
    (i as u32, m)
}

/// Orders ids by logit descending, then id ascending. Only used on non-NaN logits.
#[inline]
fn by_logit_desc(logits: &[f32], a: u32, b: u32) -> Ordering {
    logits[b as usize]
        .partial_cmp(&logits[a as usize])
        .unwrap_or(Ordering::Equal)
        .then(a.cmp(&b))
}

/// `exp(x)` for `x <= 0`, branch-free so loops over it vectorise. Returns 0 below -87
/// (where f32 leaves the normal range), for `-inf` and for NaN.
///
/// `x = n ln2 + r` with `|r| <= ln2 / 2`; `e^r` by its degree-7 Taylor polynomial
/// (truncation error < 6e-9 relative); `2^n` built from the exponent bits.
#[inline(always)]
fn exp_nonpos(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75; // 45426 / 2^16: n * LN2_HI is exact.
    const LN2_LO: f32 = 1.428_606_8e-6; // ln 2 - LN2_HI
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let valid = x >= -87.0;
    let x = if valid { x } else { -87.0 };
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits()); // n in [-126, 0]
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if valid { p * scale } else { 0.0 }
}

/// Unnormalised probability after temperature and min-p: `exp((l - lmax) / t)` for
/// `l >= threshold`, else 0 (NaN and `-inf` give 0).
#[derive(Clone, Copy)]
pub(super) struct Weights {
    pub(super) lmax: f32,
    pub(super) inv_t: f32,
    pub(super) threshold: f32,
}

impl Weights {
    #[inline(always)]
    pub(super) fn of(self, l: f32) -> f32 {
        let x = (l - self.lmax) * self.inv_t;
        exp_nonpos(if l >= self.threshold {
            x
        } else {
            f32::NEG_INFINITY
        })
    }

    /// Weights of one chunk of at most [`CHUNK`] logits, padded with zeros. Fixed-size
    /// loops so the compiler vectorises them.
    #[inline(always)]
    fn chunk(self, c: &[f32]) -> [f32; CHUNK] {
        let mut l = [f32::NEG_INFINITY; CHUNK];
        l[..c.len()].copy_from_slice(c);
        let mut out = [0.0f32; CHUNK];
        for j in 0..CHUNK {
            out[j] = self.of(l[j]);
        }
        out
    }
}

/// Granularity of the dense sums: weights are added in f32 within a chunk (8 lanes of 8),
/// chunk sums in f64.
const CHUNK: usize = 64;

/// Sum of at most [`CHUNK`] non-negative weights in 8 f32 lanes.
#[inline(always)]
fn chunk_sum(c: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut it = c.chunks_exact(8);
    for e in &mut it {
        for j in 0..8 {
            acc[j] += e[j];
        }
    }
    for (a, &x) in acc.iter_mut().zip(it.remainder()) {
        *a += x;
    }
    acc.iter().sum()
}

/// Sum of the weights of all logits, without storing them.
fn dense_total(logits: &[f32], w: Weights) -> f64 {
    logits
        .chunks(CHUNK)
        .map(|c| f64::from(chunk_sum(&w.chunk(c))))
        .sum()
}

/// Where the dense path left the surviving tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Survivors {
    /// Every token with a positive weight in `Buffers::dense`.
    Dense,
    /// Exactly the ids in `Buffers::candidates`.
    Candidates,
}

/// Dense path (no top-k, or a large one): the weight of every token into `s.dense`, then
/// zeroes the tokens outside top-k and applies top-p.
fn dense_weights(
    logits: &[f32],
    w: Weights,
    top_k: usize,
    top_p: f32,
    s: &mut Buffers,
) -> Survivors {
    let dense = &mut s.dense;
    dense.clear();
    dense.resize(logits.len(), 0.0);
    for (out, c) in dense.chunks_mut(CHUNK).zip(logits.chunks(CHUNK)) {
        out.copy_from_slice(&w.chunk(c)[..c.len()]);
    }
    if top_k > 0 {
        let cand = &mut s.candidates;
        cand.clear();
        cand.extend(
            dense
                .iter()
                .enumerate()
                .filter(|&(_, &x)| x > 0.0)
                .map(|(i, _)| i as u32),
        );
        if top_k < cand.len() {
            // The k-th best token, O(n); everything ranked below it goes.
            cand.select_nth_unstable_by(top_k - 1, |&a, &b| by_logit_desc(logits, a, b));
            let kth = cand[top_k - 1];
            let lk = logits[kth as usize];
            for (i, (x, &l)) in dense.iter_mut().zip(logits).enumerate() {
                if l < lk || (l == lk && i > kth as usize) {
                    *x = 0.0;
                }
            }
        }
    }
    if top_p < 1.0 {
        top_p_dense(logits, w, top_p, s)
    } else {
        Survivors::Dense
    }
}

/// With at most this many tokens above the certain-drop weight, top-p sorts them.
const TOP_P_SORT_MAX: usize = 8192;

/// Top-p over dense weights without sorting the vocabulary.
///
/// First a cheap bound: with `n` tokens and total mass `Z`, a token whose weight is below
/// `(1 - p) Z / (2n)` has more than `p Z` ranked above it, so it is certainly dropped. In
/// a peaked (typical LLM) distribution few tokens are above that bound; they are sorted
/// and walked, leaving the kept ids in `candidates`.
///
/// Otherwise the mass is histogrammed by logit (buckets monotone in the logit, best
/// first): the tokens of the buckets before the one where the cumulative mass reaches
/// `top_p` are kept, those after it are zeroed, and only the crossing bucket is sorted to
/// decide token by token, leaving the result in `dense`.
///
/// Either way the result equals [`top_p_sorted`] on the fully sorted list.
fn top_p_dense(logits: &[f32], w: Weights, top_p: f32, s: &mut Buffers) -> Survivors {
    let Buffers {
        dense,
        candidates,
        hist,
        boundary,
    } = s;
    let total: f64 = dense.chunks(CHUNK).map(|c| f64::from(chunk_sum(c))).sum();
    if total.is_nan() || total <= 0.0 {
        return Survivors::Dense;
    }
    let target = f64::from(top_p) * total;
    let drop_below = (1.0 - f64::from(top_p)) * total / (2.0 * dense.len() as f64);
    candidates.clear();
    for (i, &x) in dense.iter().enumerate() {
        if x > 0.0 && f64::from(x) >= drop_below {
            candidates.push(i as u32);
            if candidates.len() > TOP_P_SORT_MAX {
                break;
            }
        }
    }
    if candidates.len() <= TOP_P_SORT_MAX {
        candidates.sort_unstable_by(|&a, &b| by_logit_desc(logits, a, b));
        let mut cum = 0.0f64;
        let mut keep = candidates.len();
        for (j, &i) in candidates.iter().enumerate() {
            if cum >= target {
                keep = j;
                break;
            }
            cum += f64::from(dense[i as usize]);
        }
        candidates.truncate(keep);
        return Survivors::Candidates;
    }

    const SCALE: f32 = TOP_P_BUCKETS as f32 / 88.0;
    // Weight > 0 implies (lmax - l) / t <= 87, so the index stays in range; `min` guards
    // rounding. Non-increasing in the logit.
    let bucket = |l: f32| ((((w.lmax - l) * w.inv_t) * SCALE) as usize).min(TOP_P_BUCKETS - 1);
    hist.clear();
    hist.resize(TOP_P_BUCKETS, 0.0);
    for (&x, &l) in dense.iter().zip(logits) {
        if x > 0.0 {
            hist[bucket(l)] += f64::from(x);
        }
    }
    let total: f64 = hist.iter().sum();
    let target = f64::from(top_p) * total;
    // First bucket whose cumulative mass reaches the target; `before` is the mass above it.
    let mut before = 0.0f64;
    let mut cross = TOP_P_BUCKETS - 1;
    for (b, &m) in hist.iter().enumerate() {
        if before + m >= target {
            cross = b;
            break;
        }
        before += m;
    }
    // Earlier buckets: the mass above any of their tokens is < target, kept. Later buckets:
    // the mass above them is >= target, dropped.
    boundary.clear();
    for (i, (x, &l)) in dense.iter_mut().zip(logits).enumerate() {
        if *x > 0.0 {
            let b = bucket(l);
            if b > cross {
                *x = 0.0;
            } else if b == cross {
                boundary.push(i as u32);
            }
        }
    }
    boundary.sort_unstable_by(|&a, &b| by_logit_desc(logits, a, b));
    let mut cum = before;
    let mut keep = boundary.len();
    for (j, &i) in boundary.iter().enumerate() {
        if cum >= target {
            keep = j;
            break;
        }
        cum += f64::from(dense[i as usize]);
    }
    for &i in &boundary[keep..] {
        dense[i as usize] = 0.0;
    }
    Survivors::Dense
}

/// One draw from unnormalised weights; `None` if they are all 0. Chunk sums are computed
/// the same way for the total and the walk, so the walk ends exactly at the total.
fn draw_weights(weights: &[f32], rng: &mut ChaCha8Rng) -> Option<u32> {
    let total: f64 = weights.chunks(CHUNK).map(|c| f64::from(chunk_sum(c))).sum();
    let target = rng.random::<f64>() * total;
    let last_positive = |ci: usize, c: &[f32]| {
        c.iter()
            .rposition(|&x| x > 0.0)
            .map(|j| (ci * CHUNK + j) as u32)
    };
    let mut cum = 0.0f64;
    let mut last_chunk = None;
    for (ci, c) in weights.chunks(CHUNK).enumerate() {
        let chunk = f64::from(chunk_sum(c));
        if chunk <= 0.0 {
            continue;
        }
        if cum + chunk > target {
            // The crossing is inside this chunk.
            let mut inner = cum;
            for (j, &x) in c.iter().enumerate() {
                if x > 0.0 {
                    inner += f64::from(x);
                    if inner > target {
                        return Some((ci * CHUNK + j) as u32);
                    }
                }
            }
            // Rounding (f32 chunk sum vs f64 walk): settle on the chunk's last token.
            return last_positive(ci, c);
        }
        cum += chunk;
        last_chunk = Some(ci);
    }
    // Only reachable through rounding at the very end.
    let ci = last_chunk?;
    last_positive(ci, weights.chunks(CHUNK).nth(ci)?)
}

/// One draw among `candidates` with `uniform` in `[0, 1)` (the request's next RNG value);
/// `None` if every weight is 0.
pub(super) fn draw_candidates(
    logits: &[f32],
    candidates: &[u32],
    w: Weights,
    uniform: f64,
) -> Option<u32> {
    let total: f64 = candidates
        .iter()
        .map(|&i| f64::from(w.of(logits[i as usize])))
        .sum();
    let target = uniform * total;
    let mut cum = 0.0f64;
    let mut last = None;
    for &i in candidates {
        let x = f64::from(w.of(logits[i as usize]));
        if x > 0.0 {
            cum += x;
            last = Some(i);
            if cum > target {
                return last;
            }
        }
    }
    last
}

/// The `k` best ids with `logit >= threshold` (and finite below), sorted by logit
/// descending then id ascending, in one pass with a bounded insertion buffer.
pub(super) fn top_k_sorted(logits: &[f32], k: usize, threshold: f32, out: &mut Vec<u32>) {
    out.clear();
    if k == 0 {
        return;
    }
    // Logit of the current k-th entry once the buffer is full.
    let mut worst = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if !(l >= threshold && l > f32::NEG_INFINITY) {
            continue;
        }
        if out.len() == k {
            // Later ids lose ties, so only a strictly larger logit gets in (l is not NaN).
            if l <= worst {
                continue;
            }
            out.pop();
        }
        let pos = out.partition_point(|&j| logits[j as usize] >= l);
        out.insert(pos, i as u32);
        if out.len() == k {
            worst = logits[out[k - 1] as usize];
        }
    }
}

/// Top-p over candidates already sorted best first: a token is dropped once the mass of
/// the tokens ranked above it reaches `top_p` of the total (vLLM's `cumsum <= 1 - p`
/// mask seen from the other end). The best token is always kept.
pub(super) fn top_p_sorted(logits: &[f32], candidates: &mut Vec<u32>, top_p: f32, w: Weights) {
    let total: f64 = candidates
        .iter()
        .map(|&i| f64::from(w.of(logits[i as usize])))
        .sum();
    let target = f64::from(top_p) * total;
    let mut cum = 0.0f64;
    for j in 0..candidates.len() {
        if cum >= target {
            candidates.truncate(j);
            return;
        }
        cum += f64::from(w.of(logits[candidates[j] as usize]));
    }
}

/// `log(sum(exp(logits)))`, NaN ignored; `-inf` if every logit is `-inf`.
pub(super) fn log_sum_exp(logits: &[f32]) -> f64 {
    let (_, m) = argmax(logits);
    if !(m > f32::NEG_INFINITY && m < f32::INFINITY) {
        return f64::from(m);
    }
    let w = Weights {
        lmax: m,
        inv_t: 1.0,
        threshold: f32::NEG_INFINITY,
    };
    f64::from(m) + dense_total(logits, w).ln()
}

#[inline]
pub(super) fn raw_logprob(logit: f32, lse: f64) -> f32 {
    if logit.is_nan() || logit == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        (f64::from(logit) - lse) as f32
    }
}

/// The `k` best ids by raw logit (descending, ties by lower id) with their logprobs.
fn top_logprobs(logits: &[f32], k: u32, lse: f64) -> Vec<TokenLogprob> {
    let mut ids = Vec::with_capacity((k as usize).min(logits.len()));
    top_k_sorted(logits, k as usize, f32::NEG_INFINITY, &mut ids);
    ids.into_iter()
        .map(|id| TokenLogprob {
            token_id: id,
            logprob: raw_logprob(logits[id as usize], lse),
        })
        .collect()
}

/// Log-probability of the actual next prompt token plus the `k` most likely alternatives,
/// from the logits row computed at the position before it (raw logits, no penalties or
/// temperature). The first prompt token has no logprob; callers skip it.
pub fn prompt_logprobs(logits: &[f32], next_token: u32, k: u32) -> PromptLogprob {
    let lse = log_sum_exp(logits);
    let logprob = logits
        .get(next_token as usize)
        .map_or(f32::NEG_INFINITY, |&l| raw_logprob(l, lse));
    let top = if k > 0 {
        top_logprobs(logits, k, lse)
    } else {
        Vec::new()
    };
    PromptLogprob {
        token_id: next_token,
        logprob,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random logits without touching a sampler's RNG.
    fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random::<f32>() * 20.0 - 10.0).collect()
    }

    fn sorted_desc(l: &[f32]) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..l.len() as u32).collect();
        ids.sort_by(|&a, &b| by_logit_desc(l, a, b));
        ids
    }

    #[test]
    fn exp_nonpos_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.0 {
            let exact = f64::from(x).exp();
            let rel = ((f64::from(exp_nonpos(x)) - exact) / exact).abs();
            worst = worst.max(rel);
            x -= 0.001_37;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-88.0), 0.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(f32::NAN), 0.0);
    }

    #[test]
    fn argmax_ties_to_lower_id_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]).0, 1);
        assert_eq!(argmax(&[f32::NAN, 2.0]).0, 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]).0, 0);
    }

    /// Tokens left by the dense path, best first, and where it left them.
    fn dense_kept(l: &[f32], w: Weights, k: usize, p: f32) -> (Vec<u32>, Survivors) {
        let mut bufs = Buffers::default();
        let how = dense_weights(l, w, k, p, &mut bufs);
        let mut kept: Vec<u32> = match how {
            Survivors::Dense => (0..l.len() as u32)
                .filter(|&i| bufs.dense[i as usize] > 0.0)
                .collect(),
            Survivors::Candidates => bufs.candidates.clone(),
        };
        kept.sort_by(|&a, &b| by_logit_desc(l, a, b));
        (kept, how)
    }

    #[test]
    fn dense_top_k_top_p_match_full_sort_reference() {
        let mut paths = Vec::new();
        for seed in 0..4 {
            let mut l = logits(20_000, seed);
            if seed % 2 == 1 {
                // Heavy ties: quantised logits.
                l.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0);
            }
            let lmax = argmax(&l).1;
            let order = sorted_desc(&l);
            for t in [0.05f32, 0.7, 5.0] {
                let w = Weights {
                    lmax,
                    inv_t: 1.0 / t,
                    threshold: f32::NEG_INFINITY,
                };
                for k in [0usize, 100, 15_000] {
                    for p in [1e-6f32, 0.01, 0.3, 0.9, 0.999, 1.0] {
                        let mut expect = order.clone();
                        expect.retain(|&i| w.of(l[i as usize]) > 0.0);
                        if k > 0 {
                            expect.truncate(k);
                        }
                        if p < 1.0 {
                            top_p_sorted(&l, &mut expect, p, w);
                        }
                        let (kept, how) = dense_kept(&l, w, k, p);
                        assert_eq!(kept, expect, "seed {seed} t {t} k {k} p {p}");
                        if p < 1.0 {
                            paths.push(how);
                        }
                    }
                }
            }
        }
        // Both top-p strategies were exercised.
        assert!(paths.contains(&Survivors::Dense) && paths.contains(&Survivors::Candidates));
    }

    #[test]
    fn top_k_paths_keep_exactly_k_best() {
        let l = logits(3000, 42);
        for k in [1u32, 50, 64, 65, 500] {
            let mut s = Sampler::new(
                &SamplingParams {
                    temperature: 1.0,
                    top_k: k,
                    ..Default::default()
                },
                1,
            );
            let best: Vec<u32> = sorted_desc(&l)[..k as usize].to_vec();
            for _ in 0..50 {
                let t = s.sample(&l, &[], &[]).token_id;
                assert!(best.contains(&t));
            }
            if k as usize <= SMALL_TOP_K {
                assert_eq!(s.bufs.candidates, best, "k {k}");
            } else {
                let kept: Vec<u32> = (0..l.len() as u32)
                    .filter(|&i| s.bufs.dense[i as usize] > 0.0)
                    .collect();
                let mut sorted_best = best.clone();
                sorted_best.sort();
                assert_eq!(kept, sorted_best, "k {k}");
            }
        }
    }

    #[test]
    fn top_k_sorted_orders_ties_by_id_and_skips_non_finite() {
        let l = [1.0, 5.0, 5.0, f32::NAN, 2.0, 5.0, f32::NEG_INFINITY];
        let mut out = Vec::new();
        top_k_sorted(&l, 4, f32::NEG_INFINITY, &mut out);
        assert_eq!(out, vec![1, 2, 5, 4]);
        top_k_sorted(&l, 20, f32::NEG_INFINITY, &mut out);
        assert_eq!(out, vec![1, 2, 5, 4, 0]);
        top_k_sorted(&l, 20, 2.0, &mut out);
        assert_eq!(out, vec![1, 2, 5, 4]);
    }

    #[test]
    fn draw_weights_only_picks_positive_weights() {
        let mut ws = vec![0.0f32; 1001];
        for i in (3..1001).step_by(97) {
            ws[i] = 1e-3 * i as f32;
        }
        ws[1000] = 1e-30;
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for _ in 0..2000 {
            let t = draw_weights(&ws, &mut rng).unwrap();
            assert!(ws[t as usize] > 0.0);
        }
        assert_eq!(draw_weights(&[0.0; 70], &mut rng), None);
        assert_eq!(draw_weights(&[0.0, 0.0, 2.0], &mut rng), Some(2));
    }

    #[test]
    fn repetition_penalty_stamp_wraps() {
        let mut seen = Vec::new();
        let mut stamp = u32::MAX;
        let mut l = vec![2.0f32, -2.0, 1.0];
        apply_repetition_penalty(&mut l, &mut seen, &mut stamp, 2.0, &[0, 0, 9], &[1, 0]);
        assert_eq!(stamp, 1);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
    }

    #[test]
    fn no_allocation_growth_after_first_step() {
        let l = logits(10_000, 3);
        let mut s = Sampler::new(
            &SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                repetition_penalty: 1.1,
                ..Default::default()
            },
            9,
        );
        let caps = |s: &Sampler| {
            (
                s.penalty.logits.capacity(),
                s.penalty.seen.capacity(),
                s.bufs.dense.capacity(),
                s.bufs.candidates.capacity(),
                s.bufs.hist.capacity(),
                s.bufs.boundary.capacity(),
            )
        };
        s.sample(&l, &[1, 2, 3], &[4]);
        let first = caps(&s);
        for _ in 0..20 {
            s.sample(&l, &[1, 2, 3], &[4]);
        }
        assert_eq!(first, caps(&s));
    }
}
