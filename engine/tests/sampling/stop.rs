//! Stop conditions (`StopChecker`): stop strings across tokens, held-back text, stop token
//! ids and EOS, `max_tokens`, flush / force-finish, and property tests of the emitted text.

use pd_engine::sampling::{FinishReason, SamplingParams, StopChecker, StopReason};
use proptest::prelude::*;

use crate::params;

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
