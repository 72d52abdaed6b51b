//! A body of the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`) as a
//! client can send it, through its parsing and planning into `GenerateRequest`s, and each of
//! those through the router's validation.
//!
//! Properties: nothing panics; a plan has `n` generations per prompt (at most
//! `MAX_GENERATIONS`), unique request ids, and options only where they are allowed (stream
//! options with `stream`); each generation validates into a request that keeps
//! `pd_fuzz::check_valid`'s promises, or is refused with INVALID_ARGUMENT; a refused body
//! says why.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use pd_fuzz::{CONTEXT, check_refusal, check_valid, validator};
use pd_router::openai::request::{Body, Endpoint, MAX_GENERATIONS};

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let endpoint = if which & 1 == 0 {
        Endpoint::ChatCompletions
    } else {
        Endpoint::Completions
    };
    let header_id = (which & 2 != 0).then(|| "header-id".to_string());
    let parsed = match Body::parse(body) {
        Ok(b) => b,
        Err(e) => {
            assert!(!e.0.is_empty(), "a refused body says why");
            return;
        }
    };
    let plan = match parsed.plan(endpoint, header_id.clone(), || "new-id".to_string()) {
        Ok(plan) => plan,
        Err(e) => {
            assert!(!e.0.is_empty(), "a refused body says why");
            return;
        }
    };
    assert_eq!(plan.endpoint, endpoint);
    assert!(plan.n >= 1);
    let inputs = if endpoint == Endpoint::ChatCompletions {
        1
    } else {
        plan.prompts.len()
    };
    assert_eq!(
        plan.requests.len(),
        inputs * plan.n,
        "n generations per prompt"
    );
    assert!(plan.requests.len() <= MAX_GENERATIONS);
    assert!(plan.stream || (!plan.include_usage && !plan.continuous_usage));
    if let Some(id) = &header_id {
        assert_eq!(
            &plan.id, id,
            "the X-Request-Id header names the generations"
        );
    }
    let ids: HashSet<_> = plan.requests.iter().map(|r| r.request_id.clone()).collect();
    assert_eq!(ids.len(), plan.requests.len(), "generation ids are unique");
    let v = validator();
    for req in plan.requests {
        assert!(req.input.is_some(), "every generation has its input");
        match v.validate(req, CONTEXT, || {
            unreachable!("the plan names every generation")
        }) {
            Ok(valid) => check_valid(v, &valid),
            Err(e) => check_refusal(e),
        }
    }
});
