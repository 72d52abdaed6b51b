//! Completions and chat over HTTP equal the same requests over gRPC: whole, streamed, with
//! special tokens, with n choices; /tokenize and /detokenize agree with them. Each test counts
//! the requests the router saw end `length` (every HTTP choice is one request).

use pd_proto::pb;
use pd_tests::{greedy, http_post, nodes_sum, spread_prompts};
use serde_json::{Value, json};

use crate::{grpc_text, plain, post_err, post_ok, sampled};

/// Completions, whole: the text of the same gRPC request; usage counts; the prompt again
/// shows the prefill node's cache hits as cached tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_completion_is_the_grpc_text_and_counts_cached_tokens() {
    let mut t = plain().await;
    let a = spread_prompts(1, 40, 9, 71).remove(0);

    let want_a = grpc_text(&mut t.grpc, greedy(a.clone(), 12)).await;
    let body = json!({"prompt": a, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let v = post_ok(&t.base, "/completions", body).await;
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
    t.end(2.0).await;
}

/// Completions, streamed: the same text in pieces, one finish, the usage, [DONE].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completion_is_the_grpc_text_in_pieces_then_usage_then_done() {
    let mut t = plain().await;
    let a = spread_prompts(1, 40, 9, 72).remove(0);

    let want_a = grpc_text(&mut t.grpc, greedy(a.clone(), 12)).await;
    let streamed = json!({"prompt": a, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true}});
    let (status, text) = http_post(&t.base, "/completions", &streamed).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let chunks = crate::stream_chunks(&text);
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
    t.end(2.0).await;
}

/// Special tokens (here `<|im_start|>`, forced by a bias) are left out of the text unless
/// skip_special_tokens is false, over HTTP and gRPC alike; their ids are there either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_tokens_are_left_out_of_the_text_unless_asked_over_http_and_grpc() {
    let mut t = plain().await;
    let a = spread_prompts(1, 40, 9, 73).remove(0);

    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let start = tokenizer.token_id("<|im_start|>").unwrap();
    let forced = json!({"prompt": a, "max_tokens": 3, "temperature": 0,
        "logit_bias": {start.to_string(): 100}, "logprobs": 1});
    let v = post_ok(&t.base, "/completions", forced.clone()).await;
    assert_eq!(v["choices"][0]["text"], "", "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"],
        json!(vec!["<|im_start|>"; 3])
    );
    let mut kept = forced.clone();
    kept["skip_special_tokens"] = json!(false);
    let v = post_ok(&t.base, "/completions", kept).await;
    assert_eq!(v["choices"][0]["text"], "<|im_start|>".repeat(3), "{v}");
    let mut wire = greedy(a.clone(), 3);
    wire.sampling
        .as_mut()
        .unwrap()
        .logit_bias
        .insert(start, 100.0);
    assert_eq!(grpc_text(&mut t.grpc, wire.clone()).await, "");
    wire.skip_special_tokens = Some(false);
    assert_eq!(grpc_text(&mut t.grpc, wire).await, "<|im_start|>".repeat(3));
    t.end(4.0).await;
}

const MESSAGES: [(&str, &str); 2] = [("system", "Answer briefly."), ("user", "Name a colour.")];

/// [`MESSAGES`] as OpenAI's `messages`.
fn messages() -> Vec<Value> {
    MESSAGES
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect()
}

/// The chat completion of [`MESSAGES`], 8 tokens, greedy.
async fn chat(base: &str) -> Value {
    let body = json!({"messages": messages(), "max_tokens": 8, "temperature": 0,
        "ignore_eos": true});
    post_ok(base, "/chat/completions", body).await
}

/// Chat: the text of the same conversation over gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_completion_is_the_grpc_text_of_the_same_conversation() {
    let mut t = plain().await;

    let wire = pd_test_support::chat_input(&MESSAGES);
    let mut chat_req = greedy(Vec::new(), 8);
    chat_req.input = Some(pb::generate_request::Input::Chat(wire));
    let want_chat = grpc_text(&mut t.grpc, chat_req).await;
    let v = chat(&t.base).await;
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want_chat.as_str());
    t.end(2.0).await;
}

/// /tokenize counts a conversation as the chat request was counted, and text as the gRPC
/// Tokenize does; /detokenize gives the text back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_as_chat_and_grpc_count_and_detokenize_gives_the_text_back() {
    let mut t = plain().await;
    let root = t.base.trim_end_matches("/v1");
    let chat_prompt_tokens = chat(&t.base).await["usage"]["prompt_tokens"].clone();
    let counted = post_ok(root, "/tokenize", json!({"messages": messages()})).await;
    assert_eq!(counted["count"], chat_prompt_tokens);
    assert_eq!(counted["max_model_len"], 4096);
    let text = post_ok(root, "/tokenize", json!({"prompt": "Hello world"})).await;
    let ids = t
        .grpc
        .tokenize(pb::TokenizeRequest {
            model: String::new(),
            text: "Hello world".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .ids;
    assert_eq!(text["tokens"], json!(ids));
    let d = post_ok(root, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(d["prompt"], "Hello world");
    let (status, _) = post_err(root, "/tokenize", json!({"prompt": "x", "messages": []})).await;
    assert_eq!(status, 400);
    // Only the chat request generated.
    t.end(1.0).await;
}

/// n choices with a seed: choice i is the seed + i generation; two prompts are
/// prompt-major. Choices after the first start once its first token is out, so they find
/// the prompt in the prefill node's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_the_seeded_generations_prompt_major_and_share_the_prompt_s_cache() {
    let mut t = plain().await;
    let mut prompts = spread_prompts(2, 40, 9, 74);
    let (a, b) = (prompts.remove(0), prompts.remove(0));

    let hits = || nodes_sum(t.cluster, "prefill", "vllm:prefix_cache_hits_total", &[]);
    let hits_before = hits().await;
    let v = post_ok(
        &t.base,
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
        let want = grpc_text(&mut t.grpc, sampled(b.clone(), 6, 5 + i)).await;
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
    let want_b = grpc_text(&mut t.grpc, greedy(b.clone(), 5)).await;
    let v = post_ok(
        &t.base,
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
    // n = 3 and its 3 gRPC twins, b, 2 prompts × n = 2: each choice is one request.
    t.end(11.0).await;
}
