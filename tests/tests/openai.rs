//! The router's OpenAI-compatible HTTP API on a real cluster (`pdctl up`): it serves what
//! the gRPC API serves for the same request, streams what it would answer whole, refuses bad
//! bodies with OpenAI's error object, and a client that hangs up mid-stream cancels its
//! generation and frees every block.

use http_body_util::BodyExt as _;
use pd_proto::pb;
use pd_tests::{
    Cluster, all_blocks_free, client, exposition, greedy, http_open, http_post, nodes_sum,
    spread_prompts, sse_data,
};
use serde_json::{Value, json};
use tonic::transport::Channel;

type Grpc = pb::generation_client::GenerationClient<Channel>;

/// The whole text a gRPC request streams.
async fn grpc_text(grpc: &mut Grpc, req: pb::GenerateRequest) -> String {
    let mut stream = grpc
        .generate(req)
        .await
        .expect("gRPC generate")
        .into_inner();
    let mut text = String::new();
    while let Some(chunk) = stream.message().await.expect("gRPC stream") {
        text.push_str(&chunk.text);
    }
    text
}

/// A successful response's JSON.
async fn post_ok(base: &str, path: &str, body: Value) -> Value {
    let (status, text) = http_post(base, path, &body).await.expect("HTTP request");
    assert_eq!(status, 200, "{path} {body}: {text}");
    serde_json::from_str(&text).expect("a JSON response")
}

/// A refusal: its status and message.
async fn post_err(base: &str, path: &str, body: Value) -> (u16, String) {
    let (status, text) = http_post(base, path, &body).await.expect("HTTP request");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("JSON error: {text}"));
    let message = v["error"]["message"].as_str().expect("error.message");
    assert_eq!(v["error"]["code"], status, "{text}");
    (status, message.to_string())
}

