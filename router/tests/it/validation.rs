//! Bad input is refused at the edge with INVALID_ARGUMENT (RESOURCE_EXHAUSTED for an
//! oversized message) and an actionable message, reaches no node, and harms no other request.

use std::sync::atomic::Ordering::SeqCst;

use pd_engine::tokenizer::{ChatMessage, ChatRole, ChatTemplateOptions, ChatTool};
use pd_proto::pb;
use pd_proto::pb::generate_request::Input;
use tonic::Code;

use crate::fake::*;

fn ids(ids: Vec<u32>) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(Input::TokenIds(pb::TokenIds { ids })),
        max_tokens: Some(8),
        ..Default::default()
    }
}

/// `text_request("Hello")` with `edit` applied.
fn hello(edit: impl FnOnce(&mut pb::GenerateRequest)) -> pb::GenerateRequest {
    let mut req = text_request("Hello");
    edit(&mut req);
    req
}

/// `text_request("Hello")` with the sampling parameters that `edit` sets (the others default).
fn sampling(edit: impl FnOnce(&mut pb::SamplingParams)) -> pb::GenerateRequest {
    let mut s = pb::SamplingParams::default();
    edit(&mut s);
    hello(|r| r.sampling = Some(s))
}

fn chat(messages: &[(&str, &str)]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(Input::Chat(pb::ChatInput {
            enable_thinking: Some(false),
            ..pd_test_support::chat_input(messages)
        })),
        max_tokens: Some(8),
        ..Default::default()
    }
}

fn with_tools(mut req: pb::GenerateRequest, tools: &[&str]) -> pb::GenerateRequest {
    if let Some(Input::Chat(c)) = req.input.as_mut() {
        c.tools = tools.iter().map(|t| t.to_string()).collect();
    }
    req
}

const TOOL: &str = r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}"#;

