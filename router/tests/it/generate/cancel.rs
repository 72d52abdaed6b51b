//! Ending a generate request early: the client going away, the `Abort` call (while decoding
//! and while prefilling), and deadlines, which reach the nodes as `grpc-timeout` (none without).

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use tonic::Code;
use tonic::transport::Channel;

use super::decode_aborted;
use crate::fake::*;

pub(super) fn abort_request(id: &str) -> pb::AbortRequest {
    pb::AbortRequest {
        request_id: id.into(),
    }
}

/// The request `id` leaves the router's in-flight table within a second (`Abort` no longer
/// finds it).
pub(super) async fn assert_leaves_flight(client: &mut GenerationClient<Channel>, id: &str) {
    for _ in 0..100 {
        let r = client.abort(abort_request(id)).await.unwrap();
        if !r.into_inner().aborted {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("request {id} is still in flight");
}

/// A router over a prefill node and a decode node that sends two tokens and then hangs (its
/// stream ends only when the router drops it): `(p, d, router)`.
async fn hanging_decode() -> (FakeNode, FakeNode, RouterUnderTest) {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102]],
        end: End::Hang,
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    (p, d, router)
}

/// A router over a prefill node that takes 30 s to answer and a decode node: `(p, d, router)`.
async fn slow_prefill() -> (FakeNode, FakeNode, RouterUnderTest) {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_secs(30);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    (p, d, router)
}

/// Waits until the prefill node `p` is told to abort the first request it saw.
async fn prefill_aborted(p: &FakeNode) {
    let prefill_id = p.state.prefills.lock().unwrap()[0].request_id.clone();
    eventually("the prefill node is aborted", || {
        p.state.aborted() == [prefill_id.clone()]
    })
    .await;
}

#[tokio::test]
async fn a_client_that_goes_away_aborts_downstream() {
    let (p, d, router) = hanging_decode().await;
    let mut client = router.client();
    let mut req = text_request("tell me a long story");
    req.request_id = Some("going-away".into());
    let mut stream = client.generate(req).await.unwrap().into_inner();
    for _ in 0..3 {
        assert!(stream.message().await.unwrap().is_some());
    }
    drop(stream);

    decode_aborted(&d).await;
    eventually("the decode stream is dropped", || {
        d.state.streams_cancelled.load(SeqCst) == 1
    })
    .await;
    assert_eq!(p.state.released().len(), 1);
    assert_leaves_flight(&mut client, "going-away").await;
}

#[tokio::test]
async fn abort_ends_the_stream_with_finish_reason_abort() {
    let (p, d, router) = hanging_decode().await;
    let mut client = router.client();
    assert!(
        !client
            .abort(abort_request("nobody"))
            .await
            .unwrap()
            .into_inner()
            .aborted,
        "unknown ids are not aborted"
    );
    let mut req = text_request("go on");
    req.request_id = Some("mine".into());
    let mut stream = client.generate(req).await.unwrap().into_inner();
    for _ in 0..3 {
        assert!(stream.message().await.unwrap().is_some());
    }
    let r = client.abort(abort_request("mine")).await.unwrap();
    assert!(r.into_inner().aborted);
    let last = stream.message().await.unwrap().expect("a last chunk");
    assert_eq!(last.finish_reason(), pb::FinishReason::Abort);
    assert_eq!(last.usage.unwrap().completion_tokens, 3);
    assert!(stream.message().await.unwrap().is_none());

    decode_aborted(&d).await;
    eventually("the lease is released", || p.state.released().len() == 1).await;
    assert!(
        !client
            .abort(abort_request("mine"))
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
}

#[tokio::test]
async fn abort_while_prefilling_aborts_the_prefill_node() {
    let (p, d, router) = slow_prefill().await;
    let mut client = router.client();
    let mut req = text_request("slow");
    req.request_id = Some("slow".into());
    let mut c = client.clone();
    let pending = tokio::spawn(async move { collect(&mut c, req).await });
    eventually("the prefill started", || p.state.prefill_count() == 1).await;
    assert!(
        client
            .abort(abort_request("slow"))
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
    let (chunks, error) = pending.await.unwrap().unwrap();
    assert!(error.is_none());
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].finish_reason(), pb::FinishReason::Abort);
    assert_eq!(chunks[0].usage.unwrap().completion_tokens, 0);
    prefill_aborted(&p).await;
    assert_eq!(d.state.decode_count(), 0);
}

#[tokio::test]
async fn a_client_that_goes_away_while_prefilling_aborts_the_prefill_node() {
    let (p, d, router) = slow_prefill().await;
    let mut client = router.client();
    let mut req = text_request("slow");
    req.request_id = Some("impatient".into());
    let mut c = client.clone();
    // The response comes with the first message, so the call is still waiting for it.
    let call = tokio::spawn(async move { c.generate(req).await.map(|_| ()) });
    eventually("the prefill started", || p.state.prefill_count() == 1).await;
    call.abort();
    prefill_aborted(&p).await;
    assert_eq!(d.state.decode_count(), 0);
    assert_leaves_flight(&mut client, "impatient").await;
}

#[tokio::test]
async fn deadlines_end_requests_and_abort_the_nodes() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_secs(30);
    let mut cfg = config(&[&p], &[&d]);
    cfg.request_timeout = Some(Duration::from_millis(300));
    let router = RouterUnderTest::start(cfg).await;
    let mut client = router.client();

    // The router's --request-timeout.
    let (chunks, error) = collect(&mut client, text_request("slow")).await.unwrap();
    assert!(chunks.is_empty());
    assert_eq!(error.unwrap().code(), Code::DeadlineExceeded);
    eventually("the prefill node is aborted", || {
        p.state.aborted().len() == 1
    })
    .await;

    // The client's own grpc-timeout, when shorter.
    let mut request = tonic::Request::new(text_request("slow"));
    request.set_timeout(Duration::from_millis(100));
    let started = std::time::Instant::now();
    let outcome = client.generate(request).await;
    let status = match outcome {
        Err(s) => s,
        Ok(r) => r.into_inner().message().await.unwrap_err(),
    };
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(290));
    eventually("the prefill node is aborted again", || {
        p.state.aborted().len() == 2
    })
    .await;
    let sent = p.state.prefills.lock().unwrap()[1].clone();
    assert_eq!(sent.token_ids, tokenizer().encode("slow").unwrap());
    // Both deadlines travelled to the prefill node as grpc-timeout, no longer than they were.
    let timeouts = p.state.prefill_timeouts.lock().unwrap().clone();
    for (timeout, limit) in timeouts.iter().zip([300, 100]) {
        let value = timeout
            .as_deref()
            .expect("a deadline travels as grpc-timeout");
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("grpc-timeout", value.parse().expect("ASCII"));
        let timeout = pd_router::grpc_timeout(&metadata).expect("a valid grpc-timeout");
        assert!(timeout <= Duration::from_millis(limit), "{value}");
    }
}

#[tokio::test]
async fn without_a_deadline_the_nodes_get_none() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("no hurry");
    req.max_tokens = Some(1);
    let (_, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    // The router enforces --node-timeout itself (and aborts the node when it passes); the
    // node is not told one, which spares it a timer per request (the default
    // --request-timeout, longer than --node-timeout, does not travel either).
    assert_eq!(*p.state.prefill_timeouts.lock().unwrap(), vec![None]);
}
