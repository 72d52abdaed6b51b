//! `logit_bias` (OpenAI's) and `allowed_token_ids` (vLLM's): both reshape the logits before
//! the penalties and sampling; reported log-probabilities stay the raw ones.

use pd_engine::sampling::{Sampler, SamplingParams};

use crate::{log_softmax, params, spread_logits};

#[test]
fn logit_bias_shifts_the_choice_and_stacks_with_the_penalties() {
    let l = [3.0f32, 2.0, 1.0];
    let biased = |bias: Vec<(u32, f32)>| SamplingParams {
        logit_bias: bias,
        ..params()
    };
    let mut s = Sampler::new(&biased(vec![(2, 2.5)]), 0, &[]);
    let t = s.sample(&l, &[], &[]);
    assert_eq!(t.token_id, 2, "1 + 2.5 beats 3");
    assert!(
        (t.logprob as f64 - log_softmax(&l)[2]).abs() < 1e-6,
        "raw logprob"
    );
    // -100 all but bans the best token.
    assert_eq!(
        Sampler::new(&biased(vec![(0, -100.0)]), 0, &[])
            .sample(&l, &[], &[])
            .token_id,
        1
    );
    // Ids outside the logits are ignored; an id listed twice gets both.
    let mut s = Sampler::new(&biased(vec![(7, 50.0), (1, 0.6), (1, 0.6)]), 0, &[]);
    assert_eq!(s.sample(&l, &[], &[]).token_id, 1, "2 + 1.2 beats 3");
    // Before the penalties: 3 + 1 = 4, then frequency 0.8 × 2 = 1.6 takes it to 2.4 < 2.5.
    let p = SamplingParams {
        logit_bias: vec![(0, 1.0), (1, 0.5)],
        frequency_penalty: 0.8,
        ..params()
    };
    assert_eq!(
        Sampler::new(&p, 0, &[]).sample(&l, &[], &[0, 0]).token_id,
        1
    );
}

#[test]
fn allowed_token_ids_confine_every_draw() {
    let l = spread_logits(500, 11);
    let allowed = vec![400, 17, 3, 17];
    let p = SamplingParams {
        temperature: 1.5,
        allowed_token_ids: allowed.clone(),
        seed: Some(1),
        ..params()
    };
    let mut s = Sampler::new(&p, 1, &[]);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..3000 {
        let t = s.sample(&l, &[], &[]);
        assert!(allowed.contains(&t.token_id), "{}", t.token_id);
        seen.insert(t.token_id);
    }
    assert_eq!(seen.len(), 3, "each allowed id is drawn: {seen:?}");
    // Greedy: the best allowed id, not the best overall; with the bias on top.
    let best_allowed = *[400u32, 17, 3]
        .iter()
        .max_by(|a, b| l[**a as usize].total_cmp(&l[**b as usize]))
        .unwrap();
    let greedy = SamplingParams {
        allowed_token_ids: allowed.clone(),
        ..params()
    };
    assert_eq!(
        Sampler::new(&greedy, 0, &[]).sample(&l, &[], &[]).token_id,
        best_allowed
    );
    let other = if best_allowed == 3 { 17 } else { 3 };
    let forced = SamplingParams {
        logit_bias: vec![(other, 100.0), (250, 100.0)],
        ..greedy
    };
    assert_eq!(
        Sampler::new(&forced, 0, &[]).sample(&l, &[], &[]).token_id,
        other,
        "a bias cannot bring back a token that is not allowed"
    );
}
