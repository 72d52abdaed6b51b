//! The sampler: greedy and its limits (temperature, top-k, top-p), min-p, the repetition
//! penalty, seeding, empirical distributions, non-finite logits and a Qwen3-sized vocabulary.

use pd_engine::sampling::{Sampler, SamplingParams};

use crate::{VOCAB, argmax, chi_square, counts, log_softmax, params, spread_logits};

#[test]
fn greedy_is_argmax_with_ties_to_lower_id() {
    let mut s = Sampler::new(&params(), 0, &[]);
    assert!(s.is_greedy());
    for salt in 0..20 {
        let l = spread_logits(VOCAB, salt);
        assert_eq!(s.sample(&l, &[], &[]).token_id, argmax(&l));
    }
    let l = [0.5, 2.0, -1.0, 2.0, 2.0];
    assert_eq!(s.sample(&l, &[], &[]).token_id, 1);
}

#[test]
fn temperature_towards_zero_becomes_greedy() {
    let l = spread_logits(VOCAB, 7);
    let best = argmax(&l);
    // Below the greedy epsilon: exact argmax, whatever the seed.
    for seed in 0..10 {
        let p = SamplingParams {
            temperature: 1e-6,
            ..params()
        };
        let mut s = Sampler::new(&p, seed, &[]);
        assert!(s.is_greedy());
        assert_eq!(s.sample(&l, &[], &[]).token_id, best);
    }
    // Small but real temperature: a gap of 1 logit is a factor e^100.
    let l = [1.0, 3.0, 2.0, -5.0];
    let p = SamplingParams {
        temperature: 0.01,
        ..params()
    };
    let mut s = Sampler::new(&p, 3, &[]);
    assert!(!s.is_greedy());
    for _ in 0..1000 {
        assert_eq!(s.sample(&l, &[], &[]).token_id, 1);
    }
}

#[test]
fn top_k_one_equals_greedy() {
    for salt in 0..10 {
        let l = spread_logits(VOCAB, salt);
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 1,
            ..params()
        };
        let mut s = Sampler::new(&p, salt, &[]);
        for _ in 0..20 {
            assert_eq!(s.sample(&l, &[], &[]).token_id, argmax(&l));
        }
    }
    // Ties: the lower id, as greedy.
    let p = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        ..params()
    };
    let mut s = Sampler::new(&p, 1, &[]);
    for _ in 0..50 {
        assert_eq!(s.sample(&[0.0, 4.0, 4.0, 4.0], &[], &[]).token_id, 1);
    }
}

#[test]
fn tiny_top_p_equals_greedy() {
    for salt in 0..10 {
        let l = spread_logits(VOCAB, salt + 100);
        let p = SamplingParams {
            temperature: 2.0,
            top_p: 1e-6,
            ..params()
        };
        let mut s = Sampler::new(&p, salt, &[]);
        for _ in 0..20 {
            assert_eq!(s.sample(&l, &[], &[]).token_id, argmax(&l));
        }
    }
}

