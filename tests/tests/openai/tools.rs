//! Chat answers read for reasoning and tool calls (the router's Hermes parser), whole and
//! streamed, over HTTP and gRPC: the call's arguments stream as they are written, one call is
//! kept when parallel calls are off, an echo streams its prompt's logprobs, and a client that
//! hangs up while a call is open cancels at once.

use http_body_util::BodyExt as _;
use pd_proto::pb;
use pd_tests::{http_open, http_post, sse_data};
use serde_json::{Value, json};

use crate::{grpc_text, hermes, outcomes, post_ok};

/// The one tool of these tests: the weather in a city.
pub(crate) fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

/// The weights are random: a regex makes the model think, say a word and call a tool.
pub(crate) const ANSWER: &str = "<think>\nThe user wants weather\\.\n</think>\n\nLet me check\\.\n<tool_call>\n\
                  \\{\"name\": \"get_weather\", \"arguments\": \\{\"city\": \"Paris\"\\}\\}\n</tool_call>";

pub(crate) fn user() -> Value {
    json!({"role": "user", "content": "Weather in Paris?"})
}

/// The chat request whose answer [`ANSWER`] makes: reasoning, a word, one call.
pub(crate) fn weather_request() -> Value {
    json!({
        "messages": [user()], "tools": weather_tools(), "guided_regex": ANSWER,
        "max_tokens": 120, "temperature": 0,
    })
}

/// The answer [`ANSWER`] makes, read: reasoning, content, one call; streamed, the same
/// pieces, the call whole with its index, one finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_answer_is_read_for_reasoning_and_a_tool_call_whole_and_streamed() {
    let t = hermes().await;
    let request = weather_request();
    let v = post_ok(&t.base, "/chat/completions", request.clone()).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let message = &choice["message"];
    assert_eq!(message["reasoning_content"], "The user wants weather.");
    assert_eq!(message["content"], "Let me check.");
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], r#"{"city": "Paris"}"#);
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1);

    // Streamed: the same pieces, the call whole with its index, one finish.
    let (text, (reasoning, content, calls, finishes)) = stream_chat(&t.base, &request).await;
    assert_eq!(reasoning, "The user wants weather.");
    assert_eq!(content, "Let me check.");
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"], call["function"]);
    assert_eq!(finishes, ["tool_calls"]);
    t.end_free().await;
}

/// The gRPC API reads the same answer the same way when the request asks (its own
/// flags, not the router's): reasoning, content, and the call's pieces joined by index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_reads_the_same_answer_when_the_request_asks() {
    let mut t = hermes().await;
    let tools = weather_tools();
    let answer = ANSWER;
    let grpc_request = |parse: bool| pb::GenerateRequest {
        parse_reasoning: parse,
        parse_tool_calls: parse,
        ..weather_by_regex(&tools[0], answer, 120)
    };
    let mut stream = t
        .grpc
        .generate(grpc_request(true))
        .await
        .unwrap()
        .into_inner();
    let (mut reasoning, mut content, mut arguments) = (String::new(), String::new(), String::new());
    let mut heads = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        reasoning.push_str(&chunk.reasoning);
        content.push_str(&chunk.text);
        for part in chunk.tool_calls {
            assert_eq!(part.index, 0);
            if let Some(name) = part.name {
                heads.push((name, part.id.expect("a call's first piece has its id")));
            } else {
                assert!(part.id.is_none());
            }
            arguments.push_str(&part.arguments);
        }
    }
    assert_eq!(reasoning, "The user wants weather.");
    assert_eq!(content, "Let me check.");
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert_eq!(heads[0].0, "get_weather");
    assert!(heads[0].1.starts_with("call-"), "{heads:?}");
    assert_eq!(arguments, r#"{"city": "Paris"}"#);
    // Unasked: the text as the model wrote it.
    let plain = grpc_text(&mut t.grpc, grpc_request(false)).await;
    assert!(
        plain.starts_with("<think>") && plain.contains("</tool_call>"),
        "{plain}"
    );
    t.end_free().await;
}

