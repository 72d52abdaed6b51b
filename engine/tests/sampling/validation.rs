//! `SamplingParams::validate`: accepted boundaries, every rejection and its message, and
//! serde defaults / round trip.

use pd_engine::sampling::{MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingError, SamplingParams};

use crate::{VOCAB, params};

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
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        seed: Some(u64::MAX),
        max_tokens: 4096,
        min_tokens: 4096,
        logit_bias: vec![(0, -100.0); pd_engine::sampling::MAX_LOGIT_BIAS],
        allowed_token_ids: vec![VOCAB as u32 - 1, 0],
        bad_words_token_ids: vec![vec![VOCAB as u32 - 1; 64]; 128],
        stop: vec!["x".into(); MAX_STOP_STRINGS],
        stop_token_ids: vec![0, VOCAB as u32 - 1],
        ignore_eos: true,
        logprobs: Some(MAX_LOGPROBS),
        prompt_logprobs: Some(MAX_LOGPROBS),
        include_stop_str_in_output: true,
        skip_special_tokens: false,
        structured_output: None,
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
fn validate_presence_and_frequency_penalties() {
    for v in [2.0001, -2.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = invalid(SamplingParams {
            presence_penalty: v,
            ..params()
        });
        assert!(
            matches!(e, SamplingError::InvalidPresencePenalty(_)),
            "{v}: {e}"
        );
        let e = invalid(SamplingParams {
            frequency_penalty: v,
            ..params()
        });
        assert!(
            matches!(e, SamplingError::InvalidFrequencyPenalty(_)),
            "{v}: {e}"
        );
    }
    let e = invalid(SamplingParams {
        frequency_penalty: 3.0,
        ..params()
    });
    assert_eq!(
        e.to_string(),
        "frequency_penalty must be in [-2, 2] (0 disables it), got 3"
    );
}

#[test]
fn validate_logit_bias_and_allowed_token_ids() {
    let bias = |logit_bias: Vec<(u32, f32)>| {
        invalid(SamplingParams {
            logit_bias,
            ..params()
        })
    };
    assert_eq!(
        bias(vec![(1, 0.0); 1025]).to_string(),
        "logit_bias may hold at most 1024 entries, got 1025"
    );
    assert_eq!(
        bias(vec![(3, 1.0), (VOCAB as u32, 1.0)]).to_string(),
        "logit_bias names token 1000, out of range: the vocabulary has 1000 tokens (ids 0..1000)"
    );
    assert_eq!(
        bias(vec![(3, 100.5)]).to_string(),
        "logit_bias[3] must be in [-100, 100], got 100.5"
    );
    assert!(matches!(
        bias(vec![(3, f32::NAN)]),
        SamplingError::InvalidLogitBias { token_id: 3, .. }
    ));
    let e = invalid(SamplingParams {
        allowed_token_ids: vec![5, 6, 1000],
        ..params()
    });
    assert_eq!(
        e.to_string(),
        "allowed_token_ids[2] = 1000 is out of range: the vocabulary has 1000 tokens (ids 0..1000)"
    );
}

#[test]
fn validate_bad_words() {
    let bad = |bad_words_token_ids: Vec<Vec<u32>>| {
        invalid(SamplingParams {
            bad_words_token_ids,
            ..params()
        })
        .to_string()
    };
    assert_eq!(
        bad(vec![vec![1]; 129]),
        "at most 128 bad words are allowed, got 129"
    );
    assert_eq!(
        bad(vec![vec![1], vec![]]),
        "bad word 1 must be 1 to 64 token ids of the vocabulary (ids 0..1000), got []"
    );
    assert!(bad(vec![vec![2; 65]]).starts_with("bad word 0 must be"));
    assert!(bad(vec![vec![3, 1000]]).ends_with("got [3, 1000]"));
}

#[test]
fn validate_min_tokens() {
    let e = invalid(SamplingParams {
        max_tokens: 8,
        min_tokens: 9,
        ..params()
    });
    assert_eq!(
        e,
        SamplingError::MinTokensAboveMaxTokens {
            min_tokens: 9,
            max_tokens: 8
        }
    );
    assert_eq!(e.to_string(), "min_tokens must be <= max_tokens (8), got 9");
    SamplingParams {
        max_tokens: 8,
        min_tokens: 8,
        ..params()
    }
    .validate(VOCAB, 4096)
    .unwrap();
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

#[test]
fn a_structured_output_is_checked_and_refused_with_what_moves_its_end() {
    use pd_engine::sampling::{StructuredError, StructuredOutput};
    let with = |s: StructuredOutput| SamplingParams {
        structured_output: Some(s),
        ..params()
    };
    with(StructuredOutput::Regex("[a-z]+".into()))
        .validate(VOCAB, 4096)
        .unwrap();
    with(StructuredOutput::JsonSchema(r#"{"type": "string"}"#.into()))
        .validate(VOCAB, 4096)
        .unwrap();
    assert!(matches!(
        with(StructuredOutput::Regex("[a-z".into())).validate(VOCAB, 4096),
        Err(SamplingError::Structured(StructuredError::Regex(_)))
    ));
    assert!(matches!(
        with(StructuredOutput::Choice(vec![])).validate(VOCAB, 4096),
        Err(SamplingError::Structured(StructuredError::Empty(_)))
    ));
    let e = SamplingParams {
        ignore_eos: true,
        ..with(StructuredOutput::Regex("a".into()))
    }
    .validate(VOCAB, 4096)
    .unwrap_err();
    assert_eq!(e, SamplingError::StructuredWith("ignore_eos"));
    assert!(
        e.to_string().contains("cannot be combined with ignore_eos"),
        "{e}"
    );
    let e = SamplingParams {
        min_tokens: 1,
        ..with(StructuredOutput::Regex("a".into()))
    }
    .validate(VOCAB, 4096)
    .unwrap_err();
    assert_eq!(e, SamplingError::StructuredWith("min_tokens"));
}
