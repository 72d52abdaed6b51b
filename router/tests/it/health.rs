//! Node health checks, the router's own health, layout compatibility, reflection, draining.

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use pd_proto::pb;
use pd_router::PolicyKind;
use pd_router::registry::{Node, NodeHealth};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::fake::*;

fn node(router: &RouterUnderTest, fake: &FakeNode) -> Arc<Node> {
    router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == fake.address())
        .expect("a registered node")
        .clone()
}

#[tokio::test]
async fn a_dead_node_is_routed_around_and_used_again_when_back() {
    let p0 = FakeNode::prefill().await;
    let mut p1 = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p0, &p1], &[&d]);
    cfg.policy = PolicyKind::RoundRobin;
    let router = RouterUnderTest::start(cfg).await;
    let n1 = node(&router, &p1);
    eventually("p1 up", || n1.is_up()).await;

    p1.stop().await;
    eventually("p1 marked down", || !n1.is_up()).await;
    assert!(matches!(n1.health(), NodeHealth::Down(_)));
    assert_eq!(router.health().await, ServingStatus::Serving);
    let mut client = router.client();
    let before = p1.state.prefill_count();
    for _ in 0..4 {
        let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
        assert!(error.is_none(), "{error:?}");
    }
    assert_eq!(p0.state.prefill_count(), 4);
    assert_eq!(p1.state.prefill_count(), before);

    p1.restart().await;
    eventually("p1 up again", || n1.is_up()).await;
    for _ in 0..4 {
        let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
        assert!(error.is_none(), "{error:?}");
    }
    assert!(p1.state.prefill_count() >= 1, "p1 is used again");
}

#[tokio::test]
async fn without_a_decode_node_the_router_is_not_serving() {
    let p = FakeNode::prefill().await;
    let mut d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();

    d.stop().await;
    router.wait_health(ServingStatus::NotServing).await;
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(chunks.is_empty());
    let status = error.unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("no healthy decode node"),
        "{status:?}"
    );
    assert!(status.message().contains(&d.address()), "{status:?}");
    assert_eq!(p.state.prefill_count(), 0, "nothing was prefilled in vain");

    d.restart().await;
    router.wait_health(ServingStatus::Serving).await;
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none());

    // A node that answers but calls itself unhealthy is down too.
    d.state.unhealthy.store(true, SeqCst);
    router.wait_health(ServingStatus::NotServing).await;
    d.state.unhealthy.store(false, SeqCst);
    router.wait_health(ServingStatus::Serving).await;
}

#[tokio::test]
async fn mismatched_layouts_are_refused_with_failed_precondition() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // Another KV cache type is another fingerprint; the refusal says which types differ.
    *d.state.fingerprint.lock().unwrap() = "beefbeef".into();
    *d.state.kv_cache_dtype.lock().unwrap() = "bfloat16".into();
    let router = RouterUnderTest::start_unchecked(config(&[&p], &[&d])).await;
    eventually("both nodes up", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    assert_eq!(router.health().await, ServingStatus::NotServing);
    let mut client = router.client();
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    let status = error.unwrap();
    assert_eq!(status.code(), Code::FailedPrecondition);
    for needle in [
        FINGERPRINT,
        "beefbeef",
        &p.address(),
        &d.address(),
        "KV cache float32",
        "KV cache bfloat16",
    ] {
        assert!(status.message().contains(needle), "{needle}: {status:?}");
    }
    *d.state.kv_cache_dtype.lock().unwrap() = "float32".into();

    // Same fingerprint, other block size: still refused.
    *d.state.fingerprint.lock().unwrap() = FINGERPRINT.into();
    d.state.block_size.store(32, SeqCst);
    eventually("the new layout is seen", || {
        node(&router, &d)
            .layout()
            .is_some_and(|l| l.block_size == 32)
    })
    .await;
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    let status = error.unwrap();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("block size 32"), "{status:?}");
    assert_eq!(p.state.prefill_count(), 0);

    d.state.block_size.store(16, SeqCst);
    router.wait_health(ServingStatus::Serving).await;
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none());
}