/// The arguments stream as they are written: an answer cut off inside them (`length`)
/// has the call with the arguments written so far, whole and streamed alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_off_inside_its_arguments_has_what_was_written_whole_and_streamed() {
    let t = hermes().await;
    let request = weather_request();
    let v = post_ok(&t.base, "/chat/completions", request.clone()).await;
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    let mut cut_inside = 0;
    for max_tokens in tokens.saturating_sub(10)..tokens {
        let mut cut = request.clone();
        cut["max_tokens"] = json!(max_tokens);
        let v = post_ok(&t.base, "/chat/completions", cut.clone()).await;
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "length", "{v}");
        let calls = choice["message"]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        cut["stream"] = json!(true);
        let (_, text) = http_post(&t.base, "/chat/completions", &cut).await.unwrap();
        let (_, streamed_content, streamed, _) = accumulate(&sse_data(&text));
        assert_eq!(
            streamed_content,
            choice["message"]["content"].as_str().unwrap_or("")
        );
        assert_eq!(streamed.len(), calls.len(), "{text}");
        // Cut inside the block's head: not a call (yet), the block stays text.
        let Some(part) = calls.first() else {
            assert!(
                streamed_content.starts_with("Let me check.\n<tool_call>"),
                "{v}"
            );
            continue;
        };
        assert_eq!(choice["message"]["content"], "Let me check.", "{v}");
        assert_eq!(part["function"]["name"], "get_weather", "{v}");
        assert_eq!(streamed[0]["function"], part["function"]);
        let written = part["function"]["arguments"].as_str().unwrap();
        let whole = r#"{"city": "Paris"}"#;
        assert!(whole.starts_with(written), "{written:?}");
        cut_inside += usize::from(!written.is_empty() && written != whole);
    }
    assert!(cut_inside > 0, "no cut fell inside the arguments");
    t.end_free().await;
}

/// parallel_tool_calls: false keeps the first call of an answer that made two, whole and
/// streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed() {
    let t = hermes().await;
    let (request, answer) = (weather_request(), ANSWER);
    let v = post_ok(&t.base, "/chat/completions", request.clone()).await;
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    let twice = format!(
        "{answer}\n{}",
        &answer[answer.find("<tool_call>").unwrap()..]
    );
    let mut single = request.clone();
    single["guided_regex"] = json!(twice);
    let v = post_ok(&t.base, "/chat/completions", single.clone()).await;
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "{v}"
    );
    single["parallel_tool_calls"] = json!(false);
    let v = post_ok(&t.base, "/chat/completions", single.clone()).await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(message["tool_calls"][0]["function"], call["function"]);
    assert_eq!(message["content"], "Let me check.");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    single["stream"] = json!(true);
    let (_, text) = http_post(&t.base, "/chat/completions", &single)
        .await
        .unwrap();
    let (_, _, calls, _) = accumulate(&sse_data(&text));
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["function"], call["function"]);
    t.end_free().await;
}

