//! `CacheEvents` on an in-process prefill node: a snapshot, then the prompt's blocks as
//! device-tier stores under one epoch; a later subscriber's snapshot holds them; the number
//! of subscribers is capped; the stream ends when the node drains.

use std::time::{Duration, Instant};

use pd_engine::kv::prefix::events::{CacheEvent, Tier};
use pd_engine::kv::prefix::hash::{BlockHash, HashAlgo, block_hashes_with};
use pd_node::cache_events::MAX_SUBSCRIBERS;
use pd_proto::cache_events::{CacheMessage, message};
use pd_proto::pb;
use tonic::Code;
use tonic::codec::Streaming;

use crate::{prefill_node, prefill_request, prompt, release_of};

async fn next(stream: &mut Streaming<pb::CacheEventsMessage>) -> CacheMessage {
    let received = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("a message in time")
        .expect("the stream goes on")
        .expect("not ended");
    message(&received).expect("well-formed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_shows_up_as_device_stores_of_its_prompt_blocks() {
    let node = prefill_node(&[]).await;
    let mut client = node.prefill().await;
    let info = node.info().await;
    let algo = HashAlgo::from_reported(&info.prefix_caching_hash_algo).expect("known algo");

    let mut stream = client
        .cache_events(pb::CacheEventsRequest {})
        .await
        .expect("subscribed")
        .into_inner();
    let CacheMessage::Snapshot(snap) = next(&mut stream).await else {
        panic!("a snapshot first");
    };
    assert_eq!(snap.block_size, 16);
    assert_eq!(snap.device_capacity as u64, info.num_blocks);
    assert!(
        snap.device.is_empty() && snap.host.is_empty(),
        "a fresh node"
    );

    // 37 tokens and the first token: 2 full blocks.
    let tokens = prompt(37, 3);
    let want: Vec<BlockHash> =
        block_hashes_with(&tokens, snap.block_size, None, algo)[..2].to_vec();
    let r = client
        .prefill(prefill_request("a", tokens))
        .await
        .expect("prefill")
        .into_inner();

    let mut next_seq = snap.seq + 1;
    let mut stored: Vec<BlockHash> = Vec::new();
    while !want.iter().all(|h| stored.contains(h)) {
        let CacheMessage::Batch(batch) = next(&mut stream).await else {
            panic!("only batches after the snapshot");
        };
        assert_eq!(batch.epoch, snap.epoch, "one epoch");
        assert_eq!(batch.first_seq, next_seq, "no gap");
        next_seq += batch.events.len() as u64;
        for event in batch.events {
            match event {
                CacheEvent::Stored {
                    tier: Tier::Device,
                    hashes,
                } => stored.extend(hashes),
                other => panic!("only device stores on a fresh node: {other:?}"),
            }
        }
    }
    assert_eq!(stored, want, "the prompt's blocks, in order");

    // A later subscriber starts from a snapshot that holds them.
    let mut later = client
        .cache_events(pb::CacheEventsRequest {})
        .await
        .expect("subscribed")
        .into_inner();
    let CacheMessage::Snapshot(again) = next(&mut later).await else {
        panic!("a snapshot first");
    };
    assert_eq!(again.epoch, snap.epoch);
    assert!(again.seq >= next_seq - 1);
    assert!(want.iter().all(|h| again.device.contains(h)));

    client
        .release_kv(release_of(&r.kv.expect("kv")))
        .await
        .expect("released");
    node.assert_all_blocks_free().await;

    // Two open already: up to the cap, then RESOURCE_EXHAUSTED.
    let mut more = Vec::new();
    for _ in 2..MAX_SUBSCRIBERS {
        let mut s = client
            .cache_events(pb::CacheEventsRequest {})
            .await
            .expect("under the cap")
            .into_inner();
        // Answered only once the node took the stream: counts toward the cap.
        next(&mut s).await;
        more.push(s);
    }
    let refused = client
        .cache_events(pb::CacheEventsRequest {})
        .await
        .expect_err("over the cap");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    // A stream given back makes room (the node sees the cancellation soon, not at once).
    drop(more.pop());
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = loop {
        match client.cache_events(pb::CacheEventsRequest {}).await {
            Ok(s) => break s.into_inner(),
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
                assert!(Instant::now() < deadline, "the slot never came back");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert!(matches!(next(&mut last).await, CacheMessage::Snapshot(_)));

    // Draining ends every stream cleanly.
    let (_, task) = node.begin_shutdown();
    loop {
        let received = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("the stream ends on drain");
        match received {
            Ok(None) => break,
            Ok(Some(m)) => assert!(
                matches!(message(&m), Ok(CacheMessage::Batch(_))),
                "only batches before the end"
            ),
            Err(e) => panic!("a clean end, not {e}"),
        }
    }
    task.await.expect("node task").expect("clean stop");
}
