//! Frequency and presence penalties (OpenAI's, as vLLM applies them): output tokens only,
//! `logit − frequency × count − presence`, after the repetition penalty, before sampling;
//! the reported log-probabilities stay the raw ones.

use pd_engine::sampling::{Sampler, SamplingParams};

use crate::{log_softmax, params};

fn greedy(frequency_penalty: f32, presence_penalty: f32) -> Sampler {
    Sampler::new(
        &SamplingParams {
            frequency_penalty,
            presence_penalty,
            ..params()
        },
        0,
        &[],
    )
}

#[test]
fn frequency_penalty_grows_with_each_repeat_in_the_output() {
    let l = [5.0f32, 4.0, 3.5];
    let mut s = greedy(0.4, 0.0);
    // Once in the output: 5 − 0.4 = 4.6 still beats 4.
    assert_eq!(s.sample(&l, &[], &[0]).token_id, 0);
    // Three times: 5 − 1.2 = 3.8 < 4.
    assert_eq!(s.sample(&l, &[], &[0, 0, 0]).token_id, 1);
    // ... unless 1 is out too: 3.8 against 4 − 0.4 = 3.6 and 3.5.
    assert_eq!(s.sample(&l, &[], &[0, 1, 0, 0]).token_id, 0);
    assert_eq!(
        s.sample(&l, &[], &[1, 0, 0, 0, 0, 1, 1]).token_id,
        2,
        "3.4, 2.8, 3.5"
    );
    // The prompt does not count.
    assert_eq!(s.sample(&l, &[0, 0, 0, 0, 0], &[]).token_id, 0);
}

#[test]
fn presence_penalty_is_paid_once_whatever_the_count() {
    let l = [5.0f32, 4.0];
    let mut s = greedy(0.0, 0.9);
    assert_eq!(s.sample(&l, &[], &[0]).token_id, 0, "5 − 0.9 > 4");
    assert_eq!(s.sample(&l, &[], &[0, 0, 0, 0]).token_id, 0, "still 4.1");
    let mut s = greedy(0.0, 1.1);
    assert_eq!(s.sample(&l, &[], &[0]).token_id, 1, "5 − 1.1 < 4");
    assert_eq!(
        s.sample(&l, &[0], &[]).token_id,
        0,
        "prompt tokens are free"
    );
}

#[test]
fn negative_penalties_favour_repeats_and_both_add_up() {
    let l = [4.0f32, 5.0];
    assert_eq!(greedy(-0.6, 0.0).sample(&l, &[], &[0, 0]).token_id, 0);
    assert_eq!(greedy(0.0, -1.5).sample(&l, &[], &[0]).token_id, 0);
    // 5 − 0.4 × 2 − 0.3 = 3.9 < 4 only with both.
    assert_eq!(greedy(0.4, 0.0).sample(&l, &[], &[1, 1]).token_id, 1);
    assert_eq!(greedy(0.0, 0.3).sample(&l, &[], &[1, 1]).token_id, 1);
    assert_eq!(greedy(0.4, 0.3).sample(&l, &[], &[1, 1]).token_id, 0);
}

#[test]
fn penalties_follow_the_repetition_penalty_and_keep_raw_logprobs() {
    // Repetition 2 first: 6 / 2 = 3, then frequency 0.5 × 2 = 1: 2 < 2.5.
    let p = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        ..params()
    };
    let l = [6.0f32, 2.5];
    let mut s = Sampler::new(&p, 0, &[]);
    let t = s.sample(&l, &[], &[0, 0]);
    assert_eq!(t.token_id, 1);
    assert!((t.logprob as f64 - log_softmax(&l)[1]).abs() < 1e-6);
    // Ids outside the vocabulary are ignored, and nothing carries over between calls.
    assert_eq!(s.sample(&l, &[], &[9, 9, 9]).token_id, 0);
    assert_eq!(greedy(1.0, 1.0).sample(&l, &[], &[]).token_id, 0);
}

#[test]
fn penalised_distribution_is_the_softmax_of_the_penalised_logits() {
    // Equal logits; token 0 twice in the output with frequency 0.5 and presence 0.5: its
    // weight is e^-1.5 against 1.
    let p = SamplingParams {
        temperature: 1.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.5,
        seed: Some(5),
        ..params()
    };
    let mut c = [0usize; 2];
    for i in 0..20_000 {
        let t = crate::first_draw(&p, 5 + i).sample(&[1.0, 1.0], &[], &[0, 0]);
        c[t.token_id as usize] += 1;
    }
    let w = (-1.5f64).exp();
    let chi = crate::chi_square(&c, &[w / (1.0 + w), 1.0 / (1.0 + w)]);
    assert!(chi < 10.83, "chi-square {chi}, counts {c:?}");
}
