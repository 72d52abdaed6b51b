//! Conversions between wire messages and engine types, and error → status mapping.

use pd_engine::ErrorKind;
use pd_engine::sampling::{
    FinishReason, PromptLogprob, SampledToken, SamplingParams, StopReason, StructuredOutput,
    TokenLogprob,
};
use pd_engine::serve::{LEASE_SECRET_LEN, LeaseSecret, Role, TierKind, Usage};
use tonic::{Code, Status};

use crate::pb;

/// The one gRPC code of each engine error class. An engine panic is INTERNAL carrying the
/// [`crate::failure::FailureCause::EnginePanic`] marker, so that the router does not retry
/// the request elsewhere.
pub fn status(kind: ErrorKind, message: impl Into<String>) -> Status {
    let code = match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::Internal => Code::Internal,
        ErrorKind::EnginePanic => {
            return crate::failure::FailureCause::EnginePanic.status(Code::Internal, message);
        }
    };
    Status::new(code, message)
}

/// A role on the wire (`NodeInfo.role`). The wire has no value for [`Role::Mixed`]: no node
/// reports one (a decode node reports `Decode`, though its engine is mixed), so it goes out
/// as `ROLE_UNSPECIFIED`, the value the router does not check.
pub fn wire_role(r: Role) -> pb::Role {
    match r {
        Role::Prefill => pb::Role::Prefill,
        Role::Decode => pb::Role::Decode,
        Role::Mixed => pb::Role::Unspecified,
    }
}

/// A role from the wire; `None` for `ROLE_UNSPECIFIED` (a node that does not say).
pub fn role(r: pb::Role) -> Option<Role> {
    match r {
        pb::Role::Prefill => Some(Role::Prefill),
        pb::Role::Decode => Some(Role::Decode),
        pb::Role::Unspecified => None,
    }
}

/// A lease secret from the wire (`KvHandle.lease_secret`, `ReleaseKvRequest.lease_secret`):
/// exactly [`LEASE_SECRET_LEN`] bytes, else INVALID_ARGUMENT naming `field`.
pub fn lease_secret(field: &str, bytes: &[u8]) -> Result<LeaseSecret, Status> {
    LeaseSecret::from_slice(bytes).ok_or_else(|| {
        Status::invalid_argument(format!(
            "{field} must be {LEASE_SECRET_LEN} bytes (the KvHandle's lease_secret), got {}",
            bytes.len()
        ))
    })
}

/// The wire form of a lease secret.
pub fn wire_lease_secret(secret: &LeaseSecret) -> Vec<u8> {
    secret.as_bytes().to_vec()
}

/// Wire sampling fields (plus the request-level ones) into engine parameters, with the
/// documented defaults. Range checks happen in [`SamplingParams::validate`], which the caller
/// runs with the model's vocabulary and caps.
pub fn sampling_params(
    wire: Option<&pb::SamplingParams>,
    max_tokens: u32,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    include_stop_str_in_output: bool,
    skip_special_tokens: bool,
) -> SamplingParams {
    let d = pb::SamplingParams::default();
    let w = wire.unwrap_or(&d);
    SamplingParams {
        temperature: w.temperature.unwrap_or(1.0),
        top_p: w.top_p.unwrap_or(1.0),
        top_k: w.top_k.unwrap_or(0),
        min_p: w.min_p.unwrap_or(0.0),
        repetition_penalty: w.repetition_penalty.unwrap_or(1.0),
        presence_penalty: w.presence_penalty.unwrap_or(0.0),
        frequency_penalty: w.frequency_penalty.unwrap_or(0.0),
        seed: w.seed,
        max_tokens,
        min_tokens: w.min_tokens.unwrap_or(0),
        logit_bias: {
            // In id order, so that two equal requests sample alike whatever the map's order.
            let mut bias: Vec<(u32, f32)> = w.logit_bias.iter().map(|(&k, &v)| (k, v)).collect();
            bias.sort_unstable_by_key(|&(id, _)| id);
            bias
        },
        allowed_token_ids: w.allowed_token_ids.clone(),
        bad_words_token_ids: w
            .bad_words_token_ids
            .iter()
            .map(|seq| seq.ids.clone())
            .collect(),
        stop,
        stop_token_ids,
        ignore_eos,
        logprobs: w.logprobs,
        prompt_logprobs: w.prompt_logprobs,
        include_stop_str_in_output,
        skip_special_tokens,
        structured_output: w.structured_output.as_ref().and_then(structured_output),
    }
}