#[tokio::test]
async fn every_bad_input_is_invalid_argument_and_reaches_no_node() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // A request that stays in flight, to show bad ones do not disturb it.
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101]],
        end: End::Hang,
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut busy = text_request("keep going");
    busy.request_id = Some("busy".into());
    let mut busy_stream = client.generate(busy.clone()).await.unwrap().into_inner();
    assert!(busy_stream.message().await.unwrap().is_some());
    let prefills_before = p.state.prefill_count();

    let f = |v: f32| Some(v);
    let cases: Vec<(pb::GenerateRequest, &str)> = vec![
        (
            hello(|r| r.model = "qwen-huge".into()),
            "unknown model `qwen-huge`",
        ),
        (
            pb::GenerateRequest {
                input: None,
                ..text_request("")
            },
            "set exactly one of",
        ),
        (text_request(""), "the prompt is empty"),
        (ids(vec![]), "the prompt is empty"),
        (ids(vec![1; 4096]), "context is 4096 tokens"),
        (ids(vec![5, 151_936]), "outside the vocabulary"),
        (hello(|r| r.max_tokens = Some(0)), "max_tokens must be >= 1"),
        (
            hello(|r| r.max_tokens = Some(4097)),
            "max_tokens must be <= 4096",
        ),
        (
            pb::GenerateRequest {
                max_tokens: Some(200),
                ..ids(vec![1; 4000])
            },
            "exceeds the model's context",
        ),
        (sampling(|s| s.temperature = f(-1.0)), "temperature"),
        (sampling(|s| s.temperature = f(f32::NAN)), "temperature"),
        (sampling(|s| s.top_p = f(0.0)), "top_p must be in (0, 1]"),
        (sampling(|s| s.top_p = f(1.5)), "top_p"),
        (sampling(|s| s.min_p = f(2.0)), "min_p"),
        (
            sampling(|s| s.repetition_penalty = f(0.0)),
            "repetition_penalty",
        ),
        (
            pb::GenerateRequest {
                truncate_prompt_tokens: Some(0),
                ..ids(vec![1, 2, 3])
            },
            "truncate_prompt_tokens must be between 1 and",
        ),
        (
            pb::GenerateRequest {
                truncate_prompt_tokens: Some(1_000_000),
                ..ids(vec![1, 2, 3])
            },
            "truncate_prompt_tokens must be between 1 and",
        ),
        (
            sampling(|s| s.presence_penalty = f(2.5)),
            "presence_penalty must be in [-2, 2]",
        ),
        (
            sampling(|s| s.frequency_penalty = f(f32::NAN)),
            "frequency_penalty",
        ),
        (
            pb::GenerateRequest {
                max_tokens: Some(4),
                ..sampling(|s| s.min_tokens = Some(5))
            },
            "min_tokens must be <= max_tokens (4), got 5",
        ),
        (
            sampling(|s| s.logit_bias = [(151_936, 1.0)].into_iter().collect()),
            "logit_bias names token 151936, out of range",
        ),
        (
            sampling(|s| s.logit_bias = [(5, -101.0)].into_iter().collect()),
            "logit_bias[5] must be in [-100, 100]",
        ),
        (
            sampling(|s| s.allowed_token_ids = vec![1, 151_936]),
            "allowed_token_ids[1] = 151936 is out of range",
        ),
        (
            sampling(|s| s.logprobs = Some(21)),
            "logprobs must be <= 20",
        ),
        (
            sampling(|s| s.prompt_logprobs = Some(99)),
            "prompt_logprobs",
        ),
        (
            hello(|r| r.stop = vec!["".into()]),
            "stop strings must be non-empty",
        ),
        (
            hello(|r| r.stop = vec!["x".into(); 17]),
            "at most 16 stop strings",
        ),
        (
            hello(|r| r.stop_token_ids = vec![7, 200_000]),
            "stop_token_ids[1] = 200000",
        ),
        (chat(&[]), "`chat.messages` is empty"),
        (
            hello(|r| r.bad_words = vec!["x".into(); 129]),
            "at most 128 bad words",
        ),
        (
            with_tools(chat(&[("user", "hi")]), &[TOOL, "{\"type\": "]),
            "chat.tools[1]: not valid JSON",
        ),
        (
            with_tools(chat(&[("user", "hi")]), &["[1, 2]"]),
            "chat.tools[0]: a tool must be a JSON object",
        ),
        (
            with_tools(chat(&[("user", "hi")]), &[TOOL; 129]),
            "chat.tools has 129 tools; at most 128",
        ),
        (
            chat(&[("user", "hi"), ("wizard", "abracadabra")]),
            "chat.messages[1].role is `wizard`",
        ),
        (
            hello(|r| r.request_id = Some(String::new())),
            "request_id must be",
        ),
        (busy.clone(), "request_id `busy` is already in flight"),
        (
            pb::GenerateRequest {
                parse_tool_calls: true,
                tool_call_format: 7,
                ..text_request("Hello")
            },
            "tool_call_format 7 is not a ToolCallFormat",
        ),
        (
            hello(|r| r.tool_call_format = pb::ToolCallFormat::Qwen3Coder as i32),
            "tool_call_format is set but parse_tool_calls is not",
        ),
    ];
    for (request, needle) in cases {
        let status = match collect(&mut client, request.clone()).await {
            Err(status) => status,
            Ok(outcome) => panic!("{request:?} was accepted: {outcome:?}"),
        };
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{request:?}: {status:?}"
        );
        assert!(
            status.message().contains(needle),
            "message `{}` lacks `{needle}`",
            status.message()
        );
    }
    assert_eq!(
        p.state.prefill_count(),
        prefills_before,
        "no bad request reached a node"
    );

    // The request in flight is untouched, and a good request still works.
    assert!(
        client
            .abort(pb::AbortRequest {
                request_id: "busy".into()
            })
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
    let mut last = busy_stream.message().await.unwrap().unwrap();
    while last.finish_reason() == pb::FinishReason::Unspecified {
        last = busy_stream.message().await.unwrap().unwrap();
    }
    assert_eq!(last.finish_reason(), pb::FinishReason::Abort);
    *d.state.script.lock().unwrap() = Script::default();
    let (chunks, error) = collect(&mut client, busy).await.unwrap();
    assert!(error.is_none(), "the id is free again: {error:?}");
    assert_eq!(
        chunks.last().unwrap().finish_reason(),
        pb::FinishReason::Length
    );
}