/// Aggregated mode sends a prompt's logprobs on the last message: a streamed echo with
/// logprobs still starts with the prompt's tokens and adds up to the whole response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_echo_streams_the_prompt_s_logprobs_and_adds_up_to_the_whole_response() {
    let t = hermes().await;
    let echo = json!({"prompt": "Hello world, this is a test", "echo": true, "logprobs": 1,
        "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let whole = post_ok(&t.base, "/completions", echo.clone()).await;
    let mut streamed = echo.clone();
    streamed["stream"] = json!(true);
    let (status, text) = http_post(&t.base, "/completions", &streamed).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let (mut text_sum, mut tokens) = (String::new(), Vec::new());
    for e in sse_data(&text).iter().filter(|e| e.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(e).unwrap();
        let choice = &chunk["choices"][0];
        text_sum.push_str(choice["text"].as_str().unwrap());
        tokens.extend(
            choice["logprobs"]["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .cloned(),
        );
    }
    let choice = &whole["choices"][0];
    assert_eq!(text_sum, choice["text"].as_str().unwrap());
    assert_eq!(json!(tokens), choice["logprobs"]["tokens"]);
    let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(tokens.len(), prompt_tokens + 4, "{whole}");
    t.end_free().await;
}

/// A client that hangs up while the parser holds an open tool call (nothing is sent for
/// thousands of tokens) still cancels at once, not when the answer ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_a_call_is_open_cancels_at_once() {
    let t = hermes().await;
    let (user, tools) = (user(), weather_tools());
    let cancelled = outcomes(t.cluster, "cancelled").await;
    let open_call = json!({
        "messages": [user], "tools": tools, "guided_regex": "<tool_call>[a-z]*",
        "max_tokens": 3000, "temperature": 0, "stream": true,
    });
    let response = http_open(
        "POST",
        &t.base,
        "/chat/completions",
        open_call.to_string().into_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let roles = body.frame().await.expect("the role chunk").unwrap();
    assert!(roles.data_ref().is_some_and(|d| d.starts_with(b"data: ")));
    drop(body);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while outcomes(t.cluster, "cancelled").await - cancelled < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hang-up was not noticed while the parser held the call"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    t.end_free().await;
}

/// What a streamed chat choice adds up to: reasoning, content, tool calls (their parts joined
/// as OpenAI's clients join them: by `index`, the first part naming the call, the arguments'
/// text added up), finish reasons.
/// `request` sent with `"stream": true`: the stream's text, and what [`accumulate`] makes of
/// it.
pub(crate) async fn stream_chat(
    base: &str,
    request: &Value,
) -> (String, (String, String, Vec<Value>, Vec<String>)) {
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (status, text) = http_post(base, "/chat/completions", &streamed)
        .await
        .unwrap();
    assert_eq!(status, 200, "{text}");
    let parts = accumulate(&sse_data(&text));
    (text, parts)
}

pub(crate) fn accumulate(events: &[String]) -> (String, String, Vec<Value>, Vec<String>) {
    let (mut reasoning, mut content, mut calls, mut finishes) = (
        String::new(),
        String::new(),
        Vec::<Value>::new(),
        Vec::new(),
    );
    for e in events.iter().filter(|e| e.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(e).unwrap();
        for choice in chunk["choices"].as_array().unwrap() {
            let delta = &choice["delta"];
            reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(delta["content"].as_str().unwrap_or(""));
            for part in delta["tool_calls"].as_array().into_iter().flatten() {
                let index = part["index"].as_u64().unwrap() as usize;
                let arguments = part["function"]["arguments"].as_str().unwrap();
                if index == calls.len() {
                    // A call's first part: id, type and name, and arguments (maybe "").
                    assert!(
                        part["id"].is_string() && part["type"] == "function",
                        "{part}"
                    );
                    assert!(part["function"]["name"].is_string(), "{part}");
                    calls.push(part.clone());
                } else {
                    // A later part: its call's index and more of the arguments, nothing else.
                    assert_eq!(index + 1, calls.len(), "{part}");
                    assert!(part.get("id").is_none() && part["function"].get("name").is_none());
                    let joined = format!(
                        "{}{arguments}",
                        calls[index]["function"]["arguments"].as_str().unwrap()
                    );
                    calls[index]["function"]["arguments"] = json!(joined);
                }
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finishes.push(f.to_string());
            }
        }
    }
    (reasoning, content, calls, finishes)
}

/// A gRPC chat request asking for the weather in Paris with `tool`, its answer made `answer`
/// (a regex: the weights are random), greedy.
pub(crate) fn weather_by_regex(tool: &Value, answer: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatInput {
            tools: vec![tool.to_string()],
            ..pd_test_support::chat_input(&[("user", "Weather in Paris?")])
        })),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            structured_output: Some(pb::StructuredOutput {
                kind: Some(pb::structured_output::Kind::Regex(answer.into())),
            }),
            ..Default::default()
        }),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}
