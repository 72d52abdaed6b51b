//! `--max-waiting`: a decode node holds at most `--max-num-seqs + --max-waiting` requests
//! open, and refuses one more with RESOURCE_EXHAUSTED (the router then tries another node).
//! A request is held open deterministically by a KV pull from a peer that never answers.

use std::time::Duration;

use pd_proto::pb;
use pd_test_support::node::{decode_node, prefill_node};
use pd_test_support::{greedy, prompt};
use tonic::Code;

/// A listener that accepts connections and never answers on them.
async fn silent_peer() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    addr
}

fn aggregated(id: &str, tokens: &[u32]) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: id.into(),
        prompt_token_ids: tokens.to_vec(),
        sampling: greedy(),
        max_tokens: 2,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_refuses_with_resource_exhausted_and_takes_work_once_a_request_leaves() {
    let (p, d) = tokio::join!(
        prefill_node(&[]),
        decode_node(&["--max-num-seqs", "1", "--max-waiting", "1"])
    );
    let tokens = prompt(24, 7);
    let r = p
        .prefill()
        .await
        .prefill(pd_test_support::prefill_request("held", tokens.clone()))
        .await
        .unwrap()
        .into_inner();
    let silent = silent_peer().await;
    d.set_kv_peer_addrs(&[silent.to_string()]).await;
    let mut kv = r.kv.clone().unwrap();
    kv.addr = silent.to_string();
    // Two requests open (one running's worth plus one waiting): both pull from the silent
    // peer, so both stay open until their callers give up.
    let mut held = Vec::new();
    for id in ["held-1", "held-2"] {
        let mut client = d.decode().await;
        let req = pb::DecodeRequest {
            request_id: id.into(),
            prompt_token_ids: tokens.clone(),
            first_token: r.first_token.as_ref().unwrap().token_id,
            sampling: greedy(),
            max_tokens: 4,
            kv: Some(kv.clone()),
            ..Default::default()
        };
        held.push(tokio::spawn(async move { client.decode(req).await }));
    }
    // Wait until the node holds both (a third is refused only then).
    for _ in 0..1000 {
        if d.open_requests() == 2 {
            break;
        }
        if let Some(i) = held.iter().position(|h| h.is_finished()) {
            let ended = held.remove(i).await.unwrap().map(|_| "a stream");
            panic!("a held request ended before the node was full: {ended:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut client = d.decode().await;
    let refused = client.decode(aggregated("third", &tokens)).await.err();
    let refused = refused.expect("a third request is refused while two are open");
    assert!(refused.message().contains("--max-waiting"), "{refused:?}");
    assert!(held.iter().all(|h| !h.is_finished()));

    // One caller gives up: its request leaves, and the node takes work again.
    held.remove(0).abort();
    let mut served = false;
    for _ in 0..500 {
        match client.decode(aggregated("fourth", &tokens)).await {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                let mut last = None;
                while let Some(m) = stream.message().await.unwrap() {
                    last = Some(m);
                }
                assert_ne!(last.unwrap().finish_reason, 0);
                served = true;
                break;
            }
            Err(e) if e.code() == Code::ResourceExhausted => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert!(served, "the node never took work again");
    for h in held {
        h.abort();
    }
    let lease = r.kv.unwrap();
    p.prefill()
        .await
        .release_kv(pb::ReleaseKvRequest {
            lease_id: lease.lease_id,
            lease_secret: lease.lease_secret,
        })
        .await
        .unwrap();
    tokio::join!(p.stop(), d.stop());
}
