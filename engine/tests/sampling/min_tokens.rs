//! `min_tokens`: the sampler never picks EOS or a stop token id while fewer tokens are out,
//! and the stop checker neither stops on them nor looks for stop strings before then (vLLM's
//! semantics, including a stop string that begins before the boundary and ends after it).

use pd_engine::sampling::{FinishReason, Sampler, SamplingParams, StopChecker, StopReason};

use crate::params;

const EOS: u32 = 2;

fn with_min(min_tokens: u32) -> SamplingParams {
    SamplingParams {
        min_tokens,
        stop_token_ids: vec![3],
        max_tokens: 10,
        ..params()
    }
}

#[test]
fn eos_and_stop_ids_are_masked_until_min_tokens_are_out() {
    // EOS (2) is the best logit, stop id 3 the second, token 1 the third.
    let l = [0.0f32, 1.0, 9.0, 8.0];
    let mut s = Sampler::new(&with_min(2), 0, &[EOS]);
    assert_eq!(s.sample(&l, &[5], &[]).token_id, 1);
    assert_eq!(s.sample(&l, &[5], &[1]).token_id, 1);
    assert_eq!(s.sample(&l, &[5], &[1, 1]).token_id, EOS, "two out: free");
    // The reported logprob is the raw one, masked ids keep theirs in `top`.
    let p = SamplingParams {
        logprobs: Some(1),
        ..with_min(1)
    };
    let t = Sampler::new(&p, 0, &[EOS]).sample(&l, &[], &[]);
    assert_eq!((t.token_id, t.top[0].token_id), (1, EOS));
    // ignore_eos: EOS is just a token, only the stop id is masked.
    let p = SamplingParams {
        ignore_eos: true,
        ..with_min(1)
    };
    assert_eq!(
        Sampler::new(&p, 0, &[EOS]).sample(&l, &[], &[]).token_id,
        EOS
    );
    let p = SamplingParams {
        ignore_eos: true,
        temperature: 1.0,
        top_k: 2,
        ..with_min(1)
    };
    // Temperature sampling never draws a masked id either: top-2 of what is left.
    let mut s = Sampler::new(&p, 7, &[EOS]);
    for _ in 0..200 {
        let t = s.sample(&[0.0, 1.0, 9.0, 9.5], &[], &[]).token_id;
        assert!(t == EOS || t == 1, "{t}");
    }
}

#[test]
fn the_first_min_tokens_never_stop_the_request() {
    let mut c = StopChecker::new(&with_min(2), vec![EOS]);
    assert_eq!(c.on_token(EOS, "").finished, None);
    assert_eq!(c.on_token(3, "").finished, None);
    let d = c.on_token(3, "");
    assert_eq!(d.finished, Some(FinishReason::Stop));
    assert_eq!(d.stop_reason, Some(StopReason::TokenId(3)));
    assert_eq!(c.num_tokens(), 3);
    // max_tokens still ends a request whose min_tokens equals it.
    let p = SamplingParams {
        max_tokens: 2,
        ..with_min(2)
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    assert_eq!(c.on_token(EOS, "").finished, None);
    assert_eq!(c.on_token(EOS, "").finished, Some(FinishReason::Length));
}

#[test]
fn stop_strings_count_only_from_the_token_after_min_tokens() {
    // vLLM's case: " is Lee, and I'm a student" with stop "e" and min_tokens 5 stops in
    // "student", not in "Lee".
    let pieces = [
        " is", " Lee", ",", " and", " I", "'m", " a", " student", " in",
    ];
    let p = SamplingParams {
        stop: vec!["e".into()],
        max_tokens: 20,
        min_tokens: 5,
        ..params()
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    let mut out = String::new();
    for (i, piece) in pieces.iter().enumerate() {
        let d = c.on_token(10 + i as u32, piece);
        out.push_str(&d.text);
        if d.finished.is_some() {
            assert_eq!(i, 7);
            break;
        }
    }
    assert_eq!(out, " is Lee, and I'm a stud");
    // Without min_tokens the same text stops at "Le".
    let mut c = StopChecker::new(
        &SamplingParams {
            min_tokens: 0,
            ..p.clone()
        },
        vec![EOS],
    );
    let d = c.on_token(10, " is Le");
    assert_eq!(
        (d.text.as_str(), d.finished),
        (" is L", Some(FinishReason::Stop))
    );
    // A stop string that begins in the first min_tokens tokens and ends after them counts.
    let p = SamplingParams {
        stop: vec!["END".into()],
        max_tokens: 20,
        min_tokens: 2,
        ..params()
    };
    let mut c = StopChecker::new(&p, vec![EOS]);
    assert_eq!(c.on_token(10, "x").finished, None);
    assert_eq!(c.on_token(11, "EN").finished, None);
    let d = c.on_token(12, "D!");
    assert_eq!(d.finished, Some(FinishReason::Stop));
    assert_eq!(c.output_text(), "x");
}
