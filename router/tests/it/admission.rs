//! Overload: admission control (`--max-inflight`, `--max-queue`, `--queue-timeout`) over gRPC
//! and HTTP, nodes that refuse for want of room, and the HTTP header timeout.

use std::time::Duration;

use pd_proto::pb;
use pd_router::admission::AdmissionLimits;
use pd_test_support::metrics::value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::Code;

use crate::fake::*;

fn limits(max_inflight: usize, max_queue: usize, queue_timeout: Duration) -> AdmissionLimits {
    AdmissionLimits {
        max_inflight: Some(max_inflight),
        max_queue,
        queue_timeout,
    }
}

fn request(id: &str) -> pb::GenerateRequest {
    let mut req = text_request("tell me a story");
    req.request_id = Some(id.into());
    req
}

/// A router with `admission` over a prefill node and a decode node that sends one token and
/// then hangs, so that each request holds its slot until it is aborted or dropped:
/// `(p, d, router)`.
async fn each_request_holds_its_slot(
    admission: AdmissionLimits,
) -> (FakeNode, FakeNode, RouterUnderTest) {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101]],
        end: End::Hang,
        ..Default::default()
    };
    let mut cfg = config(&[&p], &[&d]);
    cfg.admission = admission;
    let router = RouterUnderTest::start(cfg).await;
    (p, d, router)
}

