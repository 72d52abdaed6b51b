//! The keystone and the cluster's behaviour, through real processes started by `pdctl up`.

use pd_proto::pb;
use pd_tests::{
    Cluster, all_blocks_free, client, collect, greedy, node_info, reference_tokens, spread_prompts,
};

/// Prompts of several lengths (some spanning many 16-token blocks).
fn prompts() -> Vec<Vec<u32>> {
    spread_prompts(6, 3, 13, 11)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keystone_pd_equals_one_mixed_engine_and_accounts_exactly() {
    let cache = tempfile::tempdir().unwrap();
    // Chunked prefill on: the prefill node computes long prompts in pieces of 7 tokens.
    let cluster = Cluster::up(
        cache.path(),
        &[
            "--prefill",
            "1",
            "--decode",
            "1",
            "--",
            "--max-num-batched-tokens",
            "7",
        ],
    )
    .unwrap();
    let mut c = client(&cluster.router()).await;
    for ids in prompts() {
        let want = reference_tokens(cache.path(), &ids, 12);
        let (got, last) = collect(&mut c, greedy(ids.clone(), 12)).await.unwrap();
        assert_eq!(got, want, "prompt of {} tokens", ids.len());
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        let usage = last.usage.unwrap();
        assert_eq!(usage.prompt_tokens as usize, ids.len());
        assert_eq!(usage.completion_tokens, 12);
    }
    // The same long prompt again: the prefill node reuses its cached blocks (local), and
    // the client's cached tokens are exactly that saving.
    let long = prompts().pop().unwrap();
    let (again, last) = collect(&mut c, greedy(long.clone(), 12)).await.unwrap();
    assert_eq!(again, reference_tokens(cache.path(), &long, 12));
    let usage = last.usage.unwrap();
    let whole_blocks = ((long.len() - 1) / 16 * 16) as u32;
    assert_eq!(usage.local_cached_tokens, whole_blocks);
    assert_eq!(usage.cached_tokens, whole_blocks);
    all_blocks_free(&cluster).await;

    // One token: the prefill node's answer ends the request. It leases nothing (every block
    // is free the moment the stream ends, no release to wait for) and no decode node runs.
    let decode = &cluster.nodes("decode")[0];
    let decode_before = node_info(decode, "decode").await.counters.unwrap();
    for ids in prompts() {
        let (got, last) = collect(&mut c, greedy(ids.clone(), 1)).await.unwrap();
        assert_eq!(got, reference_tokens(cache.path(), &ids, 1));
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        let prefill = node_info(&cluster.nodes("prefill")[0], "prefill").await;
        assert_eq!(
            prefill.free_blocks, prefill.num_blocks,
            "no lease: {prefill:?}"
        );
    }
    let decode_after = node_info(decode, "decode").await.counters.unwrap();
    assert_eq!(decode_after.prompt_tokens, decode_before.prompt_tokens);
    assert_eq!(decode_after.kv_transfers, decode_before.kv_transfers);
    assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_by_two_serves_64_concurrent_streams_and_frees_everything() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &["--prefill", "2", "--decode", "2"]).unwrap();
    let router = cluster.router();
    let ids = prompts();
    let mut want = Vec::new();
    for p in &ids {
        want.push(reference_tokens(cache.path(), p, 6));
    }
    let mut tasks = Vec::new();
    for i in 0..64usize {
        let router = router.clone();
        let prompt = ids[i % ids.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut c = client(&router).await;
            collect(&mut c, greedy(prompt, 6)).await.map(|(t, _)| t)
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let got = t.await.unwrap().expect("every stream completes");
        assert_eq!(got, want[i % ids.len()], "stream {i}");
    }
    all_blocks_free(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_invalid_argument_and_cancellation_frees_kv() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &[]).unwrap();
    let mut c = client(&cluster.router()).await;
    let bad = |f: &dyn Fn(&mut pb::GenerateRequest)| {
        let mut r = greedy(vec![1, 2, 3], 4);
        f(&mut r);
        r
    };
    let cases: Vec<(&str, pb::GenerateRequest)> = vec![
        (
            "empty",
            bad(&|r| {
                r.input = Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                    ids: vec![],
                }))
            }),
        ),
        (
            "vocab",
            bad(&|r| {
                r.input = Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                    ids: vec![999_999],
                }))
            }),
        ),
        (
            "context",
            bad(&|r| {
                r.input = Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                    ids: vec![5; 5000],
                }))
            }),
        ),
        ("max_tokens", bad(&|r| r.max_tokens = Some(0))),
        (
            "temperature",
            bad(&|r| r.sampling.as_mut().unwrap().temperature = Some(-1.0)),
        ),
        (
            "top_p",
            bad(&|r| r.sampling.as_mut().unwrap().top_p = Some(1.5)),
        ),
        ("model", bad(&|r| r.model = "no-such-model".into())),
    ];
    for (name, req) in cases {
        let err = collect(&mut c, req).await.expect_err(name);
        assert!(
            matches!(
                err.code(),
                tonic::Code::InvalidArgument | tonic::Code::NotFound
            ),
            "{name}: {err:?}"
        );
        assert!(
            !err.message().is_empty(),
            "{name}: the message says what is wrong"
        );
    }
    // A client that drops its stream mid-generation: its KV comes back on both nodes.
    let mut stream = c
        .generate(greedy((0..40).collect(), 3000))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    drop(stream);
    all_blocks_free(&cluster).await;
    // Abort by request id.
    let mut req = greedy((0..40).collect(), 3000);
    req.request_id = Some("to-abort".into());
    let mut stream = c.generate(req).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    let aborted = c
        .abort(pb::AbortRequest {
            request_id: "to-abort".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(aborted.aborted);
    while let Ok(Some(chunk)) = stream.message().await {
        if chunk.finish_reason != 0 {
            assert_eq!(chunk.finish_reason(), pb::FinishReason::Abort);
        }
    }
    all_blocks_free(&cluster).await;
    // Other requests are unaffected.
    let (ids, _) = collect(&mut c, greedy(vec![1, 2, 3], 4)).await.unwrap();
    assert_eq!(ids.len(), 4);
}
