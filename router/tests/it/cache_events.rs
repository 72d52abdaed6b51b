//! Routing by what the nodes' caches hold, as their `CacheEvents` streams say (scripted on
//! fake nodes), the fallback to the router's own guess when a stream breaks, and the
//! predicted-versus-delivered counters.

use pd_engine::kv::prefix::events::{CacheEvent, EventBatch, Snapshot, Tier};
use pd_engine::kv::prefix::hash::{BlockHash, block_hashes};
use pd_proto::cache_events::{wire_batch, wire_snapshot};
use pd_proto::pb;
use pd_router::cache_index::TierMatch;
use pd_router::metrics::ids::name;
use pd_test_support::metrics::value;

use crate::fake::{FakeNode, RouterUnderTest, collect, config, eventually};

const BLOCK: usize = 16;

fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
    block_hashes(tokens, BLOCK, None)
}

fn snapshot(device: &[BlockHash], host: &[BlockHash]) -> pb::CacheEventsMessage {
    wire_snapshot(&Snapshot {
        epoch: 1,
        seq: 0,
        block_size: BLOCK,
        device_capacity: 1000,
        host_capacity: 1000,
        device: device.to_vec(),
        host: host.to_vec(),
    })
}

/// Change number `seq` (after the snapshot's 0).
fn change(seq: u64, event: CacheEvent) -> pb::CacheEventsMessage {
    wire_batch(&EventBatch {
        epoch: 1,
        first_seq: seq,
        events: vec![event],
    })
}

fn node_id(router: &RouterUnderTest, node: &FakeNode) -> usize {
    let addr = node.address();
    router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == addr)
        .expect("registered")
        .id
}

async fn wait_in_sync(router: &RouterUnderTest, nodes: &[&FakeNode]) {
    for node in nodes {
        let id = node_id(router, node);
        let index = router.registry.cache_index().clone();
        eventually("the node's cache events in sync", || index.in_sync(id)).await;
    }
}

/// Waits until the router's view of `node` matches `tokens` as `want`.
async fn wait_match(router: &RouterUnderTest, node: &FakeNode, tokens: &[u32], want: TierMatch) {
    let id = node_id(router, node);
    let index = router.registry.cache_index().clone();
    let h = hashes(tokens);
    eventually("the change applied", || index.lookup(id, &h) == Some(want)).await;
}

async fn generate(router: &RouterUnderTest, tokens: &[u32]) {
    let request = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
            ids: tokens.to_vec(),
        })),
        max_tokens: Some(64),
        ..Default::default()
    };
    let (chunks, error) = collect(&mut router.client(), request).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert!(chunks.last().and_then(|c| c.usage.as_ref()).is_some());
}

fn scripted(node: &FakeNode, messages: Vec<pb::CacheEventsMessage>) {
    *node.state.cache_events.lock().unwrap() = Some(messages);
}

#[tokio::test]
async fn a_prompt_goes_to_the_node_that_holds_it_device_before_host_until_evicted() {
    let (p0, p1, d) = (
        FakeNode::prefill().await,
        FakeNode::prefill().await,
        FakeNode::decode().await,
    );
    let prompt: Vec<u32> = (1000..1070).collect(); // 4 full blocks
    let h = hashes(&prompt);
    scripted(&p0, vec![snapshot(&[], &h)]);
    scripted(&p1, vec![snapshot(&h, &[])]);
    scripted(&d, vec![snapshot(&[], &[])]);
    let router = RouterUnderTest::start(config(&[&p0, &p1], &[&d])).await;
    wait_in_sync(&router, &[&p0, &p1, &d]).await;

    for _ in 0..3 {
        generate(&router, &prompt).await;
    }
    assert_eq!(p1.state.prefill_count(), 3, "the device copy wins");
    assert_eq!(p0.state.prefill_count(), 0);

    // p1 evicts the prompt: the host copy on p0 is the best left.
    p1.state.publish_cache_events(change(
        1,
        CacheEvent::Removed {
            tier: Tier::Device,
            hashes: h.clone(),
        },
    ));
    wait_match(&router, &p1, &prompt, TierMatch::default()).await;
    generate(&router, &prompt).await;
    assert_eq!(
        p0.state.prefill_count(),
        1,
        "after the eviction, the host copy"
    );
    assert_eq!(p1.state.prefill_count(), 3);
}