#[tokio::test]
async fn a_node_given_the_wrong_role_is_down_with_the_reason() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    // The decode node passed as a prefill node.
    let router = RouterUnderTest::start_unchecked(config(&[&d], &[&d])).await;
    let wrong = router.registry.nodes()[0].clone();
    eventually("checked", || wrong.health() != NodeHealth::Unknown).await;
    match wrong.health() {
        NodeHealth::Down(reason) => assert!(reason.contains("--prefill"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(router.health().await, ServingStatus::NotServing);
    drop(p);
}

#[tokio::test]
async fn reflection_lists_the_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start_unchecked(config(&[&p], &[&d])).await;
    let mut client = ServerReflectionClient::new(channel(&router.addr.to_string()).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("{response:?}")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["pd.v1.Generation", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == want), "{names:?}");
    }
    // Only what the router serves: not the nodes' services.
    for other in ["pd.v1.PrefillService", "pd.v1.DecodeService"] {
        assert!(!names.iter().any(|n| n == other), "{names:?}");
    }
}

#[tokio::test]
async fn shutdown_drains_requests_in_flight() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102], vec![103]],
        end: End::Finish(pb::FinishReason::Length),
        delay: Duration::from_millis(150),
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut stream = client
        .generate(text_request("x"))
        .await
        .unwrap()
        .into_inner();
    assert!(stream.message().await.unwrap().is_some());
    let stopping = tokio::spawn(router.shutdown());
    let mut ids = vec![];
    while let Some(chunk) = stream.message().await.unwrap() {
        ids.extend(chunk.token_ids);
    }
    assert_eq!(ids, [101, 102, 103], "the request finished");
    stopping.await.unwrap().expect("a clean stop");
}

/// Nodes dying and coming back, over and over, leave the router no task per restart: each
/// node keeps one health-check task and one channel, and what requests on a dead node
/// spawned (aborts, releases) ends within its deadline. (The router's memory growth in the
/// chaos soak is its allocator settling, not state kept per restart: docs/operations.md,
/// "Chaos soak".)
#[test]
fn node_restarts_leave_the_router_no_tasks_behind() {
    // The router on a runtime of its own, so that its tasks are counted apart from the fake
    // nodes'.
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let (nodes, routing) = (runtime(), runtime());
    let (mut p, mut d) =
        nodes.block_on(async { (FakeNode::prefill().await, FakeNode::decode().await) });
    let router = routing.block_on(RouterUnderTest::start(config(&[&p], &[&d])));
    let serve = |expect_ok: bool| {
        routing.block_on(async {
            if expect_ok {
                router.wait_health(ServingStatus::Serving).await;
            }
            let mut client = router.client();
            for _ in 0..2 {
                let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
                assert_eq!(error.is_none(), expect_ok, "{error:?}");
            }
        })
    };
    // The fewest tasks seen over a while: transient ones (a health probe's connection, a
    // release) come and go, the router's own stay.
    let fewest = |over: Duration| {
        routing.block_on(async {
            let mut fewest = usize::MAX;
            let end = tokio::time::Instant::now() + over;
            while tokio::time::Instant::now() < end {
                fewest = fewest.min(routing.metrics().num_alive_tasks());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            fewest
        })
    };
    serve(true);
    let baseline = fewest(Duration::from_millis(500));

    for _ in 0..10 {
        nodes.block_on(async {
            p.stop().await;
            d.stop().await;
        });
        routing.block_on(router.wait_health(ServingStatus::NotServing));
        serve(false);
        nodes.block_on(async {
            p.restart().await;
            d.restart().await;
        });
        serve(true);
    }
    let after = fewest(Duration::from_secs(3));
    assert!(
        after <= baseline,
        "{after} router tasks after 10 restarts of each node, {baseline} before"
    );
    drop(router);
}
