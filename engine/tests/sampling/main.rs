//! Sampling parameters, the sampler and stop conditions (vLLM semantics).

use pd_engine::sampling::{
    FinishReason, MAX_LOGPROBS, MAX_STOP_STRINGS, Sampler, SamplingError, SamplingParams,
    StopChecker, StopReason, prompt_logprobs,
};
use proptest::prelude::*;

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

fn counts(p: &SamplingParams, seed: u64, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = Sampler::new(p, seed);
    let mut c = vec![0; logits.len()];
    for _ in 0..n {
        c[s.sample(logits, &[], &[]).token_id as usize] += 1;
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

// ---------------------------------------------------------------- validation

fn invalid(p: SamplingParams) -> SamplingError {
    p.validate(VOCAB, 4096).expect_err("should be rejected")
}

#[test]
fn validate_accepts_defaults_and_boundaries() {
    params().validate(VOCAB, 4096).unwrap();
    let edge = SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 5_000_000,
        min_p: 1.0,
        repetition_penalty: 1e-3,
        seed: Some(u64::MAX),
        max_tokens: 4096,
        stop: vec!["x".into(); MAX_STOP_STRINGS],
        stop_token_ids: vec![0, VOCAB as u32 - 1],
        ignore_eos: true,
        logprobs: Some(MAX_LOGPROBS),
        prompt_logprobs: Some(MAX_LOGPROBS),
        include_stop_str_in_output: true,
    };
    edge.validate(VOCAB, 4096).unwrap();
    SamplingParams {
        temperature: 100.0,
        top_p: 1e-9,
        min_p: 0.0,
        max_tokens: 1,
        logprobs: Some(0),
        ..params()
    }
    .validate(VOCAB, 4096)
    .unwrap();
}

#[test]
fn validate_temperature() {
    for t in [-1.0, -1e-9, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = invalid(SamplingParams {
            temperature: t,
            ..params()
        });
        assert!(
            matches!(e, SamplingError::InvalidTemperature(_)),
            "{t}: {e}"
        );
    }
    let e = invalid(SamplingParams {
        temperature: -1.0,
        ..params()
    });
    assert_eq!(
        e.to_string(),
        "temperature must be a finite number >= 0, got -1"
    );
    let e = invalid(SamplingParams {
        temperature: f32::NAN,
        ..params()
    });
    assert!(e.to_string().ends_with("got NaN"), "{e}");
}

#[test]
fn validate_top_p() {
    for v in [0.0, -0.5, 1.0001, f32::NAN, f32::INFINITY] {
        let e = invalid(SamplingParams {
            top_p: v,
            ..params()
        });
        assert!(matches!(e, SamplingError::InvalidTopP(_)), "{v}: {e}");
        assert!(e.to_string().starts_with("top_p must be in (0, 1]"), "{e}");
    }
}

#[test]
fn validate_min_p() {
    for v in [-0.01, 1.01, f32::NAN, f32::NEG_INFINITY] {
        let e = invalid(SamplingParams {
            min_p: v,
            ..params()
        });
        assert!(matches!(e, SamplingError::InvalidMinP(_)), "{v}: {e}");
        assert!(e.to_string().starts_with("min_p must be in [0, 1]"), "{e}");
    }
}

#[test]
fn validate_repetition_penalty() {
    for v in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = invalid(SamplingParams {
            repetition_penalty: v,
            ..params()
        });
        assert!(
            matches!(e, SamplingError::InvalidRepetitionPenalty(_)),
            "{v}: {e}"
        );
        assert!(e.to_string().contains("repetition_penalty"), "{e}");
    }
}

#[test]
fn validate_max_tokens() {
    let e = invalid(SamplingParams {
        max_tokens: 0,
        ..params()
    });
    assert_eq!(e, SamplingError::ZeroMaxTokens);
    assert_eq!(e.to_string(), "max_tokens must be >= 1, got 0");
    let e = invalid(SamplingParams {
        max_tokens: 4097,
        ..params()
    });
    assert_eq!(
        e,
        SamplingError::MaxTokensTooLarge {
            max_tokens: 4097,
            cap: 4096
        }
    );
    assert_eq!(e.to_string(), "max_tokens must be <= 4096, got 4097");
}