#[tokio::test]
async fn a_node_whose_stream_broke_is_scored_by_the_routers_guess() {
    let (p0, p1, d) = (
        FakeNode::prefill().await,
        FakeNode::prefill().await,
        FakeNode::decode().await,
    );
    scripted(&p0, vec![snapshot(&[], &[])]);
    scripted(&p1, vec![snapshot(&[], &[])]);
    let router = RouterUnderTest::start(config(&[&p0, &p1], &[&d])).await;
    wait_in_sync(&router, &[&p0, &p1]).await;

    let prompt: Vec<u32> = (2000..2070).collect();
    let h = hashes(&prompt);
    // Cold everywhere: one node computes it (and the router's guess remembers that one).
    generate(&router, &prompt).await;
    let (x, y) = if p0.state.prefill_count() == 1 {
        (&p0, &p1)
    } else {
        (&p1, &p0)
    };
    assert_eq!(x.state.prefill_count(), 1);

    // The other node reports the prompt on its host tier; the first reports nothing: the
    // reports decide while both are in sync.
    y.state.publish_cache_events(change(
        1,
        CacheEvent::Stored {
            tier: Tier::Host,
            hashes: h.clone(),
        },
    ));
    wait_match(&router, y, &prompt, TierMatch { device: 0, host: 4 }).await;
    generate(&router, &prompt).await;
    assert_eq!(y.state.prefill_count(), 1, "the reported host copy");

    // The first node's stream breaks (and it answers UNIMPLEMENTED from now on): the router
    // falls back to its guess for it, which holds the whole prompt, as device blocks.
    x.state.end_cache_streams(None);
    let id = node_id(&router, x);
    let index = router.registry.cache_index().clone();
    eventually("the broken stream noticed", || !index.in_sync(id)).await;
    generate(&router, &prompt).await;
    assert_eq!(
        x.state.prefill_count(),
        2,
        "the guess for the node out of sync"
    );
    assert_eq!(y.state.prefill_count(), 1);
}

#[tokio::test]
async fn the_decode_node_holding_the_earlier_turn_is_chosen() {
    let (p, d0, d1) = (
        FakeNode::prefill().await,
        FakeNode::decode().await,
        FakeNode::decode().await,
    );
    let turn1: Vec<u32> = (3000..3040).collect();
    let mut turn2 = turn1.clone();
    turn2.extend(3100..3140);
    scripted(&d0, vec![snapshot(&[], &[])]);
    scripted(&d1, vec![snapshot(&hashes(&turn1), &[])]);
    let router = RouterUnderTest::start(config(&[&p], &[&d0, &d1])).await;
    wait_in_sync(&router, &[&d0, &d1]).await;

    for _ in 0..3 {
        generate(&router, &turn2).await;
    }
    assert_eq!(d1.state.decode_count(), 3);
    assert_eq!(d0.state.decode_count(), 0);
}

#[tokio::test]
async fn predicted_and_delivered_tokens_are_counted_per_node_role_and_tier() {
    let (p, d) = (FakeNode::prefill().await, FakeNode::decode().await);
    let prompt: Vec<u32> = (4000..4070).collect(); // 70 tokens: 4 full blocks, all usable
    let h = hashes(&prompt);
    scripted(&p, vec![snapshot(&h[..2], &h[2..4])]);
    scripted(&d, vec![snapshot(&h[..1], &[])]);
    // The prefill node reports 16 local and 32 external tokens: 16 from its host tier, 16
    // from a peer.
    p.state
        .host_cached
        .store(16, std::sync::atomic::Ordering::SeqCst);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    wait_in_sync(&router, &[&p, &d]).await;

    generate(&router, &prompt).await;
    generate(&router, &prompt).await;

    let text = router.metrics_text().await;
    let get = |family: &str, node: &FakeNode, role: &str, tier: &str| {
        let node = format!("node=\"{}\"", node.address());
        let role = format!("role=\"{role}\"");
        let tier = format!("tier=\"{tier}\"");
        value(&text, family, &[&node, &role, &tier])
            .unwrap_or_else(|| panic!("no {family} {node} {role} {tier} in\n{text}"))
    };
    let predicted = name::PREFIX_PREDICTED_TOKENS_TOTAL;
    let delivered = name::PREFIX_DELIVERED_TOKENS_TOTAL;
    // Two requests, each: 2 device blocks and 2 host blocks of 16 tokens predicted.
    assert_eq!(get(predicted, &p, "prefill", "device"), 64.0);
    assert_eq!(get(predicted, &p, "prefill", "host"), 64.0);
    assert_eq!(get(delivered, &p, "prefill", "device"), 32.0);
    assert_eq!(get(delivered, &p, "prefill", "host"), 32.0);
    assert_eq!(get(delivered, &p, "prefill", "peer"), 32.0);
    // The decode node: one device block predicted; its last message's usage (the fake's
    // 500 local tokens) delivered.
    assert_eq!(get(predicted, &d, "decode", "device"), 32.0);
    assert_eq!(get(predicted, &d, "decode", "host"), 0.0);
    assert_eq!(get(delivered, &d, "decode", "device"), 1000.0);
}

