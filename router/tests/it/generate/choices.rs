//! A request of `n` choices: each choice is a request of its own (`ID-i`) under the request's
//! `Abort` and deadline, and the request's id is free again once its last chunk is out.

use std::time::Duration;

use pd_proto::pb;
use tonic::Code;

use super::cancel::{abort_request, assert_leaves_flight};
use crate::fake::*;

fn choices(id: &str, n: u32) -> pb::GenerateRequest {
    let mut req = text_request("once upon a time");
    req.request_id = Some(id.into());
    req.n = Some(n);
    req
}

/// A prefill's `grpc-timeout`, as the node received it.
fn timeout_of(value: &Option<String>) -> Duration {
    let value = value
        .as_deref()
        .expect("a deadline travels as grpc-timeout");
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert("grpc-timeout", value.parse().expect("ASCII"));
    pd_router::grpc_timeout(&metadata).expect("a valid grpc-timeout")
}

/// An `Abort` while the first choice prefills ends it, and the other choices never reach a
/// node: none is started after the `Abort`.
#[tokio::test]
async fn an_abort_while_the_first_choice_prefills_sends_no_other_choice_to_a_node() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_millis(300);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let running = tokio::spawn({
        let mut client = router.client();
        async move { collect(&mut client, choices("early", 3)).await }
    });
    eventually("the first choice prefills", || p.state.prefill_count() == 1).await;
    let aborted = client.abort(abort_request("early")).await.unwrap();
    assert!(aborted.into_inner().aborted);
    let (chunks, error) = running.await.unwrap().unwrap();
    assert!(error.is_none(), "{error:?}");
    let last = chunks.last().expect("the first choice's last chunk");
    assert_eq!(last.finish_reason(), pb::FinishReason::Abort);
    assert!(
        chunks
            .iter()
            .filter(|c| c.finish_reason != 0)
            .all(|c| c.finish_reason() == pb::FinishReason::Abort),
        "{chunks:?}"
    );
    // Every choice has its last chunk, so a client waiting for each index is not left
    // waiting.
    let mut ended: Vec<u32> = chunks
        .iter()
        .filter(|c| c.finish_reason != 0)
        .map(|c| c.index)
        .collect();
    ended.sort_unstable();
    assert_eq!(ended, [0, 1, 2], "{chunks:?}");
    assert_eq!(
        p.state.prefill_count(),
        1,
        "a choice started after the Abort"
    );
    assert_eq!(d.state.decode_count(), 0);
    assert_leaves_flight(&mut client, "early").await;
    // The id is free: the same request runs whole now.
    *p.state.prefill_delay.lock().unwrap() = Duration::ZERO;
    let (chunks, error) = collect(&mut client, choices("early", 3)).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    let mut finished: Vec<_> = chunks
        .iter()
        .filter(|c| c.finish_reason != 0)
        .map(|c| (c.index, c.finish_reason()))
        .collect();
    finished.sort_unstable_by_key(|&(i, _)| i);
    assert_eq!(
        finished,
        [0, 1, 2].map(|i| (i, pb::FinishReason::Length)).to_vec()
    );
}

/// An `Abort` of the request reaches its own choices only: not another client's request
/// that took the id `ID-0` after the first choice finished.
#[tokio::test]
async fn an_abort_spares_another_request_with_a_finished_choice_s_id() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // Decode streams hang, but the first choice's, which finishes.
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101]],
        end: End::Hang,
        ..Default::default()
    };
    d.state
        .scripts_by_id
        .lock()
        .unwrap()
        .push(("job-0".into(), Script::default()));
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut job = client
        .generate(choices("job", 2))
        .await
        .unwrap()
        .into_inner();
    loop {
        let chunk = job
            .message()
            .await
            .unwrap()
            .expect("the first choice's end");
        if chunk.index == 0 && chunk.finish_reason != 0 {
            assert_eq!(chunk.finish_reason(), pb::FinishReason::Length);
            break;
        }
    }
    // Another request takes the finished choice's id.
    let mut other = text_request("someone else");
    other.request_id = Some("job-0".into());
    let mut other = client.generate(other).await.unwrap().into_inner();
    let first = other.message().await.unwrap().expect("a first chunk");
    assert_eq!(first.finish_reason, 0);

    assert!(
        client
            .abort(abort_request("job"))
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
    let mut ends = Vec::new();
    while let Some(chunk) = job.message().await.unwrap() {
        if chunk.finish_reason != 0 {
            ends.push((chunk.index, chunk.finish_reason()));
        }
    }
    assert_eq!(ends, [(1, pb::FinishReason::Abort)]);
    // The other request still runs: its own Abort finds it.
    assert!(
        client
            .abort(abort_request("job-0"))
            .await
            .unwrap()
            .into_inner()
            .aborted,
        "the other request `job-0` was aborted with `job`"
    );
    let mut last = first;
    while let Some(chunk) = other.message().await.unwrap() {
        last = chunk;
    }
    assert_eq!(last.finish_reason(), pb::FinishReason::Abort);
    assert_leaves_flight(&mut client, "job").await;
}

/// Every choice has the request's deadline, counted from the request's arrival: a later
/// choice tells its prefill node the time left, not the whole timeout again.
#[tokio::test]
async fn every_choice_has_the_request_s_deadline() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let delay = Duration::from_millis(200);
    *p.state.prefill_delay.lock().unwrap() = delay;
    let mut cfg = config(&[&p], &[&d]);
    cfg.node_timeout = Duration::from_secs(60);
    cfg.request_timeout = Some(Duration::from_secs(30));
    let router = RouterUnderTest::start(cfg).await;
    let mut client = router.client();

    // The router's --request-timeout, then the client's grpc-timeout.
    let (_, error) = collect(&mut client, choices("late", 2)).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    let mut request = tonic::Request::new(choices("later", 2));
    request.set_timeout(Duration::from_secs(20));
    let (_, error) = collect(&mut client, request.into_inner()).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    let timeouts = p.state.prefill_timeouts.lock().unwrap().clone();
    assert_eq!(timeouts.len(), 4);
    for pair in timeouts.chunks(2) {
        // The second choice's prefill went out after the first's had taken `delay`.
        let (first, second) = (timeout_of(&pair[0]), timeout_of(&pair[1]));
        assert!(
            second + delay <= first,
            "the second choice's deadline is later: {first:?} then {second:?}"
        );
    }
}

/// The request's id is free as soon as its last chunk is out: a client may reuse it at once.
#[tokio::test]
async fn the_request_id_is_free_once_the_last_chunk_is_out() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    for n in [2, 3, 1, 2] {
        let mut stream = client
            .generate(choices("again", n))
            .await
            .unwrap()
            .into_inner();
        let mut finished = 0;
        while finished < n {
            let chunk = stream.message().await.unwrap().expect("a chunk");
            finished += u32::from(chunk.finish_reason != 0);
        }
        // Not waiting for the stream's end.
        drop(stream);
    }
    // A request that fails gives its id back too.
    d.state
        .fail_next
        .store(1, std::sync::atomic::Ordering::SeqCst);
    *d.state.fail_code.lock().unwrap() = Code::InvalidArgument;
    let (_, error) = collect(&mut client, choices("again", 2)).await.unwrap();
    assert!(error.is_some());
    let (_, error) = collect(&mut client, choices("again", 2)).await.unwrap();
    assert!(error.is_none(), "{error:?}");
}
