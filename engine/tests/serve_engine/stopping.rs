//! Stop conditions and penalties through the engine: `min_tokens` keeps stop token ids
//! from being sampled or ending a request, on a mixed engine and on a prefill node's single
//! token; frequency and presence penalties and bad words change what greedy decoding
//! chooses.

use pd_engine::sampling::{FinishReason, SamplingParams};
use pd_engine::serve::Role;

use crate::{all_free, config, engine, prompt, req, run_one};

fn greedy(max_tokens: u32) -> Vec<u32> {
    let mut e = engine(64, config());
    let out = run_one(&mut e, req("plain", prompt(3, 9), max_tokens));
    all_free(&e);
    out.tokens
}

#[test]
fn min_tokens_keeps_stop_tokens_out_of_the_first_tokens() {
    let plain = greedy(6);
    let first = plain[0];
    let stopping = |min_tokens: u32, role: Role| {
        let mut r = req("stop", prompt(3, 9), 6);
        r.params.stop_token_ids = vec![first];
        r.params.min_tokens = min_tokens;
        // No decode node will pull: nothing stays leased.
        r.lease_kv = false;
        let mut e = engine(64, crate::EngineConfig { role, ..config() });
        let out = run_one(&mut e, r);
        all_free(&e);
        out
    };
    // Without a minimum the greedy first token is the stop token: one token, stopped.
    let out = stopping(0, Role::Mixed);
    assert_eq!(out.tokens, [first]);
    assert_eq!(out.finished.unwrap().reason, FinishReason::Stop);
    // With one, the first three tokens are anything else, chosen greedily among the rest.
    let out = stopping(3, Role::Mixed);
    assert!(out.tokens.len() >= 3, "{:?}", out.tokens);
    assert!(!out.tokens[..3].contains(&first), "{:?}", out.tokens);
    let reason = out.finished.unwrap().reason;
    if out.tokens.last() == Some(&first) {
        assert_eq!(reason, FinishReason::Stop);
    } else {
        assert_eq!((out.tokens.len(), reason), (6, FinishReason::Length));
    }
    // A prefill node samples one token, under the same mask.
    let out = stopping(1, Role::Prefill);
    assert_eq!(out.tokens.len(), 1);
    assert_ne!(out.tokens[0], first);
}

#[test]
fn frequency_and_presence_penalties_change_greedy_choices() {
    let plain = greedy(24);
    let mut seen = std::collections::HashSet::new();
    assert!(
        plain.iter().any(|t| !seen.insert(*t)),
        "the tiny model repeats itself within 24 tokens: {plain:?}"
    );
    for params in [
        SamplingParams {
            frequency_penalty: 2.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            presence_penalty: 2.0,
            ..SamplingParams::default()
        },
    ] {
        let mut r = req("penalised", prompt(3, 9), 24);
        r.params = SamplingParams {
            max_tokens: 24,
            ignore_eos: true,
            ..params.clone()
        };
        let mut e = engine(64, config());
        let out = run_one(&mut e, r);
        all_free(&e);
        assert_eq!(out.tokens.len(), 24);
        assert_ne!(out.tokens, plain, "{params:?}");
        // The penalties only act once a token is out: the first token is the same.
        assert_eq!(out.tokens[0], plain[0]);
    }
}

#[test]
fn bad_words_are_steered_around() {
    let plain = greedy(6);
    let run = |bad: Vec<Vec<u32>>| {
        let mut r = req("bad", prompt(3, 9), 6);
        r.params.bad_words_token_ids = bad;
        let mut e = engine(64, config());
        let out = run_one(&mut e, r);
        all_free(&e);
        out.tokens
    };
    // A one-token bad word is never produced.
    let out = run(vec![vec![plain[0]]]);
    assert!(!out.contains(&plain[0]), "{out:?}");
    // A two-token one: its first token may come, never followed by its second.
    let out = run(vec![vec![plain[0], plain[1]]]);
    assert_eq!(out[0], plain[0]);
    assert_ne!(out[1], plain[1]);
    assert!(
        !out.windows(2).any(|w| w == [plain[0], plain[1]]),
        "{out:?}"
    );
}
