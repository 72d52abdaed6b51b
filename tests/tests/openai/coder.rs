//! Qwen3-Coder's tool calls (`--tool-call-parser qwen3_coder`): read typed by the request's
//! tools, whole and streamed, over HTTP and gRPC, on a cluster of its own.

use pd_proto::pb;
use pd_tests::{client, sse_data};
use serde_json::json;

use crate::tool_choice::forced_weather_call;
use crate::tools::{stream_chat, weather_by_regex};
use crate::{parsing_cluster, post_ok};

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