#[tokio::test]
async fn nodes_without_cache_events_are_routed_on_the_guess_and_predict_nothing() {
    let (p0, p1, d) = (
        FakeNode::prefill().await,
        FakeNode::prefill().await,
        FakeNode::decode().await,
    );
    let router = RouterUnderTest::start(config(&[&p0, &p1], &[&d])).await;
    let prompt: Vec<u32> = (5000..5070).collect();
    for _ in 0..3 {
        generate(&router, &prompt).await;
    }
    // The guess keeps the prompt on one node.
    let counts = [p0.state.prefill_count(), p1.state.prefill_count()];
    assert!(counts == [3, 0] || counts == [0, 3], "{counts:?}");
    let text = router.metrics_text().await;
    let predicted = pd_test_support::metrics::sum(&text, name::PREFIX_PREDICTED_TOKENS_TOTAL, &[]);
    let delivered = pd_test_support::metrics::sum(&text, name::PREFIX_DELIVERED_TOKENS_TOTAL, &[]);
    assert_eq!((predicted, delivered), (0.0, 0.0));
    assert!(
        text.contains(name::PREFIX_PREDICTED_TOKENS_TOTAL),
        "series exist at 0"
    );
}

#[tokio::test]
async fn a_node_joins_the_index_with_its_snapshot_and_leaves_it_when_removed() {
    let (p, d, joining) = (
        FakeNode::prefill().await,
        FakeNode::decode().await,
        FakeNode::prefill().await,
    );
    let prompt: Vec<u32> = (6000..6040).collect();
    scripted(&joining, vec![snapshot(&hashes(&prompt), &[])]);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let registry = router.registry.clone();
    registry
        .add_discovered(
            pd_router::registry::Role::Prefill,
            &joining.address(),
            std::time::Duration::from_millis(50),
            std::time::Duration::from_millis(500),
        )
        .unwrap();
    wait_in_sync(&router, &[&joining]).await;
    let id = node_id(&router, &joining);
    let index = registry.cache_index().clone();
    assert_eq!(index.total_blocks(), 2);

    registry.remove_discovered(pd_router::registry::Role::Prefill, &joining.address());
    assert!(!index.in_sync(id));
    assert_eq!(index.total_blocks(), 0, "its blocks left the index");
    // Its subscription ends too: it stays out of the index.
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert_eq!(index.total_blocks(), 0);
    assert_eq!(index.lookup(id, &hashes(&prompt)), None);
}

#[tokio::test]
async fn with_cache_events_off_no_node_is_subscribed_and_nothing_is_predicted() {
    let (p, d) = (FakeNode::prefill().await, FakeNode::decode().await);
    let prompt: Vec<u32> = (6000..6070).collect();
    scripted(&p, vec![snapshot(&hashes(&prompt), &[])]);
    scripted(&d, vec![snapshot(&[], &[])]);
    let mut config = config(&[&p], &[&d]);
    config.cache_events = pd_router::CacheEventsMode::Off;
    let router = RouterUnderTest::start(config).await;
    generate(&router, &prompt).await;
    generate(&router, &prompt).await;

    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(p.state.cache_subscriptions.load(SeqCst), 0);
    assert_eq!(d.state.cache_subscriptions.load(SeqCst), 0);
    assert!(!router.registry.cache_index().in_sync(node_id(&router, &p)));
    let text = router.metrics_text().await;
    let predicted = pd_test_support::metrics::sum(&text, name::PREFIX_PREDICTED_TOKENS_TOTAL, &[]);
    assert_eq!(predicted, 0.0, "routed on the guess: no prediction counted");
}
