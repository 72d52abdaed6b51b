//! `stream_options.continuous_usage_stats`: every chunk carries its choice's usage so far.

use pd_proto::pb;
use pd_tests::{greedy, http_post, spread_prompts};
use serde_json::{Value, json};

use crate::{plain, stream_chunks};

/// With `stream_options.continuous_usage_stats` (and `include_usage`), every chunk carries
/// its choice's usage so far, as vLLM counts it: the choice's prompt, the tokens that choice
/// generated up to and with the chunk; the usage-only chunk still ends the stream. Without
/// it, or without `include_usage`, no choice chunk carries a usage. The gRPC API's first
/// chunk of each choice carries the prompt's length these usages start from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_usage_stats_put_each_choice_s_usage_so_far_on_every_chunk() {
    let mut t = plain().await;
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
    let (status, text) = http_post(&t.base, "/completions", &body).await.unwrap();
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
    let (status, text) = http_post(&t.base, "/chat/completions", &body)
        .await
        .unwrap();
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
    let mut chat = greedy(Vec::new(), 3);
    chat.input = Some(pb::generate_request::Input::Chat(
        pd_test_support::chat_input(&[("user", "Name a colour.")]),
    ));
    let mut stream = t.grpc.generate(chat).await.unwrap().into_inner();
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
            let (status, text) = http_post(&t.base, path, &body).await.unwrap();
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
    t.end_free().await;
}