/// The wire's structured output; `None` when its `kind` is unset (as if absent).
fn structured_output(w: &pb::StructuredOutput) -> Option<StructuredOutput> {
    use pb::structured_output::Kind;
    Some(match w.kind.as_ref()? {
        Kind::Regex(r) => StructuredOutput::Regex(r.clone()),
        Kind::Choice(c) => StructuredOutput::Choice(c.choices.clone()),
        Kind::JsonSchema(s) => StructuredOutput::JsonSchema(s.clone()),
        Kind::Grammar(g) => StructuredOutput::Grammar(g.clone()),
        // `false` asks for nothing; as if unset.
        Kind::JsonObject(true) => StructuredOutput::JsonObject,
        Kind::JsonObject(false) => return None,
    })
}

fn wire_structured_output(s: &StructuredOutput) -> pb::StructuredOutput {
    use pb::structured_output::Kind;
    pb::StructuredOutput {
        kind: Some(match s {
            StructuredOutput::Regex(r) => Kind::Regex(r.clone()),
            StructuredOutput::Choice(c) => Kind::Choice(pb::Choices { choices: c.clone() }),
            StructuredOutput::JsonSchema(s) => Kind::JsonSchema(s.clone()),
            StructuredOutput::JsonObject => Kind::JsonObject(true),
            StructuredOutput::Grammar(g) => Kind::Grammar(g.clone()),
        }),
    }
}

/// Engine parameters back onto the wire (router → node), sampling fields only.
pub fn wire_sampling(p: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: Some(p.temperature),
        top_p: Some(p.top_p),
        top_k: Some(p.top_k),
        min_p: Some(p.min_p),
        repetition_penalty: Some(p.repetition_penalty),
        seed: p.seed,
        logprobs: p.logprobs,
        prompt_logprobs: p.prompt_logprobs,
        presence_penalty: Some(p.presence_penalty),
        frequency_penalty: Some(p.frequency_penalty),
        min_tokens: Some(p.min_tokens),
        logit_bias: p
            .logit_bias
            .iter()
            .fold(Default::default(), |mut map, &(id, bias)| {
                *map.entry(id).or_insert(0.0) += bias;
                map
            }),
        allowed_token_ids: p.allowed_token_ids.clone(),
        bad_words_token_ids: p
            .bad_words_token_ids
            .iter()
            .map(|ids| pb::TokenSequence { ids: ids.clone() })
            .collect(),
        structured_output: p.structured_output.as_ref().map(wire_structured_output),
    }
}

pub fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Abort => pb::FinishReason::Abort,
    }
}

/// The wire form of what stopped a request.
pub fn stop_reason(r: &StopReason) -> pb::generate_response::StopReason {
    match r {
        StopReason::TokenId(id) => pb::generate_response::StopReason::StopTokenId(*id),
        StopReason::Text(s) => pb::generate_response::StopReason::StopString(s.clone()),
    }
}

/// `None` for UNSPECIFIED (not a finished message).
pub fn engine_finish_reason(r: pb::FinishReason) -> Option<FinishReason> {
    match r {
        pb::FinishReason::Unspecified => None,
        pb::FinishReason::Stop => Some(FinishReason::Stop),
        pb::FinishReason::Length => Some(FinishReason::Length),
        pb::FinishReason::Abort => Some(FinishReason::Abort),
    }
}