#[test]
fn min_p_filters_relative_to_best() {
    let probs = [0.5f64, 0.3, 0.15, 0.05];
    let l: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
    // Threshold 0.2 * 0.5 = 0.1: token 3 (0.05) is dropped, token 2 (0.15) stays.
    let p = SamplingParams {
        temperature: 1.0,
        min_p: 0.2,
        ..params()
    };
    let c = counts(&p, 11, &l, 20_000);
    assert_eq!(c[3], 0);
    let chi = chi_square(&c, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]);
    assert!(
        chi < 13.8,
        "chi-square {chi} (2 dof, p=0.001 bound 13.8), counts {c:?}"
    );
    // min_p = 1 keeps only the best token.
    let p = SamplingParams {
        temperature: 1.0,
        min_p: 1.0,
        ..params()
    };
    assert_eq!(counts(&p, 1, &l, 500), vec![500, 0, 0, 0]);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let greedy_pen = SamplingParams {
        repetition_penalty: 2.0,
        ..params()
    };
    // Positive logit of a prompt token divided: 4 / 2 = 2 < 3.
    let mut s = Sampler::new(&greedy_pen, 0, &[]);
    assert_eq!(s.sample(&[4.0, 3.0, -1.0], &[0], &[]).token_id, 1);
    assert_eq!(
        s.sample(&[4.0, 3.0, -1.0], &[], &[]).token_id,
        0,
        "no context, no penalty"
    );
    // Negative logit of an output token multiplied: -1 * 2 = -2 < -1.5.
    assert_eq!(s.sample(&[-1.0, -1.5], &[], &[0]).token_id, 1);
    assert_eq!(s.sample(&[-1.0, -1.5], &[], &[]).token_id, 0);
    // Present in both prompt and output, or repeated: penalised once (4 / 1.5 > 2.5).
    let p = SamplingParams {
        repetition_penalty: 1.5,
        ..params()
    };
    let mut s = Sampler::new(&p, 0, &[]);
    assert_eq!(s.sample(&[4.0, 2.5], &[0, 0, 0], &[0, 0]).token_id, 0);
    // A penalty below 1 boosts instead.
    let p = SamplingParams {
        repetition_penalty: 0.5,
        ..params()
    };
    let mut s = Sampler::new(&p, 0, &[]);
    assert_eq!(s.sample(&[3.0, 2.0], &[1], &[]).token_id, 1);
    // Ids outside the vocabulary are ignored.
    assert_eq!(s.sample(&[3.0, 2.0], &[7, 99], &[]).token_id, 0);
    // The reported logprob is the raw one, before the penalty.
    let mut s = Sampler::new(&greedy_pen, 0, &[]);
    let l = [4.0f32, 3.0, -1.0];
    let t = s.sample(&l, &[0], &[]);
    assert!((t.logprob as f64 - log_softmax(&l)[1]).abs() < 1e-6);
}

#[test]
fn repetition_penalty_then_temperature_distribution() {
    // Penalty 2 on token 0 turns logits [ln 8, ln 2] into [ln 8 / 2, ln 2] = [ln 2.83, ln 2].
    let l = [8f32.ln(), 2f32.ln()];
    let p = SamplingParams {
        temperature: 1.0,
        repetition_penalty: 2.0,
        ..params()
    };
    let mut c = [0usize; 2];
    for i in 0..20_000 {
        c[crate::first_draw(&p, 99 + i).sample(&l, &[0], &[]).token_id as usize] += 1;
    }
    let a = 8f64.sqrt();
    let chi = chi_square(&c, &[a / (a + 2.0), 2.0 / (a + 2.0)]);
    assert!(chi < 10.83, "chi-square {chi}, counts {c:?}");
}

#[test]
fn same_seed_same_tokens_different_seed_differs() {
    let flat = vec![0.0f32; VOCAB];
    let p = SamplingParams {
        temperature: 1.0,
        ..params()
    };
    let run = |seed| {
        let mut s = Sampler::new(&p, seed, &[]);
        (0..64)
            .map(|_| s.sample(&flat, &[], &[]).token_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1234), run(1234));
    assert_ne!(run(1234), run(1235));
    // With every filter on, still reproducible.
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.01,
        repetition_penalty: 1.2,
        ..params()
    };
    let l = spread_logits(VOCAB, 5);
    let run = |seed| {
        let mut s = Sampler::new(&p, seed, &[]);
        let mut out = Vec::new();
        for _ in 0..64 {
            let t = s.sample(&l, &[1, 2, 3], &out).token_id;
            out.push(t);
        }
        out
    };
    assert_eq!(run(42), run(42));
}

