//! A prefill node and a decode node talking as in the cluster (no router: the test plays it),
//! over real gRPC and the real KV transport on 127.0.0.1 with ephemeral ports, both started
//! in process through their libraries. Every test checks that all KV blocks came back on
//! both nodes.

use std::time::{Duration, Instant};

use clap::Parser;
use decode_node::DecodeArgs;
use pd_engine::sampling::SamplingParams;
use pd_engine::serve::{EngineRequest, Role};
use pd_proto::pb;
use pd_test_support::engine as engines;
use pd_test_support::node::{Node, decode_node, prefill_node};
use pd_test_support::{cache, greedy, prompt};
use tonic::{Code, Status};

async fn prefill(node: &Node, id: &str, tokens: &[u32]) -> pb::PrefillResponse {
    node.prefill()
        .await
        .prefill(pd_test_support::prefill_request(id, tokens.to_vec()))
        .await
        .expect("prefill")
        .into_inner()
}

fn decode_request(
    id: &str,
    tokens: &[u32],
    r: &pb::PrefillResponse,
    max_tokens: u32,
) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: id.into(),
        prompt_token_ids: tokens.to_vec(),
        first_token: r.first_token.as_ref().unwrap().token_id,
        sampling: greedy(),
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: true,
        cache_salt: None,
        kv: r.kv.clone(),
        resumed_tokens: 0,
    }
}