pub fn usage(u: &Usage) -> pb::Usage {
    let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    pb::Usage {
        prompt_tokens: n(u.prompt_tokens),
        completion_tokens: n(u.completion_tokens),
        cached_tokens: n(u.cached_tokens()),
        local_cached_tokens: n(u.local_cached_tokens),
        external_cached_tokens: n(u.external_cached_tokens),
        external_host_cached_tokens: n(u.external_cached_by_source[TierKind::Host]),
        external_peer_cached_tokens: n(u.external_cached_by_source[TierKind::Peer]),
    }
}

fn top(top: &[TokenLogprob]) -> Vec<pb::TokenLogprob> {
    top.iter()
        .map(|t| pb::TokenLogprob {
            token_id: t.token_id,
            logprob: t.logprob,
        })
        .collect()
}

pub fn logprob(t: &SampledToken) -> pb::Logprob {
    pb::Logprob {
        token_id: t.token_id,
        logprob: t.logprob,
        top: top(&t.top),
    }
}

pub fn prompt_logprob(t: &PromptLogprob) -> pb::Logprob {
    pb::Logprob {
        token_id: t.token_id,
        logprob: t.logprob,
        top: top(&t.top),
    }
}

/// A wire logprob back into the engine's sampled-token shape.
pub fn sampled_token(l: &pb::Logprob) -> SampledToken {
    SampledToken {
        token_id: l.token_id,
        logprob: l.logprob,
        top: l
            .top
            .iter()
            .map(|t| TokenLogprob {
                token_id: t.token_id,
                logprob: t.logprob,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_secrets_are_exactly_sixteen_bytes() {
        let secret = LeaseSecret::random();
        assert_eq!(
            lease_secret("kv.lease_secret", &wire_lease_secret(&secret)).unwrap(),
            secret
        );
        for len in [0, 15, 17, 32] {
            let e = lease_secret("kv.lease_secret", &vec![7; len]).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(
                e.message().contains("kv.lease_secret") && e.message().contains("16 bytes"),
                "{e}"
            );
        }
    }

    #[test]
    fn unset_fields_take_vllm_defaults_and_zero_is_kept_where_set() {
        let p = sampling_params(None, 16, vec![], vec![], false, false, true);
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p),
            (1.0, 1.0, 0, 0.0)
        );
        let w = pb::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        };
        let p = sampling_params(Some(&w), 16, vec![], vec![], false, false, true);
        assert_eq!(
            p.temperature, 0.0,
            "an explicit 0 is greedy, not the default"
        );
        let w = pb::SamplingParams {
            presence_penalty: Some(-0.5),
            frequency_penalty: Some(1.5),
            min_tokens: Some(3),
            logit_bias: [(9, -100.0), (2, 1.5)].into_iter().collect(),
            allowed_token_ids: vec![4, 2, 9],
            bad_words_token_ids: vec![pb::TokenSequence { ids: vec![5, 6] }],
            ..Default::default()
        };
        let p = sampling_params(Some(&w), 16, vec![], vec![], false, false, true);
        assert_eq!(
            (p.presence_penalty, p.frequency_penalty, p.min_tokens),
            (-0.5, 1.5, 3)
        );
        assert_eq!(p.logit_bias, [(2, 1.5), (9, -100.0)], "in id order");
        assert_eq!(p.allowed_token_ids, [4, 2, 9]);
        assert_eq!(p.bad_words_token_ids, [vec![5, 6]]);
        assert_eq!(
            wire_sampling(&p),
            pb::SamplingParams {
                temperature: Some(1.0),
                top_p: Some(1.0),
                top_k: Some(0),
                min_p: Some(0.0),
                repetition_penalty: Some(1.0),
                ..w
            },
            "router → node keeps every field"
        );
        for r in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
        ] {
            assert_eq!(engine_finish_reason(finish_reason(r)), Some(r));
        }
    }
}