#[test]
fn validate_stop_strings() {
    let e = invalid(SamplingParams {
        stop: vec!["a".into(); MAX_STOP_STRINGS + 1],
        ..params()
    });
    assert_eq!(e, SamplingError::TooManyStopStrings(17));
    let e = invalid(SamplingParams {
        stop: vec!["a".into(), String::new()],
        ..params()
    });
    assert_eq!(e, SamplingError::EmptyStopString { index: 1 });
    assert!(e.to_string().contains("stop[1]"), "{e}");
}

#[test]
fn validate_stop_token_ids() {
    let e = invalid(SamplingParams {
        stop_token_ids: vec![1, 2, VOCAB as u32],
        ..params()
    });
    assert_eq!(
        e,
        SamplingError::StopTokenIdOutOfRange {
            index: 2,
            token_id: VOCAB as u32,
            vocab_size: VOCAB
        }
    );
    assert!(e.to_string().contains("1000"), "{e}");
}

#[test]
fn validate_logprobs() {
    let e = invalid(SamplingParams {
        logprobs: Some(21),
        ..params()
    });
    assert_eq!(e, SamplingError::TooManyLogprobs(21));
    assert_eq!(e.to_string(), "logprobs must be <= 20, got 21");
    let e = invalid(SamplingParams {
        prompt_logprobs: Some(100),
        ..params()
    });
    assert_eq!(e, SamplingError::TooManyPromptLogprobs(100));
    assert_eq!(e.to_string(), "prompt_logprobs must be <= 20, got 100");
}