async fn release(node: &Node, kv: &pb::KvHandle) -> bool {
    node.prefill()
        .await
        .release_kv(pb::ReleaseKvRequest {
            lease_id: kv.lease_id,
            lease_secret: kv.lease_secret.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .released
}

/// A decode call to its end: the messages, or the status it failed with (at the call or in
/// the stream).
async fn decode_all(
    node: &Node,
    req: pb::DecodeRequest,
) -> Result<Vec<pb::DecodeResponse>, Status> {
    let mut stream = node.decode().await.decode(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        out.push(m);
    }
    Ok(out)
}

/// What one request produced through both nodes, the test playing the router.
struct Generated {
    tokens: Vec<u32>,
    prefill_usage: pb::Usage,
    decode_usage: pb::Usage,
    finish_reason: i32,
}

async fn generate(p: &Node, d: &Node, id: &str, tokens: &[u32], max_tokens: u32) -> Generated {
    let r = prefill(p, id, tokens).await;
    let lease = r.kv.clone().unwrap();
    let mut stream = d
        .decode()
        .await
        .decode(decode_request(id, tokens, &r, max_tokens))
        .await
        .expect("decode")
        .into_inner();
    let mut out = vec![r.first_token.as_ref().unwrap().token_id];
    let mut released = false;
    loop {
        let m = stream
            .message()
            .await
            .expect("decode stream")
            .expect("a last message");
        if !released {
            // The router's job: free the lease once the decode node answered.
            assert!(release(p, &lease).await, "the lease is still held");
            released = true;
        }
        out.extend(m.tokens.iter().map(|t| t.token_id));
        if m.finish_reason != pb::FinishReason::Unspecified as i32 {
            assert!(
                stream.message().await.unwrap().is_none(),
                "nothing after the last message"
            );
            return Generated {
                tokens: out,
                prefill_usage: r.usage.unwrap(),
                decode_usage: m.usage.expect("usage on the last message"),
                finish_reason: m.finish_reason,
            };
        }
        assert!(m.usage.is_none(), "usage only on the last message");
    }
}

/// Greedy generation on one mixed engine (prefill and decode in one), as `pdctl run` does.
fn mixed_engine_generate(prompts: &[Vec<u32>], max_tokens: u32) -> Vec<Vec<u32>> {
    let args = DecodeArgs::try_parse_from(["decode-node"]).unwrap();
    let loaded = pd_node::model::load_model("synthetic:tiny", Some(cache())).unwrap();
    let mut engine = args
        .node
        .engine
        .build(
            &loaded.files,
            loaded.weights,
            Role::Mixed,
            0,
            Duration::from_secs(30),
        )
        .unwrap();
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let request = engines::request(&format!("mixed-{i}"), p.clone(), max_tokens, false);
            let greedy = SamplingParams {
                temperature: 0.0,
                ..request.params.clone()
            };
            engines::run(
                &mut engine,
                EngineRequest {
                    params: greedy,
                    ..request
                },
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_through_prefill_and_decode_equal_one_mixed_engine() {
    let prompts: Vec<Vec<u32>> = [1, 15, 16, 17, 40, 100]
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt(len, i as u32 + 10))
        .collect();
    let max_tokens = 8;
    let expected = {
        let prompts = prompts.clone();
        tokio::task::spawn_blocking(move || mixed_engine_generate(&prompts, max_tokens))
    };
    let (p, d) = tokio::join!(prefill_node(&[]), decode_node(&[]));
    d.set_kv_peers(&[&p]).await;
    assert_eq!(p.ready.fingerprint, d.ready.fingerprint);
    let mut got = Vec::new();
    for (i, tokens) in prompts.iter().enumerate() {
        let g = generate(&p, &d, &format!("pd-{i}"), tokens, max_tokens).await;
        assert_eq!(g.finish_reason, pb::FinishReason::Length as i32);
        let len = tokens.len() as u32;
        assert_eq!(g.prefill_usage.prompt_tokens, len);
        assert_eq!(g.decode_usage.prompt_tokens, len);
        assert_eq!(
            g.decode_usage.completion_tokens, max_tokens,
            "the first token counts"
        );
        // All KV came from the prefill node: external on the decode node, nothing cached.
        assert_eq!(g.decode_usage.local_cached_tokens, 0);
        assert_eq!(g.decode_usage.external_cached_tokens, len);
        got.push(g.tokens);
    }
    let expected = expected.await.unwrap();
    assert_eq!(
        got, expected,
        "prefill + decode must equal one mixed engine, token for token"
    );
    tokio::join!(p.stop(), d.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_hits_both_caches_and_pulls_only_the_missing_blocks() {
    let (p, d) = tokio::join!(prefill_node(&[]), decode_node(&[]));
    d.set_kv_peers(&[&p]).await;
    let tokens = prompt(40, 20); // blocks of 16, 16, 8
    let first = generate(&p, &d, "first", &tokens, 4).await;
    assert_eq!(d.blocks_pulled(), 3);
    assert_eq!(first.prefill_usage.cached_tokens, 0);

    let second = generate(&p, &d, "second", &tokens, 4).await;
    assert_eq!(second.tokens, first.tokens);
    // The prefill node reused its two full blocks: the client's cached tokens.
    assert_eq!(second.prefill_usage.local_cached_tokens, 32);
    assert_eq!(second.prefill_usage.cached_tokens, 32);
    // The decode node had the same two blocks: it pulled only the last one.
    assert_eq!(d.blocks_pulled(), 4, "the second pull moved one block");
    assert_eq!(second.decode_usage.local_cached_tokens, 32);
    assert_eq!(second.decode_usage.external_cached_tokens, 8);
    tokio::join!(p.stop(), d.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_mismatch_is_refused_with_failed_precondition() {
    let (p, d, d32, d16) = tokio::join!(
        prefill_node(&[]),
        decode_node(&[]),
        decode_node(&["--block-size", "32"]),
        decode_node(&["--kv-cache-dtype", "f16"])
    );
    for d in [&d, &d32, &d16] {
        d.set_kv_peers(&[&p]).await;
    }
    assert_ne!(p.ready.fingerprint, d32.ready.fingerprint);
    // Blocks travel as stored: a cache of another type is another layout.
    assert_ne!(p.ready.fingerprint, d16.ready.fingerprint);
    assert_eq!(p.info().await.kv_cache_dtype, "float32");
    assert_eq!(d16.info().await.kv_cache_dtype, "float16");
    let tokens = prompt(20, 30);
    let r = prefill(&p, "mismatch", &tokens).await;

    let mut wrong_fp = decode_request("fp", &tokens, &r, 4);
    wrong_fp.kv.as_mut().unwrap().layout_fingerprint = "0123456789abcdef".into();
    let mut wrong_bs = decode_request("bs", &tokens, &r, 4);
    wrong_bs.kv.as_mut().unwrap().block_size = 32;
    for (node, req, theirs) in [
        (&d, wrong_fp, "0123456789abcdef"),
        (&d, wrong_bs, p.ready.fingerprint.as_str()),
        (
            &d32,
            decode_request("real", &tokens, &r, 4),
            p.ready.fingerprint.as_str(),
        ),
        (
            &d16,
            decode_request("f16", &tokens, &r, 4),
            p.ready.fingerprint.as_str(),
        ),
    ] {
        let id = req.request_id.clone();
        let e = decode_all(node, req).await.expect_err(&id);
        assert_eq!(e.code(), Code::FailedPrecondition, "{id}: {e:?}");
        let m = e.message();
        assert!(
            m.contains(theirs) && m.contains(&node.ready.fingerprint) && m.contains("block size"),
            "{id}: the message names both layouts: {m}"
        );
        assert!(
            m.contains("--kv-cache-dtype"),
            "{id}: and what to align: {m}"
        );
    }
    assert_eq!(
        d.blocks_pulled() + d32.blocks_pulled() + d16.blocks_pulled(),
        0,
        "no KV moved"
    );
    assert!(release(&p, r.kv.as_ref().unwrap()).await);
    tokio::join!(p.stop(), d.stop(), d32.stop(), d16.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_failed_transfers_are_refused_with_clear_codes() {
    let (p, d) = tokio::join!(prefill_node(&[]), decode_node(&[]));
    d.set_kv_peers(&[&p]).await;
    let tokens = prompt(24, 40);
    let r = prefill(&p, "bad", &tokens).await;
    let ok = || decode_request("bad", &tokens, &r, 4);
    // A known prefill address where nothing listens.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    d.set_kv_peer_addrs(&[p.ready.kv.unwrap().to_string(), closed.to_string()])
        .await;

    let mut cases: Vec<(pb::DecodeRequest, Code, &str)> = Vec::new();
    let mut case = |f: &dyn Fn(&mut pb::DecodeRequest), code: Code, needle: &'static str| {
        let mut req = ok();
        f(&mut req);
        cases.push((req, code, needle));
    };
    case(
        &|r| r.request_id.clear(),
        Code::InvalidArgument,
        "request_id",
    );
    // A request without `kv` is valid: aggregated mode (tests/tests/aggregated.rs).
    case(
        &|r| r.kv.as_mut().unwrap().layout_fingerprint = "xyz".into(),
        Code::InvalidArgument,
        "16 hex digits",
    );
    case(&|r| r.max_tokens = 0, Code::InvalidArgument, "max_tokens");
    case(
        &|r| r.first_token = 151_936,
        Code::InvalidArgument,
        "vocabulary",
    );
    case(
        &|r| r.prompt_token_ids.push(5),
        Code::InvalidArgument,
        "KvHandle covers",
    );
    case(
        &|r| r.prompt_token_ids.clear(),
        Code::InvalidArgument,
        "empty",
    );
    case(
        &|r| r.sampling.as_mut().unwrap().top_p = Some(2.0),
        Code::InvalidArgument,
        "top_p",
    );
    // The engine refuses after the pull: the first token already ends the request.
    case(
        &|r| r.max_tokens = 1,
        Code::InvalidArgument,
        "nothing to decode",
    );
    // A lease secret of another length than 16 bytes.
    case(
        &|r| r.kv.as_mut().unwrap().lease_secret.truncate(15),
        Code::InvalidArgument,
        "kv.lease_secret",
    );
    // An address this decode node was not told about: it dials nothing.
    case(
        &|r| r.kv.as_mut().unwrap().addr = "127.0.0.1:1".into(),
        Code::PermissionDenied,
        "not one of the 2 prefill nodes",
    );
    // Transfer failures: nothing listens there / the lease is gone / a wrong secret (the
    // prefill node answers as for a lease that is gone).
    case(
        &move |r| r.kv.as_mut().unwrap().addr = closed.to_string(),
        Code::Unavailable,
        "[connection]",
    );
    case(
        &|r| r.kv.as_mut().unwrap().lease_id ^= 1,
        Code::Unavailable,
        "[lease_gone]",
    );
    case(
        &|r| r.kv.as_mut().unwrap().lease_secret[3] ^= 1,
        Code::Unavailable,
        "[lease_gone]",
    );
    for (req, code, needle) in cases {
        let e = decode_all(&d, req).await.expect_err(needle);
        assert_eq!(e.code(), code, "{needle}: {e:?}");
        assert!(
            e.message().contains(needle),
            "{needle:?} in {:?}",
            e.message()
        );
    }
    assert_eq!(d.transfers.as_ref().unwrap().snapshot().pulls_failed, 3);

    let unknown = d
        .decode()
        .await
        .abort(pb::NodeAbortRequest {
            request_id: "nobody".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.aborted);
    assert!(release(&p, r.kv.as_ref().unwrap()).await);
    tokio::join!(p.stop(), d.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_a_dropped_stream_end_the_request_and_free_its_blocks() {
    let (p, d) = tokio::join!(prefill_node(&[]), decode_node(&[]));
    d.set_kv_peers(&[&p]).await;
    let tokens = prompt(20, 50);

    // Abort by id: the stream ends with finish reason ABORT.
    let r = prefill(&p, "to-abort", &tokens).await;
    let mut stream = d
        .decode()
        .await
        .decode(decode_request("to-abort", &tokens, &r, 4000))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.finish_reason, pb::FinishReason::Unspecified as i32);
    assert!(release(&p, r.kv.as_ref().unwrap()).await);
    let aborted = d
        .decode()
        .await
        .abort(pb::NodeAbortRequest {
            request_id: "to-abort".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(aborted.aborted);
    let last = loop {
        let m = stream.message().await.unwrap().expect("a last message");
        if m.finish_reason != pb::FinishReason::Unspecified as i32 {
            break m;
        }
    };
    assert_eq!(last.finish_reason, pb::FinishReason::Abort as i32);
    assert!(last.usage.unwrap().completion_tokens < 4000);
    d.assert_all_blocks_free().await;

    // A client that drops the stream: the request is aborted.
    let r = prefill(&p, "dropped", &tokens).await;
    let mut stream = d
        .decode()
        .await
        .decode(decode_request("dropped", &tokens, &r, 4000))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap();
    assert!(release(&p, r.kv.as_ref().unwrap()).await);
    drop(stream);
    // The same id again: the node takes it once the dropped stream is gone, and the engine
    // only if that request was aborted (it refuses an id still open; its abort and this
    // submission reach it in order).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = prefill(&p, "dropped-again", &tokens).await;
        let result = decode_all(&d, decode_request("dropped", &tokens, &r, 2)).await;
        assert!(release(&p, r.kv.as_ref().unwrap()).await);
        match result {
            Ok(messages) => {
                let last = messages.last().unwrap();
                assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
                break;
            }
            Err(e) if e.message().contains("on this node") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => panic!("the dropped stream's request was not aborted: {e:?}"),
        }
    }
    d.assert_all_blocks_free().await;
    tokio::join!(p.stop(), d.stop());
}

/// A listener on 127.0.0.1 that counts the connections it accepts.
async fn counting_listener() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (addr, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_naming_an_unknown_address_makes_no_connection_and_is_permission_denied() {
    use std::sync::atomic::Ordering;
    let (p, d) = tokio::join!(prefill_node(&[]), decode_node(&[]));
    let tokens = prompt(24, 60);
    let r = prefill(&p, "elsewhere", &tokens).await;
    let (trap, accepted) = counting_listener().await;
    let mut req = decode_request("elsewhere", &tokens, &r, 4);
    req.kv.as_mut().unwrap().addr = trap.to_string();

    // Before the router told it its prefill nodes, a decode node pulls from nowhere.
    let e = decode_all(&d, req.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("SetKvPeers"), "{e:?}");
    let e = decode_all(&d, decode_request("real", &tokens, &r, 4))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::Unavailable,
        "not even from the real one: {e:?}"
    );

    d.set_kv_peers(&[&p]).await;
    let e = decode_all(&d, req.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains(&trap.to_string()) && e.message().contains("no connection"),
        "the message names the address: {e:?}"
    );
    // The same address as a host name: not dialed, not even resolved.
    req.kv.as_mut().unwrap().addr = format!("localhost:{}", trap.port());
    let e = decode_all(&d, req).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "no connection was made");
    assert_eq!(d.transfers.as_ref().unwrap().snapshot().pulls_failed, 0);
    assert_eq!(d.blocks_pulled(), 0);

    // The real handle still works with the lease untouched.
    let messages = decode_all(&d, decode_request("real", &tokens, &r, 4))
        .await
        .unwrap();
    assert_eq!(
        messages.last().unwrap().finish_reason,
        pb::FinishReason::Length as i32
    );
    assert!(release(&p, r.kv.as_ref().unwrap()).await);
    tokio::join!(p.stop(), d.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_with_a_wrong_secret_releases_nothing() {
    let (p, d) = tokio::join!(prefill_node(&[]), decode_node(&[]));
    d.set_kv_peers(&[&p]).await;
    let tokens = prompt(40, 70);
    let r = prefill(&p, "sealed", &tokens).await;
    let kv = r.kv.clone().unwrap();
    let free_before = p.info().await.free_blocks;

    let mut wrong = kv.clone();
    wrong.lease_secret[0] ^= 1;
    assert!(
        !release(&p, &wrong).await,
        "a wrong secret releases nothing"
    );
    let mut neighbour = kv.clone();
    neighbour.lease_id ^= 1;
    assert!(!release(&p, &neighbour).await, "nor does a neighbouring id");
    let e = p
        .prefill()
        .await
        .release_kv(pb::ReleaseKvRequest {
            lease_id: kv.lease_id,
            lease_secret: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(
        p.info().await.free_blocks,
        free_before,
        "the blocks stay leased"
    );
    // The lease is intact: the decode node still pulls it.
    let messages = decode_all(&d, decode_request("sealed", &tokens, &r, 3))
        .await
        .unwrap();
    assert_eq!(
        messages.last().unwrap().finish_reason,
        pb::FinishReason::Length as i32
    );
    assert!(release(&p, &kv).await, "the right secret releases it");
    assert!(!release(&p, &kv).await, "once");
    tokio::join!(p.stop(), d.stop());
}
