//! Aggregated mode (`pdctl up --prefill 0`): the router sends each request whole to a decode
//! node, which computes the prompt itself. Greedy output equals one mixed engine (`pdctl
//! run`), and the client's cached tokens are that node's own prefix-cache hits.

use std::time::Duration;

use pd_proto::pb;
use pd_tests::{
    Cluster, assert_each_equals_reference, client, collect, greedy, node_info, reference_run,
    spread_prompts, token_ids,
};

/// Prompts of several lengths (some spanning many 16-token blocks).
fn prompts() -> Vec<Vec<u32>> {
    spread_prompts(5, 3, 17, 13)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_mode_equals_one_mixed_engine_and_reports_the_decode_nodes_cache() {
    let cache = tempfile::tempdir().unwrap();
    // Chunked prefill on the decode node too: prompts are computed in pieces of 7 tokens.
    let cluster = Cluster::up_chunked(cache.path(), "0").unwrap();
    assert!(cluster.nodes("prefill").is_empty());
    let mut c = client(&cluster.router()).await;
    assert_each_equals_reference(&mut c, cache.path(), prompts(), 10).await;

    // The longest prompt again: the decode node's own cache saved its whole blocks.
    let long = prompts().pop().unwrap();
    let whole_blocks = ((long.len() - 1) / 16 * 16) as u32;
    let (_, last) = collect(&mut c, greedy(long.clone(), 10)).await.unwrap();
    let usage = last.usage.unwrap();
    assert_eq!(usage.local_cached_tokens, whole_blocks);
    assert_eq!(usage.cached_tokens, whole_blocks);

    // A stop string ends the text before the node ends the request: the router aborts it
    // there and still reports the node's cache hits.
    let run = reference_run(cache.path(), &long, 10);
    let text: Vec<char> = run["text"].as_str().unwrap().chars().collect();
    assert!(text.len() >= 4, "enough text to cut: {text:?}");
    let stop: String = text[text.len() / 2..text.len() / 2 + 2].iter().collect();
    let mut req = greedy(long.clone(), 500);
    req.stop = vec![stop.clone()];
    let (got, last) = collect(&mut c, req).await.unwrap();
    assert_eq!(
        last.finish_reason(),
        pb::FinishReason::Stop,
        "stop {stop:?}"
    );
    assert_eq!(
        last.stop_reason,
        Some(pb::generate_response::StopReason::StopString(stop.clone()))
    );
    assert!(got.len() <= 10 && token_ids(&run).starts_with(&got));
    let usage = last.usage.unwrap();
    assert_eq!(usage.local_cached_tokens, whole_blocks);
    assert_eq!(usage.completion_tokens as usize, got.len());

    // Prompt logprobs come from the node that computed the prompt, on the first chunk (with
    // the first token), as in PD mode.
    let mut req = greedy(long.clone(), 3);
    req.sampling.as_mut().unwrap().prompt_logprobs = Some(2);
    let mut stream = c.generate(req).await.unwrap().into_inner();
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        chunks.push(chunk);
    }
    assert!(!chunks[0].token_ids.is_empty());
    assert!(chunks[1..].iter().all(|c| c.prompt_logprobs.is_empty()));
    let logprobs = &chunks[0].prompt_logprobs;
    assert_eq!(logprobs.len(), long.len() - 1);
    for (i, lp) in logprobs.iter().enumerate() {
        assert_eq!(lp.token_id, long[i + 1], "position {}", i + 1);
    }

    // Every block comes back.
    let addr = &cluster.nodes("decode")[0];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let info = node_info(addr, "decode").await;
        if info.free_blocks == info.num_blocks && info.num_running == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "blocks kept: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
}
