//! Structured outputs over HTTP: JSON objects (`response_format`, free-form schemas) and
//! grammars (GBNF), their outputs checked against what they ask, over gRPC alike; a grammar
//! that cannot be used is refused in the gRPC API's words.

use pd_proto::pb;
use pd_tests::greedy;
use serde_json::{Value, json};

use crate::{grpc_text, plain, post_err, post_ok, sampled};

/// Any JSON object: response_format json_object, or a schema that asks for nothing more
/// (as a regex it would pass the same cap). Quotes and braces are favoured so the random
/// model closes its object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_json_object_is_guided_into_a_json_object() {
    let t = plain().await;
    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let [quote, brace] = ["\"", "}"].map(|t| tokenizer.encode(t).unwrap()[0].to_string());
    let mut objects = 0;
    for (seed, format) in [
        json!({"type": "json_object"}),
        json!({"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}),
    ]
    .into_iter()
    .cycle()
    .take(6)
    .enumerate()
    {
        let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 48,
            "temperature": 1, "seed": seed, "response_format": format,
            "logit_bias": {quote.clone(): 8, brace.clone(): 6}});
        let whole = post_ok(&t.base, "/chat/completions", body).await;
        let choice = &whole["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap();
        if choice["finish_reason"] == "stop" {
            serde_json::from_str::<serde_json::Map<String, Value>>(content)
                .unwrap_or_else(|e| panic!("seed {seed}: {e}: {content}"));
            objects += usize::from(content != "{}");
        } else {
            assert!(content.starts_with('{'), "seed {seed}: {content}");
        }
    }
    assert!(objects > 0, "no JSON object with members was closed");
    t.end_free().await;
}

/// A schema with a free-form part (pydantic's `dict[str, Any]`): guided, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_with_a_free_form_part_is_guided_not_refused() {
    let t = plain().await;
    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let [quote, brace] = ["\"", "}"].map(|t| tokenizer.encode(t).unwrap()[0].to_string());
    let schema = json!({"type": "object", "properties": {"meta": {"type": "object",
        "additionalProperties": true}, "id": {"type": "integer"}}, "required": ["meta", "id"]});
    let mut closed = 0;
    for seed in 0..4 {
        let body = json!({"prompt": "x", "max_tokens": 48, "temperature": 1, "seed": seed,
            "guided_json": schema, "logit_bias": {quote.clone(): 8, brace.clone(): 6}});
        let whole = post_ok(&t.base, "/completions", body).await;
        let choice = &whole["choices"][0];
        let text = choice["text"].as_str().unwrap();
        assert!(text.starts_with("{"), "seed {seed}: {text}");
        if choice["finish_reason"] == "stop" {
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
            assert!(value["meta"].is_object() && value["id"].is_i64(), "{text}");
            closed += 1;
        }
    }
    assert!(closed > 0, "no output of the free-form schema was closed");
    t.end_free().await;
}

/// A grammar (GBNF; nested parentheses, which no regex holds), over HTTP and gRPC alike:
/// every output a prefix of a text it matches, a whole one where it stopped by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_guides_http_and_grpc_alike_to_prefixes_of_what_it_matches() {
    let mut t = plain().await;
    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let grammar = "root ::= \"(\" inner \")\"\ninner ::= ([a-z] | \"(\" inner \")\")*";
    let close = tokenizer.encode(")").unwrap()[0];
    // The depth of parentheses open at the end; `None` past a whole match or off the grammar.
    let depth = |text: &str| -> Option<u32> {
        let mut depth = 0u32;
        for (i, c) in text.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 && i + 1 < text.len() {
                        return None;
                    }
                }
                'a'..='z' if depth > 0 => {}
                _ => return None,
            }
        }
        (!text.is_empty()).then_some(depth)
    };
    let mut matched = 0;
    for seed in 0..4 {
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 40, "temperature": 1,
            "seed": seed, "structured_outputs": {"grammar": grammar},
            "logit_bias": {close.to_string(): 8}});
        let whole = post_ok(&t.base, "/completions", body).await;
        let choice = &whole["choices"][0];
        let text = choice["text"].as_str().unwrap();
        let open = depth(text).unwrap_or_else(|| panic!("seed {seed}: {text:?}"));
        if choice["finish_reason"] == "stop" {
            assert_eq!(open, 0, "seed {seed}: {text:?}");
            matched += 1;
        }
        let mut req = sampled(vec![1, 2, 3], 40, seed);
        req.ignore_eos = false;
        let sampling = req.sampling.as_mut().unwrap();
        sampling.logit_bias = [(close, 8.0)].into();
        sampling.structured_output = Some(pb::StructuredOutput {
            kind: Some(pb::structured_output::Kind::Grammar(grammar.into())),
        });
        assert_eq!(grpc_text(&mut t.grpc, req).await, text, "seed {seed}");
    }
    assert!(matched > 0, "no output of the grammar was closed");
    t.end_free().await;
}

/// A grammar that cannot be used: refused by the router with what is wrong, in the words
/// the gRPC API uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_that_cannot_be_used_is_refused_in_the_grpc_api_s_words() {
    let mut t = plain().await;
    let (status, message) = post_err(
        &t.base,
        "/completions",
        json!({"prompt": "x", "guided_grammar": "root ::= \"a\" item"}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        message.contains("the rule `item` at byte 13 is not defined"),
        "{message}"
    );
    let mut bad = greedy(vec![1, 2, 3], 4);
    bad.ignore_eos = false;
    bad.sampling = Some(pb::SamplingParams {
        structured_output: Some(pb::StructuredOutput {
            kind: Some(pb::structured_output::Kind::Grammar(
                "root ::= \"a\" item".into(),
            )),
        }),
        ..Default::default()
    });
    let status = t.grpc.generate(bad).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(status.message(), message);
    t.end_free().await;
}