#[tokio::test]
async fn past_max_inflight_with_no_queue_a_request_is_refused_while_the_others_stream() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // Two long streams: several messages apart, so they are still streaming after the
    // refusals (a refusal that waited for a slot would come after one of them ended).
    for id in ["a", "b"] {
        d.state.scripts_by_id.lock().unwrap().push((
            id.into(),
            Script {
                messages: vec![vec![101]; 8],
                delay: Duration::from_millis(100),
                end: End::Finish(pb::FinishReason::Length),
            },
        ));
    }
    let mut cfg = config(&[&p], &[&d]);
    cfg.admission = limits(2, 0, Duration::from_secs(60));
    let router = RouterUnderTest::start(cfg).await;
    let mut client = router.client();
    let mut a = client.generate(request("a")).await.unwrap().into_inner();
    let mut b = client.generate(request("b")).await.unwrap().into_inner();
    assert!(a.message().await.unwrap().is_some());
    assert!(b.message().await.unwrap().is_some());

    let refused = client.generate(request("c")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("--max-inflight"), "{refused:?}");
    assert_eq!(refused.metadata().get("retry-after").unwrap(), "1");
    let http = http_completion(router.http, 4).await;
    assert!(http.starts_with("HTTP/1.1 429"), "{http}");
    assert!(
        http.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{http}"
    );
    assert!(http.contains(r#""type":"rate_limit_error""#), "{http}");
    // Neither refused request reached a node.
    assert_eq!(p.state.prefill_count(), 2);

    // Both streams were still going: each has messages left, and ends normally.
    for stream in [&mut a, &mut b] {
        let mut rest = Vec::new();
        while let Some(chunk) = stream.message().await.unwrap() {
            rest.push(chunk);
        }
        assert!(rest.len() >= 2, "{rest:?}");
        assert_eq!(
            rest.last().unwrap().finish_reason(),
            pb::FinishReason::Length
        );
    }
    // The slots are free again.
    let (chunks, error) = collect(&mut client, request("d")).await.unwrap();
    assert!(error.is_none() && !chunks.is_empty(), "{error:?}");

    let text = router.metrics_text().await;
    let rejected = value(
        &text,
        "pd_router_requests_rejected_total",
        &[r#"reason="queue_full""#],
    );
    assert_eq!(rejected, Some(2.0), "{text}");
    let outcome = value(
        &text,
        "pd_router_requests_total",
        &[r#"outcome="resource_exhausted""#],
    );
    assert_eq!(outcome, Some(2.0), "{text}");
    let tenant = value(
        &text,
        "pd_router_tenant_requests_total",
        &[r#"outcome="resource_exhausted""#],
    );
    assert_eq!(tenant, Some(2.0), "{text}");
}

#[tokio::test]
async fn a_queued_request_runs_when_a_slot_frees_and_one_past_the_queue_timeout_is_refused() {
    let (p, d, router) = each_request_holds_its_slot(limits(2, 1, Duration::from_secs(60))).await;
    let mut client = router.client();
    let mut a = client.generate(request("a")).await.unwrap().into_inner();
    let mut b = client.generate(request("b")).await.unwrap().into_inner();
    assert!(a.message().await.unwrap().is_some());
    assert!(b.message().await.unwrap().is_some());

    // The third waits in the queue; a fourth finds the queue full.
    d.state
        .scripts_by_id
        .lock()
        .unwrap()
        .push(("c".into(), Script::default()));
    let queued = {
        let mut client = client.clone();
        tokio::spawn(async move { collect(&mut client, request("c")).await })
    };
    for _ in 0..500 {
        let text = router.metrics_text().await;
        if value(&text, "pd_router_requests_queued", &[]) == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let full = client.generate(request("e")).await.unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    assert!(!queued.is_finished());
    assert_eq!(
        p.state.prefill_count(),
        2,
        "the queued request reached a node"
    );

    // A slot frees: the queued request runs to its end.
    let abort = pb::AbortRequest {
        request_id: "a".into(),
    };
    client.abort(abort).await.unwrap();
    let (chunks, error) = queued.await.unwrap().unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        chunks.last().unwrap().finish_reason(),
        pb::FinishReason::Length
    );
    drop((a, b));
}

#[tokio::test]
async fn a_request_that_waits_past_the_queue_timeout_is_refused() {
    let (p, _d, router) =
        each_request_holds_its_slot(limits(1, 4, Duration::from_millis(300))).await;
    let mut client = router.client();
    let mut a = client.generate(request("a")).await.unwrap().into_inner();
    assert!(a.message().await.unwrap().is_some());
    let refused = client.generate(request("b")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("queue timeout"), "{refused:?}");
    let text = router.metrics_text().await;
    let rejected = value(
        &text,
        "pd_router_requests_rejected_total",
        &[r#"reason="queue_timeout""#],
    );
    assert_eq!(rejected, Some(1.0), "{text}");
    assert_eq!(p.state.prefill_count(), 1);
    drop(a);
}

#[tokio::test]
async fn full_nodes_are_each_tried_once_and_refusal_is_resource_exhausted() {
    let prefills = [
        FakeNode::prefill().await,
        FakeNode::prefill().await,
        FakeNode::prefill().await,
    ];
    let d = FakeNode::decode().await;
    for p in &prefills {
        *p.state.fail_code.lock().unwrap() = Code::ResourceExhausted;
        p.state
            .fail_next
            .store(1, std::sync::atomic::Ordering::SeqCst);
    }
    let refs: Vec<&FakeNode> = prefills.iter().collect();
    let router = RouterUnderTest::start(config(&refs, &[&d])).await;
    let mut client = router.client();
    // Every prefill node is full: each is asked once (more than the one retry a failure
    // gets), and the client is told RESOURCE_EXHAUSTED.
    let (chunks, refused) = collect(&mut client, request("a")).await.unwrap();
    let refused = refused.expect("every prefill node refused");
    assert_eq!(
        refused.code(),
        Code::ResourceExhausted,
        "{refused:?} {chunks:?}"
    );
    for p in &prefills {
        assert_eq!(p.state.prefill_count(), 1);
    }
    // No node was marked down: the next request is served at once.
    assert_eq!(router.registry.prefill_candidates(&[]).unwrap().len(), 3);
    let (chunks, error) = collect(&mut client, request("b")).await.unwrap();
    assert!(error.is_none() && !chunks.is_empty(), "{error:?}");

    // Every decode node full: each asked once. The client saw the prefill node's first
    // token already, so its stream ends as any stream that cannot go on does (UNAVAILABLE),
    // naming the refusals.
    let decodes = [
        FakeNode::decode().await,
        FakeNode::decode().await,
        FakeNode::decode().await,
    ];
    let p = FakeNode::prefill().await;
    for d in &decodes {
        *d.state.fail_code.lock().unwrap() = Code::ResourceExhausted;
        d.state
            .fail_next
            .store(1, std::sync::atomic::Ordering::SeqCst);
    }
    let refs: Vec<&FakeNode> = decodes.iter().collect();
    let router = RouterUnderTest::start(config(&[&p], &refs)).await;
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, request("c")).await.unwrap();
    let error = error.expect("every decode node refused");
    assert_eq!(error.code(), Code::Unavailable, "{error:?} {chunks:?}");
    assert!(error.message().contains("RESOURCE_EXHAUSTED"), "{error:?}");
    for d in &decodes {
        assert_eq!(d.state.decode_count(), 1);
    }
    let (chunks, error) = collect(&mut client, request("d")).await.unwrap();
    assert!(error.is_none() && !chunks.is_empty(), "{error:?}");
}

#[tokio::test]
async fn a_client_that_sends_its_headers_a_byte_at_a_time_is_disconnected() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p], &[&d]);
    cfg.http_limits.header_timeout = Duration::from_secs(1);
    let router = RouterUnderTest::start(cfg).await;
    let mut stream = tokio::net::TcpStream::connect(router.http).await.unwrap();
    let head = format!(
        "GET /v1/models HTTP/1.1\r\nHost: {}\r\nX-Slow: ",
        router.http
    );
    let mut bytes = head.bytes().chain(std::iter::repeat(b'x'));
    // A byte every 200 ms: 50 bytes take 10 s, ten times the header timeout.
    let mut sent = 0;
    let closed = loop {
        if sent == 50 {
            break false;
        }
        if stream.write_all(&[bytes.next().unwrap()]).await.is_err() {
            break true;
        }
        sent += 1;
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(_)) | Err(_) => {}
        }
    };
    assert!(closed, "still open after {sent} header bytes");
    assert!(sent < 50);
}
