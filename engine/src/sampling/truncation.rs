//! The arithmetic a sampler runs over one row of logits: weights under temperature and
//! min-p, top-k, top-p and the seeded draw, plus argmax and the log-sum-exp behind raw
//! log-probabilities. Shared with [`super::device`], whose backends must choose the same
//! tokens. Holds no request state (the [`super::Sampler`] does: parameters, RNG, buffers).
//!
//! Nothing sorts the whole vocabulary. Top-k uses a bounded insertion buffer (`k <= 64`) or
//! `select_nth_unstable`. Top-p first drops every token that provably cannot survive (few
//! remain in a peaked distribution, and those are sorted); otherwise it histograms the
//! probability mass by logit and sorts only the bucket where the cumulative mass crosses
//! `top_p`. Exponentials use a branch-free polynomial (relative error < 5e-7) that the
//! compiler vectorises, summed in f32 lanes and accumulated in f64.

use std::cmp::Ordering;

/// Up to this `k`, top-k runs as one pass with a sorted insertion buffer (and a backend may
/// sample the request itself, see [`super::device`]).
pub(super) const SMALL_TOP_K: usize = 64;

/// Buckets of the top-p mass histogram, over `(lmax - l) / t` in `[0, 88)` (a token
/// further below has weight 0).
const TOP_P_BUCKETS: usize = 2048;

/// Filtering buffers reused from step to step.
#[derive(Default)]
pub(super) struct Buffers {
    /// Dense path: the weight of every token, zeroed outside top-k / top-p.
    pub(super) dense: Vec<f32>,
    /// Candidate token ids (small top-k path, or to select the k-th token).
    pub(super) candidates: Vec<u32>,
    /// Top-p: probability mass per logit bucket.
    pub(super) hist: Vec<f64>,
    /// Top-p: the tokens of the bucket where the mass crosses `top_p`.
    pub(super) boundary: Vec<u32>,
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
pub(super) fn by_logit_desc(logits: &[f32], a: u32, b: u32) -> Ordering {
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
pub(super) enum Survivors {
    /// Every token with a positive weight in `Buffers::dense`.
    Dense,
    /// Exactly the ids in `Buffers::candidates`.
    Candidates,
}

/// Dense path (no top-k, or a large one): the weight of every token into `s.dense`, then
/// zeroes the tokens outside top-k and applies top-p.
pub(super) fn dense_weights(
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
pub(super) const TOP_P_SORT_MAX: usize = 8192;

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

/// One draw (`uniform` in `[0, 1)`) from unnormalised weights; `None` if they are all 0.
/// Chunk sums are computed the same way for the total and the walk, so the walk ends
/// exactly at the total.
pub(super) fn draw_weights(weights: &[f32], uniform: f64) -> Option<u32> {
    let total: f64 = weights.chunks(CHUNK).map(|c| f64::from(chunk_sum(c))).sum();
    let target = uniform * total;
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

#[cfg(test)]
pub(super) mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// Deterministic pseudo-random logits without touching a sampler's RNG.
    pub(in crate::sampling) fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random::<f32>() * 20.0 - 10.0).collect()
    }

    /// Every id, best logit first (ties by lower id).
    pub(in crate::sampling) fn sorted_desc(l: &[f32]) -> Vec<u32> {
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
            let t = draw_weights(&ws, rng.random::<f64>()).unwrap();
            assert!(ws[t as usize] > 0.0);
        }
        assert_eq!(draw_weights(&[0.0; 70], rng.random::<f64>()), None);
        assert_eq!(draw_weights(&[0.0, 0.0, 2.0], rng.random::<f64>()), Some(2));
    }
}