#[tokio::test]
async fn an_oversized_message_is_resource_exhausted() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.max_message_bytes = 1024;
    let router = RouterUnderTest::start(cfg).await;
    let mut client = router.client();
    let status = collect(&mut client, text_request(&"a".repeat(4096)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--max-message-bytes"),
        "{status:?}"
    );
    // Below the limit all is well.
    let (_, error) = collect(&mut client, text_request(&"a".repeat(100)))
        .await
        .unwrap();
    assert!(error.is_none());
    assert_eq!(p.state.prefill_count(), 1);
}

#[tokio::test]
async fn unset_max_tokens_is_the_cap_or_the_room_left() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.max_tokens_cap = 100;
    let router = RouterUnderTest::start(cfg).await;
    let mut client = router.client();
    let mut req = ids(vec![1; 10]);
    req.max_tokens = None;
    collect(&mut client, req).await.unwrap();
    let mut req = ids(vec![1; 4090]);
    req.max_tokens = None;
    collect(&mut client, req).await.unwrap();
    let sent: Vec<u32> = d
        .state
        .decodes
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.max_tokens)
        .collect();
    assert_eq!(sent, [100, 6]);
}

#[tokio::test]
async fn the_context_follows_the_nodes_max_model_len() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    d.state.max_model_len.store(2048, SeqCst);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    eventually("the router knows the decode node's limit", || {
        router.registry.context_len(4096) == 2048
    })
    .await;
    let mut client = router.client();
    let models = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models;
    assert_eq!(models[0].max_model_len, 2048);
    let status = collect(&mut client, ids(vec![1; 3000])).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("context is 2048 tokens"),
        "{status:?}"
    );
}

#[tokio::test]
async fn chat_input_is_rendered_with_the_template() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let request = with_tools(
        chat(&[("system", "Be brief."), ("user", "What is 2+2?")]),
        &[TOOL],
    );
    let (_, error) = collect(&mut client, request).await.unwrap();
    assert!(error.is_none());
    let rendered = tok
        .apply_chat_template_with(
            &[
                ChatMessage::new(ChatRole::System, "Be brief."),
                ChatMessage::new(ChatRole::User, "What is 2+2?"),
            ],
            &ChatTemplateOptions {
                add_generation_prompt: true,
                enable_thinking: Some(false),
                tools: vec![ChatTool::from_json(TOOL).unwrap()],
            },
        )
        .unwrap();
    assert!(
        rendered.ends_with("<think>\n\n</think>\n\n"),
        "{rendered:?}"
    );
    // The tool as the client wrote it, key order included.
    assert!(
        rendered.contains(&format!("<tools>\n{TOOL}\n</tools>")),
        "{rendered:?}"
    );
    let sent = p.state.prefills.lock().unwrap()[0].token_ids.clone();
    assert_eq!(sent, tok.encode(&rendered).unwrap());
}

#[tokio::test]
async fn tokenize_and_list_models() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let text = "Hello, world! <|im_start|>héllo";
    let response = client
        .tokenize(pb::TokenizeRequest {
            model: String::new(),
            text: text.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.ids, tok.encode(text).unwrap());
    let named = client
        .tokenize(pb::TokenizeRequest {
            model: "synthetic:tiny".into(),
            text: "x".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(named.ids, tok.encode("x").unwrap());
    let status = client
        .tokenize(pb::TokenizeRequest {
            model: "gpt-5".into(),
            text: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("synthetic:tiny"));

    let models = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models;
    assert_eq!(
        models,
        [pb::ModelCard {
            name: "synthetic:tiny".into(),
            max_model_len: 4096,
            vocab_size: 151_936,
        }]
    );
}
