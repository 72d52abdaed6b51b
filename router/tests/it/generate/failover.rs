//! Failures and node choice in the generate flow: a failed prefill retried once elsewhere,
//! errors that reach the client, a decode node replaced before its first token, a stream
//! moved to another decode node after tokens went out, a decode
//! node refusing the prefill node's address (not retried), the prefill KV peers pushed to
//! decode nodes before they are routed to, and prefix-aware routing that yields to load.

use std::sync::atomic::Ordering::SeqCst;

use tonic::Code;

use super::{all_up, two_prefills_in_turn};
use crate::fake::*;

/// A prefill node and two decode nodes, `d1` the busier so that `d0` is tried first, behind a
/// router that sees every node up with its load: `(p, d0, d1, router)`.
async fn d0_tried_first() -> (FakeNode, FakeNode, FakeNode, RouterUnderTest) {
    let p = FakeNode::prefill().await;
    let d0 = FakeNode::decode().await;
    let d1 = FakeNode::decode().await;
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
    (p, d0, d1, router)
}

#[tokio::test]
async fn a_failed_prefill_is_retried_once_on_another_node() {
    let (p0, p1, d, router) = two_prefills_in_turn(|_| {}).await;
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
async fn a_decode_failure_after_tokens_moves_the_stream_to_another_decode_node() {
    let (p, d0, d1, router) = d0_tried_first().await;
    *d0.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102]],
        end: End::Fail(Code::Unavailable),
        ..Default::default()
    };
    *d1.state.script.lock().unwrap() = Script {
        messages: vec![vec![103], vec![104]],
        ..Default::default()
    };
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        all_ids(&chunks),
        [100, 101, 102, 103, 104],
        "no gap, no repeat"
    );
    let last = chunks.last().unwrap();
    assert_eq!(last.usage.unwrap().completion_tokens, 5);

    // The prompt and the tokens sent but the last are prefilled again, for a lease of
    // their own; the next decode node takes the last one as its first, the others as output.
    let prefills = p.state.prefills.lock().unwrap().clone();
    assert_eq!(prefills.len(), 2);
    let prompt = prefills[0].token_ids.clone();
    assert_eq!(
        prefills[1].token_ids,
        [prompt.as_slice(), &[100, 101]].concat()
    );
    assert!(!prefills[1].skip_kv_lease);
    assert_eq!(d0.state.decode_count(), 1);
    let moved = d1.state.decodes.lock().unwrap()[0].clone();
    assert_eq!(moved.prompt_token_ids, prefills[1].token_ids);
    assert_eq!((moved.first_token, moved.resumed_tokens), (102, 2));
    assert_eq!(
        moved.max_tokens, 64,
        "the request's whole max_tokens: resumed ones count"
    );
    let leases = p.state.leases.lock().unwrap().clone();
    assert_eq!(moved.kv.unwrap().lease_id, leases[1]);
    eventually("both leases released", || {
        let mut released = p.state.released();
        released.sort();
        released == leases
    })
    .await;
}

#[tokio::test]
async fn a_kv_pull_failure_after_the_first_token_prefills_again_on_the_same_decode_node() {
    // The prefill node's KV is gone (it died, or the lease expired) when the decode node
    // pulls it: every decode node would fail on that lease, and the client has the first
    // token. The prompt and that token are prefilled again for a new lease.
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    eventually("all nodes up", || {
        router
            .registry
            .nodes()
            .iter()
            .all(|n| n.is_up() && n.info().is_some())
    })
    .await;
    d.state.fail_as_kv_pull.store(true, SeqCst);
    d.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(all_ids(&chunks), [100, 101, 102], "no gap, no repeat");
    let prefills = p.state.prefills.lock().unwrap().clone();
    assert_eq!(prefills.len(), 2, "prefilled again");
    let prompt = prefills[0].token_ids.clone();
    assert_eq!(
        prefills[1].token_ids, prompt,
        "nothing sent but the first token"
    );
    assert_eq!(d.state.decode_count(), 2, "the same decode node, again");
    let second = d.state.decodes.lock().unwrap()[1].clone();
    let leases = p.state.leases.lock().unwrap().clone();
    assert_eq!(second.kv.unwrap().lease_id, leases[1], "the new lease");
    assert_eq!((second.first_token, second.resumed_tokens), (100, 0));
    eventually("both leases released", || {
        let mut released = p.state.released();
        released.sort();
        released == leases
    })
    .await;
    let text = router.metrics_text().await;
    assert!(
        text.contains("pd_router_migrations_total 1"),
        "one move: {}",
        text.lines()
            .filter(|l| l.contains("migrations"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test]
async fn a_decode_node_failing_before_its_first_token_is_replaced() {
    let (p, d0, d1, router) = d0_tried_first().await;
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
    all_up(&router).await;
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

#[tokio::test]
async fn decode_nodes_are_told_the_prefill_kv_peers_before_they_are_routed_to() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // The first two pushes fail: the decode node stays out of routing meanwhile.
    d.state.fail_kv_peers.store(2, SeqCst);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    eventually("the push succeeded", || {
        !d.state.kv_peers.lock().unwrap().is_empty()
    })
    .await;
    let decode = router.registry.role(pd_router::registry::Role::Decode);
    eventually("the decode node is up", || decode[0].is_up()).await;
    assert_eq!(
        d.state.kv_peers.lock().unwrap()[0],
        ["127.0.0.1:9"],
        "the prefill node's KV address, as its Info reports it"
    );
    assert!(decode[0].knows_kv_peer("127.0.0.1:9"));
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    // The release carried the handle's secret (the fake releases nothing without it).
    eventually("released", || p.state.released().len() == 1).await;
    // Unchanged set, same process: no second push.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(d.state.kv_peers.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn aggregated_mode_tells_decode_nodes_they_have_no_kv_peers() {
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[], &[&d])).await;
    eventually("pushed", || !d.state.kv_peers.lock().unwrap().is_empty()).await;
    assert!(d.state.kv_peers.lock().unwrap()[0].is_empty());
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![100], vec![101]],
        ..Default::default()
    };
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert!(!chunks.is_empty());
}

#[tokio::test]
async fn a_decode_node_refusing_the_prefill_address_fails_the_request_without_retry() {
    let (p, d0, d1, router) = d0_tried_first().await;
    *d0.state.fail_code.lock().unwrap() = Code::PermissionDenied;
    d0.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    let status = error.expect("the request fails");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("PERMISSION_DENIED"), "{status:?}");
    assert_eq!(d0.state.decode_count(), 1);
    assert_eq!(d1.state.decode_count(), 0, "not retried elsewhere");
    eventually("the lease is released", || p.state.released().len() == 1).await;
    assert!(
        router.registry.nodes()[1].is_up(),
        "the node answered: it stays in routing"
    );
}