#[test]
fn params_deserialize_with_defaults_and_roundtrip() {
    let p: SamplingParams =
        serde_json::from_str(r#"{"temperature": 0.7, "stop": ["\n\n"], "seed": 5}"#).unwrap();
    assert_eq!(p.temperature, 0.7);
    assert_eq!(p.stop, vec!["\n\n".to_string()]);
    assert_eq!(p.seed, Some(5));
    assert_eq!(p.max_tokens, 16);
    assert_eq!(p.top_p, 1.0);
    assert_eq!(p.repetition_penalty, 1.0);
    assert!(!p.is_greedy());
    let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
}

// ---------------------------------------------------------------- sampler

#[test]
fn greedy_is_argmax_with_ties_to_lower_id() {
    let mut s = Sampler::new(&params(), 0);
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
        let mut s = Sampler::new(&p, seed);
        assert!(s.is_greedy());
        assert_eq!(s.sample(&l, &[], &[]).token_id, best);
    }
    // Small but real temperature: a gap of 1 logit is a factor e^100.
    let l = [1.0, 3.0, 2.0, -5.0];
    let p = SamplingParams {
        temperature: 0.01,
        ..params()
    };
    let mut s = Sampler::new(&p, 3);
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
        let mut s = Sampler::new(&p, salt);
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
    let mut s = Sampler::new(&p, 1);
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
        let mut s = Sampler::new(&p, salt);
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
    let mut s = Sampler::new(&greedy_pen, 0);
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
    let mut s = Sampler::new(&p, 0);
    assert_eq!(s.sample(&[4.0, 2.5], &[0, 0, 0], &[0, 0]).token_id, 0);
    // A penalty below 1 boosts instead.
    let p = SamplingParams {
        repetition_penalty: 0.5,
        ..params()
    };
    let mut s = Sampler::new(&p, 0);
    assert_eq!(s.sample(&[3.0, 2.0], &[1], &[]).token_id, 1);
    // Ids outside the vocabulary are ignored.
    assert_eq!(s.sample(&[3.0, 2.0], &[7, 99], &[]).token_id, 0);
    // The reported logprob is the raw one, before the penalty.
    let mut s = Sampler::new(&greedy_pen, 0);
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
    let mut s = Sampler::new(&p, 99);
    let mut c = [0usize; 2];
    for _ in 0..20_000 {
        c[s.sample(&l, &[0], &[]).token_id as usize] += 1;
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
        let mut s = Sampler::new(&p, seed);
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
        let mut s = Sampler::new(&p, seed);
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
        let mut s = Sampler::new(p, p.effective_seed(fallback));
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
    let mut s = Sampler::new(&p, 0);
    let t = s.sample(&l, &[], &[]);
    assert!(t.token_id == 1 || t.token_id == 3);
    assert!((t.logprob - 0.5f32.ln()).abs() < 1e-6);
}

#[test]
fn logprobs_are_raw_log_softmax_and_top_is_ordered() {
    let l = spread_logits(VOCAB, 3);
    let expect = log_softmax(&l);
    let total: f64 = (0..VOCAB as u32)
        .map(|t| (prompt_logprobs(&l, t, 0).logprob as f64).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-4, "sum of probabilities {total}");
    for t in [0u32, 17, 999] {
        let lp = prompt_logprobs(&l, t, 0).logprob as f64;
        assert!((lp - expect[t as usize]).abs() < 1e-4);
    }

    // Temperature, top-k and the penalty do not change the reported values.
    let p = SamplingParams {
        temperature: 0.3,
        top_k: 5,
        repetition_penalty: 1.3,
        logprobs: Some(MAX_LOGPROBS),
        ..params()
    };
    let mut s = Sampler::new(&p, 5);
    for _ in 0..20 {
        let t = s.sample(&l, &[1, 2], &[3]);
        assert!((t.logprob as f64 - expect[t.token_id as usize]).abs() < 1e-4);
        assert_eq!(t.top.len(), MAX_LOGPROBS as usize);
        let mut order: Vec<u32> = (0..VOCAB as u32).collect();
        order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        let ids: Vec<u32> = t.top.iter().map(|x| x.token_id).collect();
        assert_eq!(ids, order[..MAX_LOGPROBS as usize]);
        assert!(t.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        for x in &t.top {
            assert!((x.logprob as f64 - expect[x.token_id as usize]).abs() < 1e-4);
        }
    }
    // Ties in `top` go to the lower id; K larger than the vocabulary is clamped.
    let p = SamplingParams {
        logprobs: Some(3),
        ..params()
    };
    let t = Sampler::new(&p, 0).sample(&[1.0, 2.0, 2.0, 0.0, 2.0], &[], &[]);
    let ids: Vec<u32> = t.top.iter().map(|x| x.token_id).collect();
    assert_eq!(ids, vec![1, 2, 4]);
    let t = Sampler::new(
        &SamplingParams {
            logprobs: Some(20),
            ..params()
        },
        0,
    )
    .sample(&[1.0, 2.0], &[], &[]);
    assert_eq!(t.top.len(), 2);
    // No logprobs requested: no top list.
    assert!(
        Sampler::new(&params(), 0)
            .sample(&l, &[], &[])
            .top
            .is_empty()
    );
    let t = Sampler::new(
        &SamplingParams {
            logprobs: Some(0),
            ..params()
        },
        0,
    )
    .sample(&l, &[], &[]);
    assert!(t.top.is_empty());
    assert!((t.logprob as f64 - expect[argmax(&l) as usize]).abs() < 1e-4);
}

#[test]
fn prompt_logprobs_reports_next_token_and_top() {
    let l = [0.0f32, 1.0, 2.0, 3.0];
    let expect = log_softmax(&l);
    let p = prompt_logprobs(&l, 1, 2);
    assert_eq!(p.token_id, 1);
    assert!((p.logprob as f64 - expect[1]).abs() < 1e-6);
    let ids: Vec<u32> = p.top.iter().map(|x| x.token_id).collect();
    assert_eq!(ids, vec![3, 2]);
    assert_eq!(prompt_logprobs(&l, 9, 0).logprob, f32::NEG_INFINITY);
}

#[test]
fn qwen3_sized_vocabulary() {
    const QWEN3_VOCAB: usize = 151_936;
    let l = spread_logits(QWEN3_VOCAB, 1);
    let best = argmax(&l);
    let mut g = Sampler::new(&params(), 0);
    assert_eq!(g.sample(&l, &[], &[]).token_id, best);
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.8,
        logprobs: Some(5),
        ..params()
    };
    let mut s = Sampler::new(&p, 1);
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
    let mut s = Sampler::new(&p, 2);
    for _ in 0..5 {
        assert!((s.sample(&l, &[], &[]).token_id as usize) < QWEN3_VOCAB);
    }
}

// ---------------------------------------------------------------- stop conditions

const EOS: u32 = 2;

fn stop_params(stop: &[&str]) -> SamplingParams {
    SamplingParams {
        stop: stop.iter().map(|s| s.to_string()).collect(),
        max_tokens: 100,
        ..params()
    }
}

/// Feeds `(token, text)` pairs; returns the concatenated emitted text and the final decision.
fn feed(c: &mut StopChecker, pieces: &[(u32, &str)]) -> (String, Vec<Option<FinishReason>>) {
    let mut out = String::new();
    let mut fin = Vec::new();
    for &(t, s) in pieces {
        let d = c.on_token(t, s);
        out.push_str(&d.text);
        fin.push(d.finished);
    }
    (out, fin)
}

#[test]
fn stop_string_spanning_several_tokens() {
    let mut c = StopChecker::new(&stop_params(&["STOP"]), vec![EOS]);
    let d = c.on_token(10, "Hello S");
    assert_eq!((d.text.as_str(), d.finished), ("Hello ", None));
    assert_eq!(c.held_back(), "S");
    let d = c.on_token(11, "T");
    assert_eq!((d.text.as_str(), d.finished), ("", None));
    let d = c.on_token(12, "OP and more");
    assert_eq!(d.text, "");
    assert_eq!(d.finished, Some(FinishReason::Stop));
    assert_eq!(d.stop_reason, Some(StopReason::Text("STOP".into())));
    assert_eq!(c.output_text(), "Hello ");
    // Finished: later tokens emit nothing.
    let d = c.on_token(13, "zzz");
    assert_eq!(
        (d.text.as_str(), d.finished),
        ("", Some(FinishReason::Stop))
    );
    assert_eq!(c.flush(), "");
}

#[test]
fn partial_match_that_is_not_a_stop_string_is_emitted_in_full() {
    let mut c = StopChecker::new(&stop_params(&["STOP"]), vec![EOS]);
    let (out, fin) = feed(&mut c, &[(10, "a ST"), (11, "O"), (12, "RE!")]);
    assert_eq!(out, "a STORE!");
    assert_eq!(fin, vec![None, None, None]);
    // A prefix that restarts inside the held-back text.
    let mut c = StopChecker::new(&stop_params(&["abab"]), vec![EOS]);
    let (out, _) = feed(&mut c, &[(1, "ab"), (1, "a"), (1, "c")]);
    assert_eq!(out, "abac");
    let mut c = StopChecker::new(&stop_params(&["abab"]), vec![EOS]);
    let (out, fin) = feed(&mut c, &[(1, "xab"), (1, "a"), (1, "bab")]);
    assert_eq!(out, "x", "the stop string starts inside the held-back text");
    assert_eq!(fin[2], Some(FinishReason::Stop));
    let mut c = StopChecker::new(&stop_params(&["abab"]), vec![EOS]);
    let (out, fin) = feed(&mut c, &[(1, "xab"), (1, "ac"), (1, "abab")]);
    assert_eq!(out, "xabac");
    assert_eq!(fin, vec![None, None, Some(FinishReason::Stop)]);
}

#[test]
fn include_stop_str_in_output() {
    let p = SamplingParams {
        include_stop_str_in_output: true,
        ..stop_params(&["STOP"])
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    let (out, fin) = feed(&mut c, &[(1, "x ST"), (2, "OP tail")]);
    assert_eq!(out, "x STOP");
    assert_eq!(fin, vec![None, Some(FinishReason::Stop)]);
    assert_eq!(c.output_text(), "x STOP");
}

#[test]
fn stop_string_in_the_middle_of_one_token() {
    let mut c = StopChecker::new(&stop_params(&["\n\n"]), vec![EOS]);
    let d = c.on_token(1, "para one\n\npara two");
    assert_eq!(d.text, "para one");
    assert_eq!(d.finished, Some(FinishReason::Stop));
}

#[test]
fn stop_token_ids_and_eos() {
    let p = SamplingParams {
        stop_token_ids: vec![7],
        ..stop_params(&["END"])
    };
    // Stop token: kept as a token, its text dropped, held-back text flushed.
    let mut c = StopChecker::new(&p, vec![EOS]);
    let (out, fin) = feed(&mut c, &[(1, "so E"), (7, "<seven>")]);
    assert_eq!(out, "so E");
    assert_eq!(fin[1], Some(FinishReason::Stop));
    assert_eq!(c.stop_reason(), Some(&StopReason::TokenId(7)));
    assert_eq!(c.num_tokens(), 2);
    // EOS: stop without a stop reason.
    let mut c = StopChecker::new(&p, vec![EOS, 3]);
    let d = c.on_token(3, "<|im_end|>");
    assert_eq!(d.text, "");
    assert_eq!(d.finished, Some(FinishReason::Stop));
    assert_eq!(d.stop_reason, None);
    // include_stop_str_in_output renders the stop token's text (vLLM).
    let p2 = SamplingParams {
        include_stop_str_in_output: true,
        ..p.clone()
    };
    let mut c = StopChecker::new(&p2, vec![EOS]);
    let (out, _) = feed(&mut c, &[(1, "a"), (EOS, "</s>")]);
    assert_eq!(out, "a</s>");
}

#[test]
fn ignore_eos_keeps_going_but_stop_token_ids_still_stop() {
    let p = SamplingParams {
        ignore_eos: true,
        ..stop_params(&[])
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    let (out, fin) = feed(&mut c, &[(EOS, "<eos>"), (5, "x")]);
    assert_eq!(out, "<eos>x");
    assert_eq!(fin, vec![None, None]);
    let p = SamplingParams {
        ignore_eos: true,
        stop_token_ids: vec![EOS],
        ..stop_params(&[])
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    assert_eq!(c.on_token(EOS, "<eos>").finished, Some(FinishReason::Stop));
}

#[test]
fn max_tokens_gives_length_and_flushes() {
    let p = SamplingParams {
        max_tokens: 3,
        ..stop_params(&["STOP"])
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    let (out, fin) = feed(&mut c, &[(1, "a"), (1, "b"), (1, "ST")]);
    assert_eq!(out, "abST", "held-back text is flushed at the end");
    assert_eq!(fin, vec![None, None, Some(FinishReason::Length)]);
    assert_eq!(c.finish_reason(), Some(FinishReason::Length));
    // A stop condition on the last allowed token wins over Length (vLLM v1).
    let mut c = StopChecker::new(&p, vec![EOS]);
    let (_, fin) = feed(&mut c, &[(1, "a"), (1, "b"), (EOS, "")]);
    assert_eq!(fin[2], Some(FinishReason::Stop));
    let mut c = StopChecker::new(&p, vec![EOS]);
    let (out, fin) = feed(&mut c, &[(1, "a"), (1, "b"), (1, "STOP")]);
    assert_eq!((out.as_str(), fin[2]), ("ab", Some(FinishReason::Stop)));
    // max_tokens = 1.
    let mut c = StopChecker::new(
        &SamplingParams {
            max_tokens: 1,
            ..params()
        },
        vec![EOS],
    );
    assert_eq!(c.on_token(4, "hi").finished, Some(FinishReason::Length));
    assert_eq!(c.output_text(), "hi");
}

#[test]
fn flush_and_force_finish_release_held_back_text() {
    let mut c = StopChecker::new(&stop_params(&["STOP"]), vec![EOS]);
    assert_eq!(c.on_token(1, "abcST").text, "abc");
    assert_eq!(c.flush(), "ST");
    assert_eq!(c.finish_reason(), None);
    let mut c = StopChecker::new(&stop_params(&["STOP"]), vec![EOS]);
    c.on_token(1, "abcST");
    let d = c.force_finish(FinishReason::Abort);
    assert_eq!(d.text, "ST");
    assert_eq!(d.finished, Some(FinishReason::Abort));
    assert_eq!(FinishReason::Abort.to_string(), "abort");
    assert_eq!(FinishReason::Length.to_string(), "length");
    assert_eq!(FinishReason::Stop.as_str(), "stop");
}

fn piece() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![Just('a'), Just('b'), Just('c'), Just('é'), Just('日')],
        0..5,
    )
    .prop_map(|v| v.into_iter().collect())
}

fn stop_string() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![Just('a'), Just('b'), Just('c'), Just('é'), Just('日')],
        1..5,
    )
    .prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Emitted text + held back is always the full text so far, never contains a stop
    /// string, and a stop cuts exactly before the first stop string to complete.
    #[test]
    fn emitted_text_never_contains_a_stop_string(
        stops in proptest::collection::vec(stop_string(), 1..4),
        pieces in proptest::collection::vec(piece(), 0..30),
    ) {
        let p = SamplingParams { stop: stops.clone(), max_tokens: 1000, ..params() };
        let mut c = StopChecker::new(&p, vec![EOS]);
        let mut full = String::new();
        let mut emitted = String::new();
        let mut finished = None;
        for s in &pieces {
            let before = full.clone();
            full.push_str(s);
            let d = c.on_token(100, s);
            emitted.push_str(&d.text);
            prop_assert!(full.starts_with(&emitted));
            prop_assert!(!stops.iter().any(|x| emitted.contains(x.as_str())), "{emitted:?}");
            if let Some(r) = d.finished {
                prop_assert_eq!(r, FinishReason::Stop);
                // Detected on the first token that completes a stop string...
                prop_assert!(!stops.iter().any(|x| before.contains(x.as_str())));
                // ...and the text is cut right before one.
                let Some(StopReason::Text(hit)) = d.stop_reason else { panic!("no stop string") };
                prop_assert!(full[emitted.len()..].starts_with(hit.as_str()));
                finished = Some(r);
                break;
            }
            prop_assert_eq!(format!("{}{}", emitted, c.held_back()), full.clone());
            // Only a possible stop-string start is held back.
            let h = c.held_back();
            prop_assert!(h.is_empty() || stops.iter().any(|x| x.len() > h.len() && x.starts_with(h)));
        }
        if finished.is_none() {
            emitted.push_str(&c.flush());
            prop_assert_eq!(&emitted, &full);
            prop_assert!(!stops.iter().any(|x| full.contains(x.as_str())));
        }
    }

    /// With include_stop_str_in_output nothing is held back and the output ends with the
    /// stop string, with nothing after it.
    #[test]
    fn include_stop_str_output_ends_at_the_stop_string(
        stops in proptest::collection::vec(stop_string(), 1..4),
        pieces in proptest::collection::vec(piece(), 0..30),
    ) {
        let p = SamplingParams {
            stop: stops.clone(),
            include_stop_str_in_output: true,
            max_tokens: 1000,
            ..params()
        };
        let mut c = StopChecker::new(&p, vec![EOS]);
        let mut full = String::new();
        let mut emitted = String::new();
        for s in &pieces {
            full.push_str(s);
            let d = c.on_token(100, s);
            emitted.push_str(&d.text);
            prop_assert!(full.starts_with(&emitted));
            if d.finished.is_some() {
                let Some(StopReason::Text(hit)) = d.stop_reason else { panic!("no stop string") };
                prop_assert!(emitted.ends_with(hit.as_str()));
                let body = &emitted[..emitted.len() - hit.len()];
                prop_assert!(!stops.iter().any(|x| body.contains(x.as_str())));
                break;
            }
            prop_assert_eq!(c.held_back(), "");
            prop_assert_eq!(&emitted, &full);
        }
    }
}
