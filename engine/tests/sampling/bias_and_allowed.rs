//! `logit_bias` (OpenAI's), `allowed_token_ids` and `bad_words` (vLLM's): they reshape the
//! logits before the penalties and sampling; reported log-probabilities stay the raw ones.

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
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..3000 {
        let t = crate::first_draw(&p, 1 + i).sample(&l, &[], &[]);
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

#[test]
fn bad_words_are_never_completed() {
    // Greedy would say 3, 4, 5 forever; "4 5" is a bad word, "7" too.
    let p = SamplingParams {
        bad_words_token_ids: vec![vec![4, 5], vec![7]],
        ..params()
    };
    let mut s = Sampler::new(&p, 0, &[]);
    let row = |best: u32| {
        let mut l = vec![0.0f32; 10];
        l[best as usize] = 5.0;
        l[7] = 4.0;
        l[8] = 3.0;
        l
    };
    assert_eq!(
        s.sample(&row(5), &[4], &[]).token_id,
        5,
        "the prompt is not the output"
    );
    assert_eq!(
        s.sample(&row(5), &[], &[3, 4]).token_id,
        8,
        "not 5 after 4, never 7"
    );
    assert_eq!(s.sample(&row(5), &[], &[4, 3]).token_id, 5);
    assert_eq!(s.sample(&row(7), &[], &[]).token_id, 8);
}

mod properties {
    use pd_engine::sampling::DeviceSampleRow;
    use pd_engine::sampling::device::sample_row;
    use pd_engine::sampling::{Sampler, SamplingParams};
    use proptest::prelude::*;

    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            8 => -20.0f32..20.0,
            1 => Just(f32::NEG_INFINITY),
            1 => Just(f32::NAN),
        ]
    }

    proptest! {
        /// Whatever valid reshaping a request asks for, on whatever row (NaN and -inf
        /// included), the sampler returns an id of the row, and an allowed one whenever an
        /// allowed id has a finite logit; the masked stop id never comes before min_tokens
        /// unless nothing else is left.
        #[test]
        fn reshaped_sampling_stays_in_bounds(
            logits in prop::collection::vec(logit(), 1..64),
            allowed in prop::collection::vec(0u32..64, 0..6),
            bias in prop::collection::vec((0u32..64, -100.0f32..100.0), 0..6),
            presence in -2.0f32..2.0,
            frequency in -2.0f32..2.0,
            repetition in 0.5f32..2.0,
            temperature in prop_oneof![Just(0.0f32), 0.1f32..2.0],
            top_k in 0u32..80,
            output in prop::collection::vec(0u32..70, 0..12),
            min_tokens in 0u32..4,
            seed in any::<u64>(),
        ) {
            let p = SamplingParams {
                temperature,
                top_k,
                repetition_penalty: repetition,
                presence_penalty: presence,
                frequency_penalty: frequency,
                logit_bias: bias,
                allowed_token_ids: allowed.clone(),
                stop_token_ids: vec![1],
                min_tokens,
                max_tokens: 16,
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(&p, seed, &[]);
            let t = s.sample(&logits, &[0, 3], &output).token_id;
            prop_assert!((t as usize) < logits.len());
            let live = |id: u32| logits.get(id as usize).is_some_and(|l| l.is_finite());
            if allowed.iter().any(|&a| live(a) && (a != 1 || output.len() >= min_tokens as usize)) {
                prop_assert!(allowed.contains(&t), "{t} not in {allowed:?}");
            }
            let others_live = (0..logits.len() as u32)
                .any(|id| id != 1 && live(id) && (allowed.is_empty() || allowed.contains(&id)));
            if output.len() < min_tokens as usize && others_live {
                prop_assert_ne!(t, 1, "the stop id before min_tokens");
            }
        }
    }

    /// Logits a little below those of the ids the processors touch (see below).
    fn close_logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            16 => -3.0f32..0.5,
            1 => Just(f32::NEG_INFINITY),
            1 => Just(f32::NAN),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]
        /// The backend's path (the sampler's plan: penalties, bias, masks and allowed ids as
        /// per-id edits, applied by the reference a backend must equal) chooses the host
        /// sampler's token, with the same raw log-probability and RNG use, whatever the
        /// request and the row. Rows of 100 to 300 ids keep the edits under a quarter of the
        /// vocabulary, so the plan is there to compare. The ids the processors touch get
        /// logits in [-1, 1), at the top of the row and of either sign, so their edits decide.
        #[test]
        fn the_backends_path_chooses_the_host_samplers_token(
            mut logits in prop::collection::vec(close_logit(), 100..300),
            hot in prop::collection::vec(-1.0f32..1.0, 130),
            allowed in prop::collection::vec(0u32..120, 0..6),
            bias in prop::collection::vec((0u32..120, -100.0f32..100.0), 0..6),
            bad in prop::collection::vec(prop::collection::vec(0u32..120, 1..3), 0..3),
            presence in -2.0f32..2.0,
            frequency in -2.0f32..2.0,
            repetition in prop_oneof![Just(1.0f32), 0.5f32..2.0],
            temperature in prop_oneof![Just(0.0f32), 0.1f32..2.0],
            top_k in prop_oneof![1u32..=64, Just(0u32), 65u32..400],
            top_p in prop_oneof![Just(1.0f32), 0.05f32..1.0],
            min_p in prop_oneof![Just(0.0f32), 0.001f32..1.0],
            output in prop::collection::vec(0u32..130, 0..12),
            min_tokens in 0u32..4,
            logprobs in prop_oneof![Just(None), (0u32..=20).prop_map(Some)],
            seed in any::<u64>(),
        ) {
            let p = SamplingParams {
                logprobs,
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty: repetition,
                presence_penalty: presence,
                frequency_penalty: frequency,
                logit_bias: bias,
                allowed_token_ids: allowed,
                bad_words_token_ids: bad,
                stop_token_ids: vec![1],
                min_tokens,
                max_tokens: 16,
                ..SamplingParams::default()
            };
            let prompt = [0, 3, 3, 90];
            let touched = prompt
                .iter()
                .chain(&output)
                .chain(&p.allowed_token_ids)
                .chain(p.logit_bias.iter().map(|(id, _)| id))
                .chain(p.bad_words_token_ids.iter().flatten())
                .chain(&[1, 2]);
            for &id in touched {
                if let Some(l) = logits.get_mut(id as usize).filter(|l| l.is_finite()) {
                    *l = hot[id as usize];
                }
            }
            let mut host = Sampler::new(&p, seed, &[2]);
            let mut dev = Sampler::new(&p, seed, &[2]);
            let plan = dev.device_plan(&prompt, &output, logits.len());
            prop_assert!(plan.is_some(), "a plan for {p:?}");
            let plan = plan.unwrap();
            let expect = host.sample(&logits, &prompt, &output);
            let sample = sample_row(&logits, &DeviceSampleRow::planned(0, &plan));
            prop_assert!(!sample.needs_host, "fewer than 8,192 tokens");
            let got = dev.accept(sample);
            prop_assert_eq!(got.token_id, expect.token_id);
            prop_assert_eq!(&got.top, &expect.top);
            prop_assert!(
                got.logprob == expect.logprob
                    || (got.logprob.is_nan() && expect.logprob.is_nan()),
                "logprob {} vs {}", got.logprob, expect.logprob
            );
            // Both RNGs advanced alike: the next draws agree.
            let flat = vec![0.0f32; logits.len()];
            prop_assert_eq!(
                host.sample(&flat, &[], &[]).token_id,
                dev.sample(&flat, &[], &[]).token_id
            );
        }
    }
}
