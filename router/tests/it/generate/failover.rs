//! Failures and node choice in the generate flow: a failed prefill retried once elsewhere,
//! errors that reach the client, a decode node replaced before its first token, and
//! prefix-aware routing that yields to load.

use std::sync::atomic::Ordering::SeqCst;

use pd_router::PolicyKind;
use tonic::Code;

use crate::fake::*;

#[tokio::test]
async fn a_failed_prefill_is_retried_once_on_another_node() {
    let p0 = FakeNode::prefill().await;
    let p1 = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p0, &p1], &[&d]);
    cfg.policy = PolicyKind::RoundRobin;
    let router = RouterUnderTest::start(cfg).await;
    eventually("all nodes up", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    p0.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("retry me"))
        .await
        .unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    assert_eq!(p0.state.prefill_count(), 1);
    assert_eq!(p1.state.prefill_count(), 1);
    let lease = d.state.decodes.lock().unwrap()[0]
        .kv
        .clone()
        .unwrap()
        .lease_id;
    assert_eq!(*p1.state.leases.lock().unwrap(), [lease]);
    eventually("p1's lease is released", || p1.state.released() == [lease]).await;
    let failed_id = p0.state.prefills.lock().unwrap()[0].request_id.clone();
    eventually("the failed attempt is aborted", || {
        p0.state.aborted() == [failed_id.clone()]
    })
    .await;
}

#[tokio::test]
async fn prefill_failures_reach_the_client_without_hanging() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();

    // Unavailable, and no other node to retry on.
    p.state.fail_next.store(1, SeqCst);
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(chunks.is_empty());
    let status = error.unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains(&p.address()), "{status:?}");
    assert!(status.message().contains("scripted failure"), "{status:?}");

    // The node's verdict on the request is passed on, not retried.
    eventually("the prefill node is up again", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    *p.state.fail_code.lock().unwrap() = Code::InvalidArgument;
    p.state.fail_next.store(1, SeqCst);
    let before = p.state.prefill_count();
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert_eq!(error.unwrap().code(), Code::InvalidArgument);
    assert_eq!(p.state.prefill_count(), before + 1);
    assert_eq!(d.state.decode_count(), 0);
}

#[tokio::test]
async fn a_decode_failure_after_tokens_is_unavailable() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102]],
        end: End::Fail(Code::Internal),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    let status = error.expect("an error after the tokens");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("decode node"), "{status:?}");
    assert!(status.message().contains("after 3 tokens"), "{status:?}");
    eventually("the lease is released", || p.state.released().len() == 1).await;
    assert_eq!(d.state.decode_count(), 1, "no retry once tokens streamed");
}

#[tokio::test]
async fn a_decode_node_failing_before_its_first_token_is_replaced() {
    let p = FakeNode::prefill().await;
    let d0 = FakeNode::decode().await;
    let d1 = FakeNode::decode().await;
    // d0 is the least loaded, so it is tried first.
    d1.state.load.store(3, SeqCst);
    let router = RouterUnderTest::start(config(&[&p], &[&d0, &d1])).await;
    eventually("all nodes up with their load", || {
        router
            .registry
            .nodes()
            .iter()
            .all(|n| n.is_up() && n.info().is_some())
            && router.registry.nodes()[2].load() == 3
    })
    .await;
    d0.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    assert_eq!(d0.state.decode_count(), 1);
    assert_eq!(d1.state.decode_count(), 1);
    let kv0 = d0.state.decodes.lock().unwrap()[0].kv.clone().unwrap();
    let kv1 = d1.state.decodes.lock().unwrap()[0].kv.clone().unwrap();
    assert_eq!(kv0, kv1, "the same lease, still held");
    eventually("released once", || p.state.released() == [kv1.lease_id]).await;
}

#[tokio::test]
async fn prefix_aware_routing_follows_the_prompt_and_yields_to_load() {
    let p0 = FakeNode::prefill().await;
    let p1 = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p0, &p1], &[&d])).await;
    eventually("all nodes up", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    let mut client = router.client();
    let doc = "The history of the city begins with a small settlement by the river. ".repeat(8);
    let (_, e) = collect(&mut client, text_request(&doc)).await.unwrap();
    assert!(e.is_none());
    let (home, away) = if p0.state.prefill_count() == 1 {
        (&p0, &p1)
    } else {
        (&p1, &p0)
    };
    for suffix in ["Summarize.", "Translate it.", "Who lived there?"] {
        let (_, e) = collect(&mut client, text_request(&format!("{doc}{suffix}")))
            .await
            .unwrap();
        assert!(e.is_none());
    }
    assert_eq!(
        home.state.prefill_count(),
        4,
        "the shared prefix stays home"
    );
    assert_eq!(away.state.prefill_count(), 0);

    // The home node gets busy: balance wins over affinity.
    home.state.load.store(50, SeqCst);
    let home_node = router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == home.address())
        .unwrap()
        .clone();
    eventually("the router sees the load", || home_node.load() >= 50).await;
    let (_, e) = collect(&mut client, text_request(&format!("{doc}Again.")))
        .await
        .unwrap();
    assert!(e.is_none());
    assert_eq!(away.state.prefill_count(), 1);
}
