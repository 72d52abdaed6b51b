//! The router's cache index against real nodes (in process, small device pools and a host
//! tier): after a seeded run with evictions, host-tier spills and restores, after a node
//! restart and after a router restart, the router's view of every node equals the node's
//! own snapshot of its cache, tier by tier.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use pd_engine::kv::prefix::hash::BlockHash;
use pd_proto::cache_events::{CacheMessage, message};
use pd_proto::pb;
use pd_router::RouterConfig;
use pd_test_support::metrics::sum;
use pd_test_support::node::{Node, decode_node, prefill_node};
use pd_test_support::prompt;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::fake::{RouterUnderTest, collect};

type View = (HashSet<BlockHash>, HashSet<BlockHash>);

/// Small enough that the run evicts and spills, with room for one request at a time.
const FLAGS: &[&str] = &["--num-gpu-blocks", "24", "--host-cache-blocks", "8"];

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Prefill,
    Decode,
}

/// The node's own cache, as the first message of a fresh subscription says.
async fn node_view(node: &Node, kind: Kind) -> View {
    let request = pb::CacheEventsRequest {};
    let mut stream = match kind {
        Kind::Prefill => node.prefill().await.cache_events(request).await,
        Kind::Decode => node.decode().await.cache_events(request).await,
    }
    .expect("subscribed")
    .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("a snapshot in time")
        .expect("the stream goes on")
        .expect("not ended");
    let Ok(CacheMessage::Snapshot(snap)) = message(&first) else {
        panic!("a snapshot first");
    };
    (
        snap.device.into_iter().collect(),
        snap.host.into_iter().collect(),
    )
}

fn router_view(router: &RouterUnderTest, node: &Node) -> Option<View> {
    let addr = node.ready.grpc.to_string();
    let id = router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == addr)
        .expect("registered")
        .id;
    let (device, host) = router.registry.cache_index().view(id)?;
    Some((device.into_iter().collect(), host.into_iter().collect()))
}

/// Waits until the router's view of `node` equals the node's own (events trail the
/// requests by a moment); returns it.
async fn views_agree(router: &RouterUnderTest, node: &Node, kind: Kind, what: &str) -> View {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let theirs = node_view(node, kind).await;
        let ours = router_view(router, node);
        if ours.as_ref() == Some(&theirs) {
            return theirs;
        }
        assert!(
            Instant::now() < end,
            "{what}: the router's view {:?} (device, host blocks) != the node's ({}, {})",
            ours.map(|(d, h)| (d.len(), h.len())),
            theirs.0.len(),
            theirs.1.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Prompts drawn from four shared prefixes with their own tails, so that later ones find
/// earlier blocks on the device, in the host tier, or nowhere.
async fn run(router: &RouterUnderTest, rng: &mut ChaCha8Rng, requests: usize) {
    for _ in 0..requests {
        let mut tokens = prompt(16 * rng.random_range(1..4), rng.random_range(0..4));
        tokens.extend(prompt(
            rng.random_range(1..40),
            rng.random_range(100..20_000),
        ));
        let request = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                ids: tokens,
            })),
            max_tokens: Some(3),
            ..Default::default()
        };
        let (_, error) = collect(&mut router.client(), request).await.unwrap();
        assert!(error.is_none(), "{error:?}");
    }
}

/// Waits until the router routes to `prefill`, restarted where a node of router epoch
/// `old_epoch` was: seen up again and its KV address pushed to the decode node.
async fn wait_routable(router: &RouterUnderTest, prefill: &Node, old_epoch: u64) {
    let addr = prefill.ready.grpc.to_string();
    let kv = prefill.ready.kv.expect("a KV address").to_string();
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = router.registry.nodes();
        let p = nodes.iter().find(|n| n.addr == addr).expect("registered");
        let decode_told = nodes
            .iter()
            .filter(|n| n.addr != addr)
            .all(|d| d.knows_kv_peer(&kv));
        if p.epoch() != old_epoch && p.is_routable() && decode_told {
            return;
        }
        assert!(
            Instant::now() < end,
            "the restarted prefill node never routable"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn config(prefill: &Node, decode: &Node) -> RouterConfig {
    let mut config = RouterConfig::new(
        "synthetic:tiny",
        vec![prefill.ready.grpc.to_string()],
        vec![decode.ready.grpc.to_string()],
    );
    config.health_interval = Duration::from_millis(50);
    config.node_timeout = Duration::from_secs(30);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_equals_every_nodes_cache_through_evictions_spills_and_restarts() {
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    let prefill = prefill_node(FLAGS).await;
    let decode = decode_node(FLAGS).await;
    let mut router = RouterUnderTest::start(config(&prefill, &decode)).await;

    run(&router, &mut rng, 24).await;
    for (node, kind, role) in [
        (&prefill, Kind::Prefill, "prefill"),
        (&decode, Kind::Decode, "decode"),
    ] {
        let (device, host) = views_agree(&router, node, kind, role).await;
        assert!(!device.is_empty(), "{role}: blocks on the device");
        assert!(
            !host.is_empty(),
            "{role}: the run spilled blocks to the host tier"
        );
    }

    // A prefill node restarted on its address: a new epoch, an empty cache, then new blocks.
    let port = prefill.ready.grpc.port().to_string();
    let old_epoch = router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == prefill.ready.grpc.to_string())
        .expect("registered")
        .epoch();
    prefill.shutdown().await;
    let mut flags = FLAGS.to_vec();
    flags.extend(["--port", &port]);
    let prefill = prefill_node(&flags).await;
    wait_routable(&router, &prefill, old_epoch).await;
    run(&router, &mut rng, 6).await;
    views_agree(&router, &prefill, Kind::Prefill, "restarted prefill").await;
    views_agree(&router, &decode, Kind::Decode, "decode after the restart").await;

    // A new router learns both caches from their snapshots.
    router.shutdown().await.expect("clean stop");
    router = RouterUnderTest::start(config(&prefill, &decode)).await;
    views_agree(&router, &prefill, Kind::Prefill, "prefill, new router").await;
    run(&router, &mut rng, 6).await;
    views_agree(
        &router,
        &prefill,
        Kind::Prefill,
        "prefill, new router, more requests",
    )
    .await;
    views_agree(&router, &decode, Kind::Decode, "decode, new router").await;
    assert_eq!(lost_unexpectedly(&router).await, 0.0);
}

/// Times the router stopped following a node's events for any reason but a broken stream
/// (a node restart ends its stream: that one is expected).
async fn lost_unexpectedly(router: &RouterUnderTest) -> f64 {
    let text = router.metrics_text().await;
    let family = pd_router::metrics::ids::name::CACHE_EVENTS_LOST_TOTAL;
    sum(&text, family, &[]) - sum(&text, family, &["reason=\"broken\""])
}
