//! Faults, through real processes started one by one (`router`, `prefill-node`,
//! `decode-node`; `pdctl up` would stop the whole cluster when one part dies): a decode node
//! killed with SIGKILL mid-stream has its streams moved to another decode node, which
//! continue token for token as if nothing happened (or, with `--migration-limit 0`, end with
//! a clear UNAVAILABLE); a node killed before any token was sent is retried transparently on
//! a healthy one; never a hang; the router routes around the dead node; restarted on the same
//! port, it is used again.
//!
//! Timeouts here only detect hangs; nothing asserts how fast anything is.

use std::path::Path;
use std::time::Duration;

use pd_proto::pb;
use pd_tests::{
    Counts, Process, client, collect, exposition, greedy, metrics_addr, node_info,
    reference_tokens, wait_serving,
};
use tokio::time::{Instant, timeout};

/// Longer than anything here should take: reaching it means something hangs.
const HANG: Duration = Duration::from_secs(90);

const MODEL: &str = "synthetic:tiny";

/// A node of `role` ("prefill" | "decode") on `port` (0: ephemeral).
fn node(role: &str, cache: &Path, port: u16) -> Process {
    let port = port.to_string();
    Process::start(
        &format!("{role}-node"),
        cache,
        &["--model", MODEL, "--port", &port],
    )
    .unwrap_or_else(|e| panic!("{role} node: {e:#}"))
}