fn sampled(ids: Vec<u32>, max_tokens: u32, seed: u64) -> pb::GenerateRequest {
    let mut req = greedy(ids, max_tokens);
    req.sampling = Some(pb::SamplingParams {
        temperature: Some(1.0),
        seed: Some(seed),
        ..Default::default()
    });
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_api_serves_what_grpc_serves_and_a_hang_up_cancels() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &["--prefill", "1", "--decode", "1"]).unwrap();
    let base = cluster.openai();
    let mut grpc = client(&cluster.router()).await;
    let mut prompts = spread_prompts(2, 40, 9, 71);
    let (a, b) = (prompts.remove(0), prompts.remove(0));

    // Completions, whole: the text of the same gRPC request; usage counts; the prompt again
    // shows the prefill node's cache hits as cached tokens.
    let want_a = grpc_text(&mut grpc, greedy(a.clone(), 12)).await;
    let body = json!({"prompt": a, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let v = post_ok(&base, "/completions", body.clone()).await;
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want_a.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], a.len());
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], a.len() + 12);
    let whole_blocks = (a.len() - 1) / 16 * 16;
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], whole_blocks,
        "the gRPC request computed this prompt first: {v}"
    );

    // Completions, streamed: the same text in pieces, one finish, the usage, [DONE].
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, text) = http_post(&base, "/completions", &streamed).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let events = sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let pieces: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(pieces, want_a);
    let finishes = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .count();
    assert_eq!(finishes, 1, "{text}");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);

    // Special tokens (here `<|im_start|>`, forced by a bias) are left out of the text unless
    // skip_special_tokens is false, over HTTP and gRPC alike; their ids are there either way.
    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let start = tokenizer.token_id("<|im_start|>").unwrap();
    let forced = json!({"prompt": a, "max_tokens": 3, "temperature": 0,
        "logit_bias": {start.to_string(): 100}, "logprobs": 1});
    let v = post_ok(&base, "/completions", forced.clone()).await;
    assert_eq!(v["choices"][0]["text"], "", "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"],
        json!(vec!["<|im_start|>"; 3])
    );
    let mut kept = forced.clone();
    kept["skip_special_tokens"] = json!(false);
    let v = post_ok(&base, "/completions", kept).await;
    assert_eq!(v["choices"][0]["text"], "<|im_start|>".repeat(3), "{v}");
    let mut wire = greedy(a.clone(), 3);
    wire.sampling
        .as_mut()
        .unwrap()
        .logit_bias
        .insert(start, 100.0);
    assert_eq!(grpc_text(&mut grpc, wire.clone()).await, "");
    wire.skip_special_tokens = Some(false);
    assert_eq!(grpc_text(&mut grpc, wire).await, "<|im_start|>".repeat(3));

    // Chat: the text of the same conversation over gRPC.
    let messages = [("system", "Answer briefly."), ("user", "Name a colour.")];
    let wire = pb::ChatInput {
        messages: messages
            .iter()
            .map(|(role, content)| pb::ChatMessage {
                role: role.to_string(),
                content: content.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let mut chat_req = greedy(Vec::new(), 8);
    chat_req.input = Some(pb::generate_request::Input::Chat(wire));
    let want_chat = grpc_text(&mut grpc, chat_req).await;
    let v = post_ok(
        &base,
        "/chat/completions",
        json!({
            "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
            "max_tokens": 8, "temperature": 0, "ignore_eos": true,
        }),
    )
    .await;
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want_chat.as_str());

    let root = base.trim_end_matches("/v1");
    // /tokenize counts a conversation as the chat request was counted, and text as the gRPC
    // Tokenize does; /detokenize gives the text back.
    let chat_prompt_tokens = v["usage"]["prompt_tokens"].clone();
    let t = post_ok(
        root,
        "/tokenize",
        json!({"messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>()}),
    )
    .await;
    assert_eq!(t["count"], chat_prompt_tokens);
    assert_eq!(t["max_model_len"], 4096);
    let t = post_ok(root, "/tokenize", json!({"prompt": "Hello world"})).await;
    let ids = grpc
        .tokenize(pb::TokenizeRequest {
            model: String::new(),
            text: "Hello world".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .ids;
    assert_eq!(t["tokens"], json!(ids));
    let d = post_ok(root, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(d["prompt"], "Hello world");
    let (status, _) = post_err(root, "/tokenize", json!({"prompt": "x", "messages": []})).await;
    assert_eq!(status, 400);

    // n choices with a seed: choice i is the seed + i generation; two prompts are
    // prompt-major. Choices after the first start once its first token is out, so they find
    // the prompt in the prefill node's cache.
    let hits = || nodes_sum(&cluster, "prefill", "vllm:prefix_cache_hits_total", &[]);
    let hits_before = hits().await;
    let v = post_ok(
        &base,
        "/completions",
        json!({"prompt": b, "n": 3, "seed": 5, "temperature": 1, "max_tokens": 6, "ignore_eos": true}),
    )
    .await;
    assert_eq!(
        hits().await - hits_before,
        (2 * ((b.len() - 1) / 16 * 16)) as f64,
        "choices 1 and 2 reuse choice 0's prompt"
    );
    for i in 0..3 {
        let want = grpc_text(&mut grpc, sampled(b.clone(), 6, 5 + i)).await;
        assert_eq!(
            v["choices"][i as usize]["text"],
            want.as_str(),
            "choice {i}"
        );
        assert_eq!(v["choices"][i as usize]["index"], i);
    }
    assert_eq!(
        v["usage"]["prompt_tokens"],
        b.len(),
        "n counts the prompt once"
    );
    assert_eq!(v["usage"]["completion_tokens"], 18);
    let want_b = grpc_text(&mut grpc, greedy(b.clone(), 5)).await;
    let v = post_ok(
        &base,
        "/completions",
        json!({"prompt": [a, b], "n": 2, "temperature": 0, "max_tokens": 5, "ignore_eos": true}),
    )
    .await;
    let texts: Vec<&str> = (0..4)
        .map(|i| v["choices"][i]["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts[0], texts[1]);
    assert_eq!(texts[2], want_b);
    assert_eq!(texts[3], want_b);
    assert_eq!(v["usage"]["prompt_tokens"], a.len() + b.len());

    // Refusals: OpenAI's error object with the status of what went wrong.
    let (status, _) = post_err(&base, "/completions", json!("not an object")).await;
    assert_eq!(status, 400);
    let (status, message) = post_err(
        &base,
        "/completions",
        json!({"prompt": "x", "temprature": 0.5}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(message.contains("temprature"), "{message}");
    let (status, message) = post_err(
        &base,
        "/completions",
        json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(message.contains("/v1/chat/completions"), "{message}");
    // The same words as the gRPC API's for the same value.
    let mut bad = greedy(vec![1, 2, 3], 4);
    bad.sampling.as_mut().unwrap().temperature = Some(-1.0);
    let grpc_message = grpc.generate(bad).await.unwrap_err().message().to_string();
    let (status, message) = post_err(
        &base,
        "/completions",
        json!({"prompt": [1, 2, 3], "temperature": -1}),
    )
    .await;
    assert_eq!((status, message), (400, grpc_message));
    // Refused by the node, not the router (an automaton over the node's 1,024-state cap):
    // streamed or not, the request's own status and OpenAI's error object, not a 200 stream.
    for stream in [false, true] {
        let (status, message) = post_err(
            &base,
            "/completions",
            json!({"prompt": "x", "guided_regex": "[ab]*a[ab]{10}", "stream": stream}),
        )
        .await;
        assert_eq!(status, 400, "stream {stream}: {message}");
        assert!(message.contains("1024 states"), "{message}");
    }
    let forced = json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f"}}]});
    let (status, message) = post_err(&base, "/chat/completions", forced).await;
    assert_eq!(status, 400);
    assert!(message.contains("--tool-call-parser"), "{message}");
    let (status, _) = post_err(&base, "/embeddings", json!({"input": "x"})).await;
    assert_eq!(status, 404);
    let (status, message) = post_err(
        &base,
        "/completions",
        json!({"prompt": "x", "model": "gpt-4"}),
    )
    .await;
    assert_eq!(status, 404);
    assert!(message.contains("gpt-4"), "{message}");
    let huge = json!({"prompt": "a".repeat(5 << 20)});
    let (status, _) = post_err(&base, "/completions", huge).await;
    assert_eq!(status, 413);
    let models = http_open("GET", &base, "/models", Vec::new())
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    let models: Value =
        serde_json::from_slice(&models.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(models["data"][0]["id"], "synthetic:tiny");

    // A client that hangs up mid-stream: the router counts it cancelled and every block on
    // the nodes is free again, long before its 4,000 tokens could have been generated (a
    // generation left running would end `length` instead).
    let long = json!({
        "prompt": spread_prompts(1, 30, 0, 5).remove(0),
        "max_tokens": 4000, "ignore_eos": true, "stream": true,
    });
    let response = http_open("POST", &base, "/completions", long.to_string().into_bytes())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a first event").unwrap();
    assert!(first.data_ref().is_some_and(|d| d.starts_with(b"data: ")));
    drop(body);
    // And one that hangs up while waiting for a whole response.
    let whole = json!({
        "prompt": spread_prompts(1, 30, 0, 6).remove(0),
        "max_tokens": 4000, "ignore_eos": true,
    });
    let waited = tokio::time::timeout(
        std::time::Duration::from_millis(500),
        http_open(
            "POST",
            &base,
            "/completions",
            whole.to_string().into_bytes(),
        ),
    )
    .await;
    assert!(waited.is_err(), "4,000 tokens came back within 0.5 s");
    let metrics = cluster.router_metrics();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let e = exposition(&metrics).await.unwrap();
        if e.sum("pd_router_requests_total", &[("outcome", "cancelled")]) >= 2.0 {
            assert_eq!(
                e.sum("pd_router_requests_total", &[("outcome", "length")]),
                // Every finished request above, gRPC and HTTP (each choice is one request):
                // a ×3, the special tokens ×4, chat ×2, n=3 and its 3 gRPC twins, b, 2 prompts
                // × n=2. Not the long ones.
                20.0,
                "{}",
                e.text
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hang-ups were never both counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Any JSON object: response_format json_object, or a schema that asks for nothing more
    // (as a regex it would pass the same cap). Quotes and braces are favoured so the random
    // model closes its object.
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
        let whole = post_ok(&base, "/chat/completions", body).await;
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
    // A schema with a free-form part (pydantic's `dict[str, Any]`): guided, not refused.
    let schema = json!({"type": "object", "properties": {"meta": {"type": "object",
        "additionalProperties": true}, "id": {"type": "integer"}}, "required": ["meta", "id"]});
    let mut closed = 0;
    for seed in 0..4 {
        let body = json!({"prompt": "x", "max_tokens": 48, "temperature": 1, "seed": seed,
            "guided_json": schema, "logit_bias": {quote.clone(): 8, brace.clone(): 6}});
        let whole = post_ok(&base, "/completions", body).await;
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
    // A grammar (GBNF; nested parentheses, which no regex holds), over HTTP and gRPC alike:
    // every output a prefix of a text it matches, a whole one where it stopped by itself.
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
        let whole = post_ok(&base, "/completions", body).await;
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
        assert_eq!(grpc_text(&mut grpc, req).await, text, "seed {seed}");
    }
    assert!(matched > 0, "no output of the grammar was closed");
    // A grammar that cannot be used: refused by the router with what is wrong, in the words
    // the gRPC API uses.
    let (status, message) = post_err(
        &base,
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
    let status = grpc.generate(bad).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(status.message(), message);
    all_blocks_free(&cluster).await;
}

/// What a streamed chat choice adds up to: reasoning, content, tool calls (their parts joined
/// as OpenAI's clients join them: by `index`, the first part naming the call, the arguments'
/// text added up), finish reasons.
/// `request` sent with `"stream": true`: the stream's text, and what [`accumulate`] makes of
/// it.
async fn stream_chat(
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

fn accumulate(events: &[String]) -> (String, String, Vec<Value>, Vec<String>) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_answers_are_read_for_reasoning_and_tool_calls_and_the_calls_go_back() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = parsing_cluster(cache.path(), "hermes");
    let base = cluster.openai();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    // The weights are random: a regex makes the model think, say a word and call a tool.
    let answer = "<think>\nThe user wants weather\\.\n</think>\n\nLet me check\\.\n<tool_call>\n\
                  \\{\"name\": \"get_weather\", \"arguments\": \\{\"city\": \"Paris\"\\}\\}\n</tool_call>";
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let request = json!({
        "messages": [user], "tools": tools, "guided_regex": answer,
        "max_tokens": 120, "temperature": 0,
    });
    let v = post_ok(&base, "/chat/completions", request.clone()).await;
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
    let (text, (reasoning, content, calls, finishes)) = stream_chat(&base, &request).await;
    assert_eq!(reasoning, "The user wants weather.");
    assert_eq!(content, "Let me check.");
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"], call["function"]);
    assert_eq!(finishes, ["tool_calls"]);

    // The gRPC API reads the same answer the same way when the request asks (its own
    // flags, not the router's): reasoning, content, and the call's pieces joined by index.
    let mut grpc = client(&cluster.router()).await;
    let grpc_request = |parse: bool| pb::GenerateRequest {
        parse_reasoning: parse,
        parse_tool_calls: parse,
        ..weather_by_regex(&tools[0], answer, 120)
    };
    let mut stream = grpc
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
    let plain = grpc_text(&mut grpc, grpc_request(false)).await;
    assert!(
        plain.starts_with("<think>") && plain.contains("</tool_call>"),
        "{plain}"
    );

    // The arguments stream as they are written: an answer cut off inside them (`length`)
    // has the call with the arguments written so far, whole and streamed alike.
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    let mut cut_inside = 0;
    for max_tokens in tokens.saturating_sub(10)..tokens {
        let mut cut = request.clone();
        cut["max_tokens"] = json!(max_tokens);
        let v = post_ok(&base, "/chat/completions", cut.clone()).await;
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "length", "{v}");
        let calls = choice["message"]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        cut["stream"] = json!(true);
        let (_, text) = http_post(&base, "/chat/completions", &cut).await.unwrap();
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

    // parallel_tool_calls: false keeps the first call of an answer that made two, whole and
    // streamed.
    let twice = format!(
        "{answer}\n{}",
        &answer[answer.find("<tool_call>").unwrap()..]
    );
    let mut single = request.clone();
    single["guided_regex"] = json!(twice);
    let v = post_ok(&base, "/chat/completions", single.clone()).await;
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "{v}"
    );
    single["parallel_tool_calls"] = json!(false);
    let v = post_ok(&base, "/chat/completions", single.clone()).await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(message["tool_calls"][0]["function"], call["function"]);
    assert_eq!(message["content"], "Let me check.");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    single["stream"] = json!(true);
    let (_, text) = http_post(&base, "/chat/completions", &single)
        .await
        .unwrap();
    let (_, _, calls, _) = accumulate(&sse_data(&text));
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["function"], call["function"]);

    // A named tool_choice makes the answer one call of that tool, with arguments its
    // parameters accept (random weights: only the guide makes it a call).
    forced_weather_call(&base, &user, &tools).await;

    // tool_choice "required": one call or more, of any tool, free-form parameters too
    // (`data` is any object). Quotes and braces are favoured so the random model closes its
    // strings and objects.
    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let [quote, brace, end] =
        ["\"", "}", "<|im_end|>"].map(|t| tokenizer.encode(t).unwrap()[0].to_string());
    let both = json!([tools[0], {"type": "function", "function": {"name": "store",
        "parameters": {"type": "object", "properties": {"data": {"type": "object"}},
        "required": ["data"]}}}]);
    let (mut finished, mut several, mut stored) = (0, 0, 0);
    for seed in 0..6 {
        let required = json!({
            "messages": [user], "tools": both, "max_tokens": 200, "temperature": 1,
            "seed": seed, "tool_choice": "required",
            "logit_bias": {quote.clone(): 12, brace.clone(): 10, end.clone(): -2},
        });
        let v = post_ok(&base, "/chat/completions", required).await;
        let choice = &v["choices"][0];
        // Every call read out is one the tools allow; the length cut may end the last one
        // inside its arguments.
        let calls = choice["message"]["tool_calls"].as_array().cloned();
        let cut = usize::from(choice["finish_reason"] == "length");
        let whole = calls.as_ref().map_or(0, |c| c.len().saturating_sub(cut));
        for call in calls.iter().flatten().take(whole) {
            let arguments: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            match call["function"]["name"].as_str().unwrap() {
                "store" => {
                    assert!(arguments["data"].is_object(), "{arguments}");
                    stored += 1;
                }
                name => assert_eq!(name, "get_weather"),
            }
        }
        if choice["finish_reason"] == "tool_calls" {
            assert!(choice["message"]["content"].is_null(), "{v}");
            finished += 1;
            several += usize::from(calls.is_some_and(|c| c.len() > 1));
        } else {
            assert_eq!(choice["finish_reason"], "length", "{v}");
        }
    }
    assert!(
        finished > 0 && several > 0 && stored > 0,
        "{finished} {several} {stored}"
    );

    // tool_choice "none": the block stays text and the answer just stops.
    let mut none = request.clone();
    none["tool_choice"] = json!("none");
    let v = post_ok(&base, "/chat/completions", none).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        content.starts_with("Let me check.\n<tool_call>\n{\"name\""),
        "{content}"
    );
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());

    // The call goes back with the conversation: rendered as the template writes a call, so
    // the prompt counts exactly the tokens of that text written as the assistant's content.
    let follow_up = |assistant: Value| {
        json!({
            "messages": [user, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "18C"}],
            "tools": tools, "max_tokens": 1, "temperature": 0,
        })
    };
    let mut returned = message.clone();
    returned["content"] = Value::Null;
    let v = post_ok(&base, "/chat/completions", follow_up(returned)).await;
    let written = json!({"role": "assistant", "content":
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"});
    let w = post_ok(&base, "/chat/completions", follow_up(written)).await;
    assert_eq!(
        v["usage"]["prompt_tokens"], w["usage"]["prompt_tokens"],
        "{v}\n{w}"
    );
    let bad = json!({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]});
    let (status, message) = post_err(&base, "/chat/completions", follow_up(bad)).await;
    assert_eq!(status, 400);
    assert!(message.contains("tool_calls[0]"), "{message}");

    // Aggregated mode sends a prompt's logprobs on the last message: a streamed echo with
    // logprobs still starts with the prompt's tokens and adds up to the whole response.
    let echo = json!({"prompt": "Hello world, this is a test", "echo": true, "logprobs": 1,
        "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let whole = post_ok(&base, "/completions", echo.clone()).await;
    let mut streamed = echo.clone();
    streamed["stream"] = json!(true);
    let (status, text) = http_post(&base, "/completions", &streamed).await.unwrap();
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

    // A client that hangs up while the parser holds an open tool call (nothing is sent for
    // thousands of tokens) still cancels at once, not when the answer ends.
    let open_call = json!({
        "messages": [user], "tools": tools, "guided_regex": "<tool_call>[a-z]*",
        "max_tokens": 3000, "temperature": 0, "stream": true,
    });
    let response = http_open(
        "POST",
        &base,
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
    let metrics = cluster.router_metrics();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while exposition(&metrics)
        .await
        .unwrap()
        .sum("pd_router_requests_total", &[("outcome", "cancelled")])
        < 1.0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hang-up was not noticed while the parser held the call"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    all_blocks_free(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_coder_tool_calls_are_read_typed_by_the_request_s_tools() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = parsing_cluster(cache.path(), "qwen3_coder");
    let base = cluster.openai();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}]);
    // The weights are random: a regex makes the model write Qwen3-Coder's call.
    let answer = "<think>\nWeather\\.\n</think>\n\nLet me check\\.\n<tool_call>\n\
                  <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                  <parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n\
                  </function>\n</tool_call>";
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let request = json!({
        "messages": [user], "tools": tools, "guided_regex": answer,
        "max_tokens": 150, "temperature": 0,
    });
    let want = r#"{"city": "Paris", "days": 3, "metric": true}"#;
    let v = post_ok(&base, "/chat/completions", request.clone()).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let message = &choice["message"];
    assert_eq!(message["reasoning_content"], "Weather.");
    assert_eq!(message["content"], "Let me check.");
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1, "{v}");
    let call = &message["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], want);

    // Streamed: the name first, the arguments in pieces that join to the same text.
    let (text, (reasoning, content, calls, finishes)) = stream_chat(&base, &request).await;
    assert_eq!(reasoning, "Weather.");
    assert_eq!(content, "Let me check.");
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0]["function"], call["function"]);
    assert_eq!(finishes, ["tool_calls"]);
    let pieces = sse_data(&text)
        .iter()
        .filter(|e| e.contains("\"arguments\""))
        .count();
    assert!(pieces > 2, "the arguments came in one piece: {text}");

    // The gRPC API reads it alike when the request asks for Qwen3-Coder's format.
    let mut grpc = client(&cluster.router()).await;
    let grpc_request = pb::GenerateRequest {
        parse_reasoning: true,
        parse_tool_calls: true,
        tool_call_format: pb::ToolCallFormat::Qwen3Coder as i32,
        ..weather_by_regex(&tools[0], answer, 150)
    };
    let mut stream = grpc.generate(grpc_request).await.unwrap().into_inner();
    let (mut grpc_content, mut arguments, mut names) = (String::new(), String::new(), Vec::new());
    while let Some(chunk) = stream.message().await.unwrap() {
        grpc_content.push_str(&chunk.text);
        for part in chunk.tool_calls {
            names.extend(part.name);
            arguments.push_str(&part.arguments);
        }
    }
    assert_eq!(grpc_content, "Let me check.");
    assert_eq!(names, ["get_weather"]);
    assert_eq!(arguments, want);

    // Without tools in the request the block stays text.
    let mut plain = request.clone();
    plain.as_object_mut().unwrap().remove("tools");
    let v = post_ok(&base, "/chat/completions", plain).await;
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("<function=get_weather>"), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // A forced call is guided into a Hermes JSON block and read as one.
    forced_weather_call(&base, &user, &tools).await;
}

/// A named `tool_choice` (`get_weather`, sampled): the answer is one call of it, with JSON
/// object arguments.
async fn forced_weather_call(base: &str, user: &Value, tools: &Value) {
    let forced = json!({
        "messages": [user], "tools": tools, "max_tokens": 60, "temperature": 1, "seed": 3,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    });
    let v = post_ok(base, "/chat/completions", forced).await;
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let forced_call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(forced_call["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(forced_call["arguments"].as_str().unwrap()).expect("JSON arguments");
    assert!(arguments.is_object(), "{arguments}");
}

/// Aggregated mode (decode nodes only), the router reading reasoning (qwen3) and tool calls
/// (`tool_call_parser`).
fn parsing_cluster(cache: &std::path::Path, tool_call_parser: &str) -> Cluster {
    Cluster::up_with_env(
        cache,
        &["--prefill", "0", "--decode", "1"],
        &[
            ("PD_REASONING_PARSER", "qwen3"),
            ("PD_TOOL_CALL_PARSER", tool_call_parser),
        ],
    )
    .unwrap()
}

/// A gRPC chat request asking for the weather in Paris with `tool`, its answer made `answer`
/// (a regex: the weights are random), greedy.
fn weather_by_regex(tool: &Value, answer: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatInput {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "Weather in Paris?".into(),
                ..Default::default()
            }],
            enable_thinking: None,
            tools: vec![tool.to_string()],
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

/// A stream's chunks (its `data:` events but `[DONE]`), parsed.
fn stream_chunks(text: &str) -> Vec<Value> {
    let events = sse_data(text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

/// With `stream_options.continuous_usage_stats` (and `include_usage`), every chunk carries
/// its choice's usage so far, as vLLM counts it: the choice's prompt, the tokens that choice
/// generated up to and with the chunk; the usage-only chunk still ends the stream. Without
/// it, or without `include_usage`, no choice chunk carries a usage. The gRPC API's first
/// chunk of each choice carries the prompt's length these usages start from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_usage_stats_put_each_choice_s_usage_so_far_on_every_chunk() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &["--prefill", "1", "--decode", "1"]).unwrap();
    let base = cluster.openai();
    let mut prompts = spread_prompts(2, 21, 7, 91);
    let (a, b) = (prompts.remove(0), prompts.remove(0));
    let continuous = json!({"include_usage": true, "continuous_usage_stats": true});

    // Checks a stream's chunks; returns the choices' indexes with a chunk.
    let check = |chunks: &[Value], max_tokens: u64, prompt_of: &dyn Fn(u64) -> u64| {
        let (last, chunks) = chunks.split_last().unwrap();
        assert_eq!(last["choices"], json!([]), "{last}");
        let mut so_far = std::collections::BTreeMap::<u64, u64>::new();
        for chunk in chunks {
            let choices = chunk["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 1, "a usage is one choice's: {chunk}");
            let index = choices[0]["index"].as_u64().unwrap();
            let usage = &chunk["usage"];
            let prompt = usage["prompt_tokens"]
                .as_u64()
                .expect("a usage on every chunk");
            let completion = usage["completion_tokens"].as_u64().unwrap();
            assert_eq!(prompt, prompt_of(index), "{chunk}");
            assert_eq!(usage["total_tokens"], prompt + completion, "{chunk}");
            let before = so_far.insert(index, completion).unwrap_or(0);
            assert!(completion >= before, "completion tokens went down: {chunk}");
            if choices[0]["finish_reason"].is_string() {
                assert_eq!(completion, max_tokens, "ends at the final count: {chunk}");
            }
        }
        assert!(so_far.values().all(|&c| c == max_tokens), "{so_far:?}");
        // The usage-only chunk: each prompt once, every choice's tokens.
        let total = so_far.len() as u64 * max_tokens;
        assert_eq!(last["usage"]["completion_tokens"], total, "{last}");
        so_far.into_keys().collect::<Vec<_>>()
    };

    // Completions: two prompts × n = 2, each choice's usage its own prompt's.
    let body = json!({"prompt": [a, b], "n": 2, "max_tokens": 6, "temperature": 0,
        "ignore_eos": true, "stream": true, "stream_options": continuous});
    let (status, text) = http_post(&base, "/completions", &body).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let chunks = stream_chunks(&text);
    let lens = [a.len() as u64, b.len() as u64];
    let indexes = check(&chunks, 6, &|i| lens[i as usize / 2]);
    assert_eq!(indexes, [0, 1, 2, 3]);
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["prompt_tokens"], lens[0] + lens[1], "{last}");

    // Chat, n = 2: the role chunks too, each with its choice's prompt and no token yet; the
    // prompt is the rendered conversation, as the final usage counts it.
    let body = json!({"messages": [{"role": "user", "content": "Name a colour."}], "n": 2,
        "max_tokens": 5, "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": continuous});
    let (status, text) = http_post(&base, "/chat/completions", &body).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let chunks = stream_chunks(&text);
    let prompt = chunks.last().unwrap()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(prompt > 5, "the template's tokens: {prompt}");
    for (i, role) in chunks[..2].iter().enumerate() {
        assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{role}");
        assert_eq!(role["choices"][0]["index"], i);
        assert_eq!(
            role["usage"],
            json!({"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt})
        );
    }
    assert_eq!(check(&chunks, 5, &|_| prompt), [0, 1]);

    // Over gRPC the same conversation's first chunk says the same prompt length, at once.
    let mut grpc = client(&cluster.router()).await;
    let mut chat = greedy(Vec::new(), 3);
    chat.input = Some(pb::generate_request::Input::Chat(pb::ChatInput {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "Name a colour.".into(),
            ..Default::default()
        }],
        ..Default::default()
    }));
    let mut stream = grpc.generate(chat).await.unwrap().into_inner();
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        chunks.push(chunk);
    }
    assert_eq!(chunks[0].prompt_tokens, Some(prompt as u32));
    assert!(chunks[1..].iter().all(|c| c.prompt_tokens.is_none()));
    assert_eq!(
        chunks.last().unwrap().usage.unwrap().prompt_tokens as u64,
        prompt
    );

    // Without continuous_usage_stats, or without include_usage (vLLM then ignores it), no
    // choice chunk carries a usage.
    for (options, usage_chunk) in [
        (json!({"include_usage": true}), true),
        (json!({"continuous_usage_stats": true}), false),
        (
            json!({"include_usage": false, "continuous_usage_stats": true}),
            false,
        ),
    ] {
        for (path, body) in [
            ("/completions", json!({"prompt": a})),
            (
                "/chat/completions",
                json!({"messages": [{"role": "user", "content": "Hi"}]}),
            ),
        ] {
            let mut body = body;
            body["max_tokens"] = json!(4);
            body["stream"] = json!(true);
            body["stream_options"] = options.clone();
            let (status, text) = http_post(&base, path, &body).await.unwrap();
            assert_eq!(status, 200, "{text}");
            let chunks = stream_chunks(&text);
            let with_choices: Vec<&Value> = chunks
                .iter()
                .filter(|c| c["choices"] != json!([]))
                .collect();
            assert!(!with_choices.is_empty());
            assert!(
                with_choices.iter().all(|c| c.get("usage").is_none()),
                "{path} {options}: {text}"
            );
            assert_eq!(
                chunks.last().unwrap().get("usage").is_some(),
                usage_chunk,
                "{path} {options}: {text}"
            );
        }
    }
    all_blocks_free(&cluster).await;
}
