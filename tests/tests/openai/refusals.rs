//! Refusals and hang-ups over HTTP: OpenAI's error object with the status of what went wrong
//! (in the gRPC API's words where both refuse the same value), whether the router or a node
//! refuses; a client that hangs up is counted cancelled and frees its blocks at once.

use http_body_util::BodyExt as _;
use pd_tests::{greedy, http_open, spread_prompts};
use serde_json::{Value, json};

use crate::{outcomes, plain, post_err};

/// A 5 MiB body sent while the answer is read: the status line's code and what follows the
/// headers. (Through an HTTP client this races the refusal: the router answers 413 once the
/// body passes its limit and closes, and a client still writing gets a broken pipe instead of
/// the answer.)
async fn post_huge_body(base: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let rest = base.strip_prefix("http://").expect("an http:// base");
    let (authority, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let body = json!({"prompt": "a".repeat(5 << 20)}).to_string();
    let head = format!(
        "POST {prefix}{path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // The router may stop reading at any point: what the writer could not send is not missed.
    let sending = tokio::spawn(async move {
        let _ = writer.write_all(head.as_bytes()).await;
        let _ = writer.write_all(body.as_bytes()).await;
        writer
    });
    let mut answer = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match tokio::time::timeout_at(deadline, reader.read(&mut chunk)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&chunk[..n]),
            // A reset after the answer (the body left unread) ends it like a close.
            Ok(Err(e)) if !answer.is_empty() => {
                eprintln!("read after the answer: {e}");
                break;
            }
            Ok(Err(e)) => panic!("reading the answer: {e}"),
            Err(_) => panic!(
                "no whole answer within 30 s: {:?}",
                String::from_utf8_lossy(&answer)
            ),
        }
    }
    sending.abort();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let code = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (code, body.to_string())
}

/// Refusals: OpenAI's error object with the status of what went wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_are_refused_with_openai_s_error_object_and_the_grpc_api_s_words() {
    let mut t = plain().await;

    let (status, _) = post_err(&t.base, "/completions", json!("not an object")).await;
    assert_eq!(status, 400);
    let (status, message) = post_err(
        &t.base,
        "/completions",
        json!({"prompt": "x", "temprature": 0.5}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(message.contains("temprature"), "{message}");
    let (status, message) = post_err(
        &t.base,
        "/completions",
        json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(message.contains("/v1/chat/completions"), "{message}");
    // The same words as the gRPC API's for the same value.
    let mut bad = greedy(vec![1, 2, 3], 4);
    bad.sampling.as_mut().unwrap().temperature = Some(-1.0);
    let grpc_message = t
        .grpc
        .generate(bad)
        .await
        .unwrap_err()
        .message()
        .to_string();
    let (status, message) = post_err(
        &t.base,
        "/completions",
        json!({"prompt": [1, 2, 3], "temperature": -1}),
    )
    .await;
    assert_eq!((status, message), (400, grpc_message));
    let forced = json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f"}}]});
    let (status, message) = post_err(&t.base, "/chat/completions", forced).await;
    assert_eq!(status, 400);
    assert!(message.contains("--tool-call-parser"), "{message}");
    let (status, _) = post_err(&t.base, "/embeddings", json!({"input": "x"})).await;
    assert_eq!(status, 404);
    let (status, message) = post_err(
        &t.base,
        "/completions",
        json!({"prompt": "x", "model": "gpt-4"}),
    )
    .await;
    assert_eq!(status, 404);
    assert!(message.contains("gpt-4"), "{message}");
    let (status, body) = post_huge_body(&t.base, "/completions").await;
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("\"error\""), "{body}");
    let models = http_open("GET", &t.base, "/models", Vec::new())
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    let models: Value =
        serde_json::from_slice(&models.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(models["data"][0]["id"], "synthetic:tiny");
    t.end(0.0).await;
}

/// Refused by the node, not the router (an automaton over the node's 1,024-state cap):
/// streamed or not, the request's own status and OpenAI's error object, not a 200 stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_node_refuses_gets_its_own_status_streamed_or_not() {
    let t = plain().await;
    for stream in [false, true] {
        let (status, message) = post_err(
            &t.base,
            "/completions",
            json!({"prompt": "x", "guided_regex": "[ab]*a[ab]{10}", "stream": stream}),
        )
        .await;
        assert_eq!(status, 400, "stream {stream}: {message}");
        assert!(message.contains("1024 states"), "{message}");
    }
    t.end_free().await;
}

/// A client that hangs up mid-stream: the router counts it cancelled and every block on
/// the nodes is free again, long before its 4,000 tokens could have been generated (a
/// generation left running would end `length` instead). The same for one that hangs up while
/// waiting for a whole response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_is_counted_cancelled_and_frees_every_block() {
    let t = plain().await;
    let cancelled = outcomes(t.cluster, "cancelled").await;
    let long = json!({
        "prompt": spread_prompts(1, 30, 0, 5).remove(0),
        "max_tokens": 4000, "ignore_eos": true, "stream": true,
    });
    let response = http_open(
        "POST",
        &t.base,
        "/completions",
        long.to_string().into_bytes(),
    )
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
            &t.base,
            "/completions",
            whole.to_string().into_bytes(),
        ),
    )
    .await;
    assert!(waited.is_err(), "4,000 tokens came back within 0.5 s");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while outcomes(t.cluster, "cancelled").await - cancelled < 2.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hang-ups were never both counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Neither long one ended `length`.
    t.end(0.0).await;
}