#[test]
fn effective_seed_makes_unseeded_requests_reproducible() {
    let flat = vec![0.0f32; VOCAB];
    let mut p = SamplingParams {
        temperature: 1.0,
        ..params()
    };
    let draw = |p: &SamplingParams, fallback| {
        let mut s = Sampler::new(p, p.effective_seed(fallback), &[]);
        (0..16)
            .map(|_| s.sample(&flat, &[], &[]).token_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(&p, 77), draw(&p, 77));
    p.seed = Some(5);
    assert_eq!(draw(&p, 77), draw(&p, 78), "the request's own seed wins");
}

#[test]
fn empirical_distribution_matches_softmax() {
    let probs = [0.1f64, 0.2, 0.3, 0.4];
    let l: Vec<f32> = probs.iter().map(|p| (p.ln() + 3.0) as f32).collect();
    // 3 degrees of freedom: P(chi2 > 16.27) = 0.001; the seed is fixed so this cannot flake.
    let p = SamplingParams {
        temperature: 1.0,
        seed: Some(2024),
        ..params()
    };
    let c = counts(&p, 2024, &l, 20_000);
    let chi = chi_square(&c, &probs);
    assert!(chi < 16.27, "chi-square {chi}, counts {c:?}");
    // Temperature 0.5 squares the probabilities.
    let p = SamplingParams {
        temperature: 0.5,
        ..params()
    };
    let c = counts(&p, 7, &l, 20_000);
    let chi = chi_square(&c, &[1.0 / 30.0, 4.0 / 30.0, 9.0 / 30.0, 16.0 / 30.0]);
    assert!(chi < 16.27, "chi-square {chi}, counts {c:?}");
    // top_k = 2 renormalises over {0.3, 0.4}.
    let p = SamplingParams {
        temperature: 1.0,
        top_k: 2,
        ..params()
    };
    let c = counts(&p, 8, &l, 20_000);
    let chi = chi_square(&c, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi < 10.83, "chi-square {chi}, counts {c:?}");
    // top_p = 0.5: 0.4 alone is < 0.5, so 0.3 joins; 0.2 comes after mass 0.7 and is cut.
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.5,
        ..params()
    };
    let c = counts(&p, 9, &l, 20_000);
    let chi = chi_square(&c, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi < 10.83, "chi-square {chi}, counts {c:?}");
    // top_k = 3 then top_p = 0.75 (within the top 3: 0.44, 0.33, 0.22): keeps 2.
    let p = SamplingParams {
        temperature: 1.0,
        top_k: 3,
        top_p: 0.75,
        ..params()
    };
    let c = counts(&p, 10, &l, 20_000);
    let chi = chi_square(&c, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi < 10.83, "chi-square {chi}, counts {c:?}");
}

#[test]
fn neg_inf_and_nan_logits_are_never_sampled() {
    let l = [f32::NEG_INFINITY, 0.0, f32::NAN, 0.0, f32::NEG_INFINITY];
    let p = SamplingParams {
        temperature: 1.0,
        ..params()
    };
    let c = counts(&p, 1, &l, 2000);
    assert_eq!((c[0], c[2], c[4]), (0, 0, 0));
    assert!(c[1] > 800 && c[3] > 800, "{c:?}");
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 4,
        logprobs: Some(5),
        ..params()
    };
    let mut s = Sampler::new(&p, 0, &[]);
    let t = s.sample(&l, &[], &[]);
    assert!(t.token_id == 1 || t.token_id == 3);
    assert!((t.logprob - 0.5f32.ln()).abs() < 1e-6);
}

#[test]
fn qwen3_sized_vocabulary() {
    const QWEN3_VOCAB: usize = 151_936;
    let l = spread_logits(QWEN3_VOCAB, 1);
    let best = argmax(&l);
    let mut g = Sampler::new(&params(), 0, &[]);
    assert_eq!(g.sample(&l, &[], &[]).token_id, best);
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.8,
        logprobs: Some(5),
        ..params()
    };
    let mut s = Sampler::new(&p, 1, &[]);
    let mut order: Vec<u32> = (0..QWEN3_VOCAB as u32).collect();
    order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
    for _ in 0..10 {
        let t = s.sample(&l, &[5, 6], &[]);
        assert!(order[..20].contains(&t.token_id));
        let ids: Vec<u32> = t.top.iter().map(|x| x.token_id).collect();
        assert_eq!(ids, order[..5]);
    }
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        ..params()
    };
    let mut s = Sampler::new(&p, 2, &[]);
    for _ in 0..5 {
        assert!((s.sample(&l, &[], &[]).token_id as usize) < QWEN3_VOCAB);
    }
}