/// A router over these nodes, polling their health every 200 ms.
async fn router(
    cache: &Path,
    prefill: &[&Process],
    decode: &[&Process],
    extra: &[&str],
) -> Process {
    let mut args = vec![
        "--model".to_string(),
        MODEL.into(),
        "--health-interval-ms".into(),
        "200".into(),
    ];
    for p in prefill {
        args.extend(["--prefill".into(), p.addr()]);
    }
    for d in decode {
        args.extend(["--decode".into(), d.addr()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let router = Process::start("router", cache, &args).expect("router");
    wait_serving(&router.addr()).await.expect("router serving");
    router
}

type Stream = tonic::Streaming<pb::GenerateResponse>;

/// Opens a long greedy stream and waits until tokens come from its decode node (the first
/// token is the prefill node's).
async fn long_stream(
    c: &mut pb::generation_client::GenerationClient<tonic::transport::Channel>,
    seed: u32,
) -> Stream {
    let prompt: Vec<u32> = (0..40)
        .map(|t| (t * 7919 + seed * 104_729 + 11) % 150_000)
        .collect();
    let mut stream = timeout(HANG, c.generate(greedy(prompt, 2000)))
        .await
        .expect("no hang")
        .expect("stream opens")
        .into_inner();
    let mut tokens = 0;
    while tokens < 2 {
        tokens += timeout(HANG, stream.message())
            .await
            .expect("no hang")
            .expect("a chunk")
            .expect("more chunks")
            .token_ids
            .len();
    }
    stream
}

/// Polls `addr`'s Info until `pred` holds (hang detector: [`HANG`]).
async fn until_info(addr: &str, role: &str, what: &str, pred: impl Fn(&pb::NodeInfo) -> bool) {
    let end = Instant::now() + HANG;
    loop {
        let info = node_info(addr, role).await;
        if pred(&info) {
            return;
        }
        assert!(
            Instant::now() < end,
            "{role} {addr}: never {what}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every KV block back on every node, no request running.
async fn all_blocks_free(nodes: &[(&Process, &str)]) {
    for (node, role) in nodes {
        until_info(&node.addr(), role, "idle with every block free", |i| {
            i.free_blocks == i.num_blocks && i.num_running == 0
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_migration_a_decode_node_killed_mid_stream_is_unavailable_routed_around_and_used_again()
 {
    let cache = tempfile::tempdir().unwrap();
    // The first node writes the synthetic model; the others find it.
    let prefill = node("prefill", cache.path(), 0);
    let d1 = node("decode", cache.path(), 0);
    let d2 = node("decode", cache.path(), 0);
    let (d1_addr, d1_port) = (d1.addr(), d1.port());
    // No migration: the failure reaches the client.
    let router = router(
        cache.path(),
        &[&prefill],
        &[&d1, &d2],
        &["--migration-limit", "0"],
    )
    .await;
    let mut c = client(&router.addr()).await;

    // Four long streams, spread over both decode nodes by load.
    let mut streams = Vec::new();
    for i in 0..4 {
        streams.push(long_stream(&mut c, i).await);
    }
    let on_d2 = node_info(&d2.addr(), "decode").await.num_running;
    let on_d1 = node_info(&d1_addr, "decode").await.num_running;
    assert_eq!(on_d1 + on_d2, 4, "every stream runs on a decode node");
    assert!(on_d1 > 0 && on_d2 > 0, "both decode nodes got streams");

    d1.kill();
    // The streams on the killed node end with UNAVAILABLE naming it; the others go on.
    let (mut failed, mut survived) = (0, 0);
    for mut stream in streams {
        let mut tokens_after_kill = 0;
        let outcome = loop {
            match timeout(HANG, stream.message()).await.expect("no hang") {
                Err(status) => break Err(status),
                Ok(Some(chunk)) => {
                    tokens_after_kill += chunk.token_ids.len();
                    // Far more than the router and the network can have buffered.
                    if tokens_after_kill >= 300 {
                        break Ok(());
                    }
                }
                Ok(None) => panic!("a stream ended without a finish reason or an error"),
            }
        };
        match outcome {
            Ok(()) => survived += 1,
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert!(
                    status.message().contains("decode node") && status.message().contains(&d1_addr),
                    "the message names the failed node: {}",
                    status.message()
                );
                failed += 1;
            }
        }
    }
    assert_eq!(
        failed, on_d1,
        "exactly the streams on the killed node failed"
    );
    assert_eq!(survived, 4 - on_d1);

    // New requests avoid the dead node.
    for i in 0..6u32 {
        let (ids, last) = timeout(HANG, collect(&mut c, greedy(vec![1, 2, 3, i], 8)))
            .await
            .expect("no hang")
            .expect("served by the healthy decode node");
        assert_eq!(ids.len(), 8);
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    }

    // Back on the same port: the router uses it again.
    let d1 = node("decode", cache.path(), d1_port);
    let end = Instant::now() + HANG;
    'used: loop {
        let mut streams = Vec::new();
        for i in 0..2 {
            streams.push(long_stream(&mut c, 10 + i).await);
        }
        for _ in 0..10 {
            if node_info(&d1.addr(), "decode").await.num_running > 0 {
                break 'used;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(streams);
        assert!(
            Instant::now() < end,
            "the restarted decode node is never used"
        );
    }
    all_blocks_free(&[(&prefill, "prefill"), (&d1, "decode"), (&d2, "decode")]).await;

    // No decode node left at all: a clear UNAVAILABLE, at once.
    d1.kill();
    d2.kill();
    let end = Instant::now() + HANG;
    loop {
        let result = timeout(HANG, collect(&mut c, greedy(vec![1, 2, 3], 4)))
            .await
            .expect("no hang");
        match result {
            Err(status) if status.message().contains("no healthy decode node") => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                break;
            }
            Err(status) => {
                // Before the health poll noticed: the failed attempt is reported as such.
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            }
            Ok(_) => panic!("served without any decode node"),
        }
        assert!(Instant::now() < end, "the router never noticed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_node_killed_is_retried_on_the_other_and_used_again_after_restart() {
    let cache = tempfile::tempdir().unwrap();
    let p1 = node("prefill", cache.path(), 0);
    let p2 = node("prefill", cache.path(), 0);
    let decode = node("decode", cache.path(), 0);
    let p1_port = p1.port();
    // Round-robin: every other request goes to the first prefill node while it is up.
    let router = router(
        cache.path(),
        &[&p1, &p2],
        &[&decode],
        &["--policy", "round-robin"],
    )
    .await;
    let mut c = client(&router.addr()).await;
    let want = collect(&mut c, greedy(vec![7, 8, 9], 6)).await.unwrap().0;

    // Killed before the requests reach it: those sent to it before the router's health poll
    // notices are retried on the other one; no client sees an error.
    p1.kill();
    for _ in 0..6 {
        let (ids, _) = timeout(HANG, collect(&mut c, greedy(vec![7, 8, 9], 6)))
            .await
            .expect("no hang")
            .expect("served by the other prefill node");
        assert_eq!(ids, want);
    }

    // Back on the same port: the router sends it work again. A prompt it served through the
    // router is in its (fresh) prefix cache, which a direct Prefill shows.
    let p1 = node("prefill", cache.path(), p1_port);
    let mut direct =
        pb::prefill_service_client::PrefillServiceClient::connect(format!("http://{}", p1.addr()))
            .await
            .unwrap();
    let end = Instant::now() + HANG;
    for round in 0u32.. {
        let prompt: Vec<u32> = (0..48).map(|t| 1000 + round * 100 + t).collect();
        let (ids, _) = timeout(HANG, collect(&mut c, greedy(prompt.clone(), 2)))
            .await
            .expect("no hang")
            .expect("served");
        assert_eq!(ids.len(), 2);
        let answer = direct
            .prefill(pd_test_support::prefill_request(
                &format!("probe-{round}"),
                prompt,
            ))
            .await
            .unwrap()
            .into_inner();
        let kv = answer.kv.unwrap();
        direct
            .release_kv(pb::ReleaseKvRequest {
                lease_id: kv.lease_id,
                lease_secret: kv.lease_secret,
            })
            .await
            .unwrap();
        if answer.usage.unwrap().local_cached_tokens > 0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "the restarted prefill node is never used"
        );
    }
    all_blocks_free(&[(&p1, "prefill"), (&p2, "prefill"), (&decode, "decode")]).await;
}

/// A seeded sampling request (temperature 0.8, top-p 0.95) of `max_tokens`, EOS ignored.
fn seeded(ids: Vec<u32>, max_tokens: u32, seed: u64) -> pb::GenerateRequest {
    let mut req = greedy(ids, max_tokens);
    req.sampling = Some(pb::SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.95),
        seed: Some(seed),
        ..Default::default()
    });
    req
}

/// Opens `req`, waits until its decode node streams, SIGKILLs that node (one of `decode`,
/// which it takes out of the list) and reads the stream to its end: (every token the client
/// got, the last chunk).
async fn kill_decode_mid_stream(
    c: &mut pb::generation_client::GenerationClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
    decode: &mut Vec<Process>,
) -> (Vec<u32>, pb::GenerateResponse) {
    let mut stream = timeout(HANG, c.generate(req))
        .await
        .expect("no hang")
        .expect("stream opens")
        .into_inner();
    let mut tokens = Vec::new();
    let next = async |stream: &mut Stream| {
        timeout(HANG, stream.message())
            .await
            .expect("no hang")
            .expect("the stream goes on, moved to the other decode node")
    };
    // The first token is the prefill node's; the next ones come from the decode node.
    while tokens.len() < 3 {
        let chunk = next(&mut stream).await.expect("more chunks");
        tokens.extend(chunk.token_ids);
    }
    let mut busy = None;
    for (i, node) in decode.iter().enumerate() {
        if node_info(&node.addr(), "decode").await.num_running > 0 {
            busy = Some(i);
        }
    }
    let busy = busy.expect("a decode node runs the stream");
    decode.remove(busy).kill();
    loop {
        let chunk = next(&mut stream)
            .await
            .expect("a last chunk with a finish reason");
        tokens.extend(chunk.token_ids.iter().copied());
        if chunk.finish_reason() != pb::FinishReason::Unspecified {
            return (tokens, chunk);
        }
    }
}

/// Waits until the router's counts of `node` equal the node's own (reports may trail the
/// stream's end by a moment).
async fn router_counts_match(router: &Process, node: &Process, role: &str) {
    router_counts_match_after(router, node, role, &Counts::default()).await
}

/// As [`router_counts_match`], for a node whose address an earlier process held: the router
/// sums every process seen at an address (docs/accounting.md), so its counts there are
/// `earlier` (what it had counted of the earlier processes) plus the node's own.
async fn router_counts_match_after(router: &Process, node: &Process, role: &str, earlier: &Counts) {
    let end = Instant::now() + HANG;
    loop {
        let theirs = Counts::of_node(&exposition(&metrics_addr(&node.ready)).await.unwrap());
        let e = exposition(&metrics_addr(&router.ready)).await.unwrap();
        let ours = Counts::of_router(&e, role, &node.addr()).minus(earlier);
        if ours == theirs {
            return;
        }
        assert!(
            Instant::now() < end,
            "the router's counts of {role} {}: {ours:?}, the node's: {theirs:?}",
            node.addr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn migrations(router: &Process) -> f64 {
    exposition(&metrics_addr(&router.ready))
        .await
        .unwrap()
        .sum("pd_router_migrations_total", &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_killed_mid_stream_moves_the_stream_which_completes_unchanged() {
    let cache = tempfile::tempdir().unwrap();
    let prefill = node("prefill", cache.path(), 0);
    let mut decode = vec![
        node("decode", cache.path(), 0),
        node("decode", cache.path(), 0),
    ];
    let ports: Vec<(u16, String)> = decode.iter().map(|n| (n.port(), n.addr())).collect();
    let router = router(cache.path(), &[&prefill], &[&decode[0], &decode[1]], &[]).await;
    let mut c = client(&router.addr()).await;
    let prompt: Vec<u32> = (0..40).map(|t| (t * 7919 + 11) % 150_000).collect();
    const N: u32 = 1000;

    // Greedy: equal to the single-process reference, token for token.
    let want = reference_tokens(cache.path(), &prompt, N);
    let (got, last) = kill_decode_mid_stream(&mut c, greedy(prompt.clone(), N), &mut decode).await;
    assert_eq!(
        got.len(),
        want.len(),
        "every token once: none lost, none repeated"
    );
    assert_eq!(got, want, "the moved stream equals an uninterrupted run");
    assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    let usage = last.usage.expect("usage on the last chunk");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, N));
    assert_eq!(migrations(&router).await, 1.0);
    // Nothing held on the live nodes; the router's counts of them are theirs.
    all_blocks_free(&[(&prefill, "prefill"), (&decode[0], "decode")]).await;
    router_counts_match(&router, &prefill, "prefill").await;
    router_counts_match(&router, &decode[0], "decode").await;

    // Seeded sampling: equal to the same request uninterrupted (the draw of each token
    // depends on the seed and its place only). The killed node comes back first, so that
    // the stream has somewhere to go.
    let (dead, dead_addr) = ports
        .iter()
        .find(|(p, _)| *p != decode[0].port())
        .cloned()
        .unwrap();
    // What the router counted of the killed process (its reports up to its death) stays in
    // the router's totals for that address when the new process takes it.
    let of_killed = Counts::of_router(
        &exposition(&metrics_addr(&router.ready)).await.unwrap(),
        "decode",
        &dead_addr,
    );
    decode.push(node("decode", cache.path(), dead));
    let want = collect(&mut c, seeded(prompt.clone(), N, 1234))
        .await
        .unwrap()
        .0;
    let other = collect(&mut c, seeded(prompt.clone(), N, 4321))
        .await
        .unwrap()
        .0;
    assert_ne!(want, other, "the seed matters");
    let (got, last) =
        kill_decode_mid_stream(&mut c, seeded(prompt.clone(), N, 1234), &mut decode).await;
    assert_eq!(
        got, want,
        "the moved seeded stream equals an uninterrupted one"
    );
    assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    assert_eq!(migrations(&router).await, 2.0);
    all_blocks_free(&[(&prefill, "prefill"), (&decode[0], "decode")]).await;
    router_counts_match(&router, &prefill, "prefill").await;
    // The survivor may be the node that came back at the killed one's address.
    let earlier = if decode[0].port() == dead {
        of_killed
    } else {
        Counts::default()
    };
    router_counts_match_after(&router, &decode[0], "decode", &earlier).await;
}
