//! Nodes found through DNS (`--prefill-dns` / `--decode-dns`): names resolved by the system
//! resolver (`localhost`), nodes joining and leaving while requests run, none lost.

use std::time::Duration;

use pd_router::discovery::DnsTarget;
use pd_router::registry::Role;

use crate::fake::*;

fn dns_config(prefill: &FakeNode, decode: &FakeNode) -> pd_router::RouterConfig {
    let mut cfg = config(&[], &[]);
    let target = |role, node: &FakeNode| {
        DnsTarget::parse(role, &format!("localhost:{}", node.addr.port())).unwrap()
    };
    cfg.prefill_dns = vec![target(Role::Prefill, prefill)];
    cfg.decode_dns = vec![target(Role::Decode, decode)];
    cfg.dns_interval = Duration::from_millis(100);
    cfg
}

#[tokio::test]
async fn nodes_behind_a_name_are_found_and_one_leaving_is_drained_without_failing_requests() {
    let p = FakeNode::prefill().await;
    let d1 = FakeNode::decode().await;
    let d2 = FakeNode::decode().await;
    // No static node at all: everything comes from resolving `localhost`.
    let router = RouterUnderTest::start(dns_config(&p, &d1)).await;
    let mut client = router.client();
    for _ in 0..3 {
        let (_, error) = collect(&mut client, text_request("found by name"))
            .await
            .unwrap();
        assert!(error.is_none(), "{error:?}");
    }
    assert_eq!(d1.state.decode_count(), 3);

    // A node joins (what a new address under the name does) and is used once it is up.
    let registry = router.registry.clone();
    registry
        .add_discovered(
            Role::Decode,
            &d2.address(),
            Duration::from_millis(50),
            Duration::from_millis(500),
        )
        .unwrap();
    let joined = || {
        registry
            .nodes()
            .iter()
            .any(|n| n.addr == d2.address() && n.is_up())
    };
    eventually("the joined node is up", joined).await;

    // Traffic runs while d1 leaves the name: every request completes.
    let mut running = tokio::task::JoinSet::new();
    for i in 0..24 {
        let mut client = router.client();
        running.spawn(async move {
            collect(&mut client, text_request(&format!("request {i}")))
                .await
                .map(|(_, error)| error)
        });
        if i == 8 {
            registry.remove_discovered(Role::Decode, &d1.address());
        }
    }
    while let Some(done) = running.join_next().await {
        let error = done.unwrap().expect("the stream completes");
        assert!(error.is_none(), "a request failed: {error:?}");
    }
    assert!(
        registry.nodes().iter().all(|n| n.addr != d1.address()),
        "the node that left is out of the registry"
    );
    let (before1, before2) = (d1.state.decode_count(), d2.state.decode_count());
    for _ in 0..4 {
        let (_, error) = collect(&mut client, text_request("after")).await.unwrap();
        assert!(error.is_none(), "{error:?}");
    }
    assert_eq!(
        d1.state.decode_count(),
        before1,
        "no new request on the drained node"
    );
    assert_eq!(d2.state.decode_count(), before2 + 4);
}

#[tokio::test]
async fn a_discovered_node_that_dies_is_routed_around_and_back_when_it_returns() {
    let p = FakeNode::prefill().await;
    let mut d = FakeNode::decode().await;
    let router = RouterUnderTest::start(dns_config(&p, &d)).await;
    let mut client = router.client();
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    d.stop().await;
    router
        .wait_health(tonic_health::pb::health_check_response::ServingStatus::NotServing)
        .await;
    d.restart().await;
    router
        .wait_health(tonic_health::pb::health_check_response::ServingStatus::Serving)
        .await;
    let (_, error) = collect(&mut client, text_request("y")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
}
