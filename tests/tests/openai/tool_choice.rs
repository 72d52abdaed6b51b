//! `tool_choice` over HTTP with the router's Hermes parser: a named tool forces one call of
//! it, "required" one or more calls the tools allow, "none" leaves the block as text; a call
//! goes back with the conversation as the template writes it.

use serde_json::{Value, json};

use crate::tools::{user, weather_request, weather_tools};
use crate::{hermes, post_err, post_ok};

/// A named tool_choice makes the answer one call of that tool, with arguments its
/// parameters accept (random weights: only the guide makes it a call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_tool_choice_makes_the_answer_one_call_of_that_tool() {
    let t = hermes().await;
    forced_weather_call(&t.base, &user(), &weather_tools()).await;
    t.end_free().await;
}

/// tool_choice "required": one call or more, of any tool, free-form parameters too
/// (`data` is any object). Quotes and braces are favoured so the random model closes its
/// strings and objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_required_makes_one_call_or_more_of_the_tools() {
    let t = hermes().await;
    let (user, tools) = (user(), weather_tools());
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
        let v = post_ok(&t.base, "/chat/completions", required).await;
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
    t.end_free().await;
}

/// tool_choice "none": the block stays text and the answer just stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_none_leaves_the_block_as_text() {
    let t = hermes().await;
    let request = weather_request();
    let mut none = request.clone();
    none["tool_choice"] = json!("none");
    let v = post_ok(&t.base, "/chat/completions", none).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        content.starts_with("Let me check.\n<tool_call>\n{\"name\""),
        "{content}"
    );
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    t.end_free().await;
}

/// The call goes back with the conversation: rendered as the template writes a call, so
/// the prompt counts exactly the tokens of that text written as the assistant's content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_goes_back_with_the_conversation_as_the_template_writes_it() {
    let t = hermes().await;
    let (user, tools) = (user(), weather_tools());
    let v = post_ok(&t.base, "/chat/completions", weather_request()).await;
    let message = &v["choices"][0]["message"];
    let call = &message["tool_calls"][0];
    let follow_up = |assistant: Value| {
        json!({
            "messages": [user, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "18C"}],
            "tools": tools, "max_tokens": 1, "temperature": 0,
        })
    };
    let mut returned = message.clone();
    returned["content"] = Value::Null;
    let v = post_ok(&t.base, "/chat/completions", follow_up(returned)).await;
    let written = json!({"role": "assistant", "content":
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"});
    let w = post_ok(&t.base, "/chat/completions", follow_up(written)).await;
    assert_eq!(
        v["usage"]["prompt_tokens"], w["usage"]["prompt_tokens"],
        "{v}\n{w}"
    );
    let bad = json!({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]});
    let (status, message) = post_err(&t.base, "/chat/completions", follow_up(bad)).await;
    assert_eq!(status, 400);
    assert!(message.contains("tool_calls[0]"), "{message}");
    t.end_free().await;
}

/// A named `tool_choice` (`get_weather`, sampled): the answer is one call of it, with JSON
/// object arguments.
pub(crate) async fn forced_weather_call(base: &str, user: &Value, tools: &Value) {
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
