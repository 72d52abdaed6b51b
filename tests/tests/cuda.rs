//! The keystone on CUDA nodes: router → prefill → decode with both nodes running the model on
//! `--device cuda` (GPU KV, blocks packed and unpacked on the device for the transfer, decode
//! through CUDA graphs). `#[ignore]`d: build the node binaries and pdctl with `--features cuda`
//! and run it with `--ignored`. It runs on a GPU host, and in CI on pd-cuda-emu (kernels/emu/,
//! the kernels compiled for the CPU behind a stand-in libcuda; scripts/cuda-check.sh sets it
//! up).
//!
//! Checked, with chunked prefill on: greedy output equals `pdctl run` on the CPU token for
//! token, up to the first position where the CPU's top-2 margin is too thin for two backends to
//! agree on (f32 sums in another order: the synthetic model's logits are nearly flat); the
//! decode node received the KV over the transfer; a repeated prompt reuses the prefill node's
//! cached GPU blocks; afterwards every block on both nodes is free. The same for Qwen3-MoE
//! (its sparse layers routed on the device, in graphs too). And a CPU node and a CUDA
//! node hand KV to each other both ways (the block layout is the same f32 layout on both
//! devices, so one cluster may mix them).

use pd_proto::pb;
use pd_tests::{
    Cluster, Process, all_blocks_free, client, collect, exposition, greedy, json_of, metrics_addr,
    node_info, nodes_sum, pdctl, spread_prompts, wait_serving,
};
use tonic::transport::Channel;

/// Below this top-2 logprob margin (nats) the CPU's choice is a tie for practical purposes.
const CLEAR_MARGIN: f64 = 1e-3;

/// Prompts of several lengths, most spanning several 16-token blocks.
fn prompts() -> Vec<Vec<u32>> {
    spread_prompts(5, 18, 23, 11)
}

/// `pdctl up` of `model` with both nodes on `--device cuda`, CUDA graphs on, and a step
/// budget of `batched_tokens` tokens.
fn cuda_cluster(cache: &std::path::Path, model: &str, batched_tokens: u32) -> Cluster {
    let budget = batched_tokens.to_string();
    let args = [
        "--model",
        model,
        "--",
        "--device",
        "cuda",
        "--cuda-graphs",
        "on",
        "--max-num-batched-tokens",
        &budget,
    ];
    Cluster::up(cache, &args).unwrap_or_else(|e| {
        panic!(
            "pdctl up -- --device cuda: {e:#} (are the node binaries built with --features cuda?)"
        )
    })
}

/// `pdctl run` of `model` on the CPU: the greedy tokens and, per token, its top-2 logprob
/// margin.
fn reference(
    cache: &std::path::Path,
    model: &str,
    ids: &[u32],
    max_tokens: u32,
) -> (Vec<u32>, Vec<f64>) {
    let ids = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let v = json_of(&pdctl(
        cache,
        &[
            "run",
            "--model",
            model,
            "--device",
            "cpu",
            "--token-ids",
            &ids,
            "--max-tokens",
            &max_tokens.to_string(),
            "--ignore-eos",
            "--logprobs",
            "2",
            "--json",
        ],
    ));
    let mut tokens = Vec::new();
    let mut margins = Vec::new();
    for lp in v["logprobs"].as_array().expect("logprobs") {
        tokens.push(lp["token_id"].as_u64().expect("token id") as u32);
        let top = lp["top"].as_array().expect("top-2");
        let first = top[0]["logprob"].as_f64().expect("logprob");
        let second = top[1]["logprob"].as_f64().expect("logprob");
        margins.push(first - second);
    }
    (tokens, margins)
}

/// `got` equals `want` until the first position where they may differ: a thin margin there.
fn assert_same_where_clear(got: &[u32], want: &[u32], margins: &[f64], what: &str) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            assert!(
                margins[i] < CLEAR_MARGIN,
                "{what}: token {i} is {g} on CUDA but {w} on the CPU, whose top-2 margin \
                 {:.2e} is clear",
                margins[i]
            );
            return i;
        }
    }
    got.len()
}

/// Greedy requests for `prompts` through the router at `c` (serving `model`), each compared
/// with the CPU engine (`assert_same_where_clear`) and ending at its length; the tokens
/// compared.
async fn greedy_matches_cpu(
    c: &mut pb::generation_client::GenerationClient<Channel>,
    cache: &std::path::Path,
    model: &str,
    prompts: Vec<Vec<u32>>,
    what: &str,
) -> usize {
    let mut compared = 0;
    for ids in prompts {
        let (want, margins) = reference(cache, model, &ids, 12);
        let (got, last) = collect(c, greedy(ids.clone(), 12)).await.expect("a stream");
        let prompt = format!("{what}prompt of {} tokens", ids.len());
        compared += assert_same_where_clear(&got, &want, &margins, &prompt);
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    }
    compared
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs CUDA nodes (a GPU, or pd-cuda-emu): scripts/cuda-check.sh runs it"]
async fn keystone_on_cuda_nodes_equals_the_cpu_engine() {
    let cache = tempfile::tempdir().expect("tempdir");
    // Chunked prefill on: 7-token chunks.
    let cluster = cuda_cluster(cache.path(), "synthetic:tiny", 7);
    let mut c = client(&cluster.router()).await;
    let compared = greedy_matches_cpu(&mut c, cache.path(), "synthetic:tiny", prompts(), "").await;
    assert!(
        compared >= 30,
        "only {compared} of 60 tokens could be compared: margins too thin to say anything"
    );
    let received = nodes_sum(&cluster, "decode", "pd_node_kv_transfer_bytes_total", &[]).await;
    assert!(received > 0.0, "the decode node received KV");
    // GPU KV: the puller copied every import into blocks reserved on the device (the import
    // stream), none was left for the engine thread to copy in at admission.
    let mut landed = Vec::new();
    for landing in ["device_copy", "in_place", "buffers"] {
        let labels = [("landing", landing)];
        landed.push(nodes_sum(&cluster, "decode", "pd_node_kv_imports_total", &labels).await);
    }
    assert_eq!(
        landed,
        [prompts().len() as f64, 0.0, 0.0],
        "imports by landing"
    );

    // The longest prompt again: its whole blocks are in the prefill node's GPU cache.
    let long = prompts().pop().expect("a prompt");
    let (again, last) = collect(&mut c, greedy(long.clone(), 12))
        .await
        .expect("a stream");
    let (want, margins) = reference(cache.path(), "synthetic:tiny", &long, 12);
    assert_same_where_clear(&again, &want, &margins, "repeated prompt");
    let usage = last.usage.expect("usage");
    let whole_blocks = ((long.len() - 1) / 16 * 16) as u32;
    assert_eq!(usage.local_cached_tokens, whole_blocks);
    all_blocks_free(&cluster).await;
    assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
}

/// Qwen3-MoE on CUDA nodes: prompts of 5 to 200 tokens, so that the prefill node routes
/// short prompts through the weight-streaming kernels and long ones through the grouped path,
/// and the decode node decodes through CUDA graphs with every sparse layer routed inside
/// them; the tokens equal the CPU engine's where its margins are clear, and every block is
/// free afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs CUDA nodes (a GPU, or pd-cuda-emu): scripts/cuda-check.sh runs it"]
async fn a_qwen3_moe_on_cuda_nodes_equals_the_cpu_engine() {
    const MODEL: &str = "synthetic:tiny-moe";
    let cache = tempfile::tempdir().expect("tempdir");
    // A 200-token prompt is one prefill chunk of 200 rows: the grouped path. (The default
    // 2,048-token budget would set aside more activation memory than the emulated card has.)
    let cluster = cuda_cluster(cache.path(), MODEL, 256);
    let mut c = client(&cluster.router()).await;
    let prompts = spread_prompts(3, 5, 97, 13);
    assert!(
        prompts.last().is_some_and(|p| p.len() > 128),
        "a grouped prefill"
    );
    let compared = greedy_matches_cpu(&mut c, cache.path(), MODEL, prompts, "MoE ").await;
    assert!(
        compared >= 18,
        "only {compared} of 36 tokens could be compared: margins too thin to say anything"
    );
    all_blocks_free(&cluster).await;
    assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
}

/// A node of `role` on `device`, with the flags of the keystone above.
fn node(role: &str, device: &str, cache: &std::path::Path) -> Process {
    Process::start(
        &format!("{role}-node"),
        cache,
        &[
            "--model",
            "synthetic:tiny",
            "--port",
            "0",
            "--device",
            device,
            "--max-num-batched-tokens",
            "7",
        ],
    )
    .unwrap_or_else(|e| panic!("{role} node on {device}: {e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs CUDA nodes (a GPU, or pd-cuda-emu): scripts/cuda-check.sh runs it"]
async fn cpu_and_cuda_nodes_hand_kv_to_each_other() {
    let cache = tempfile::tempdir().expect("tempdir");
    for (prefill_device, decode_device) in [("cpu", "cuda"), ("cuda", "cpu")] {
        let what = format!("prefill on {prefill_device}, decode on {decode_device}");
        let prefill = node("prefill", prefill_device, cache.path());
        let decode = node("decode", decode_device, cache.path());
        let router = Process::start(
            "router",
            cache.path(),
            &[
                "--model",
                "synthetic:tiny",
                "--prefill",
                &prefill.addr(),
                "--decode",
                &decode.addr(),
            ],
        )
        .expect("router");
        wait_serving(&router.addr()).await.expect("router serving");
        let mut c = client(&router.addr()).await;
        let later: Vec<_> = prompts().into_iter().skip(2).collect();
        let label = format!("{what}: ");
        let compared =
            greedy_matches_cpu(&mut c, cache.path(), "synthetic:tiny", later, &label).await;
        assert!(
            compared >= 18,
            "{what}: only {compared} of 36 tokens compared"
        );
        let counters = node_info(&decode.addr(), "decode")
            .await
            .counters
            .expect("counters");
        assert_eq!(
            counters.kv_transfers, 3,
            "{what}: one KV transfer per request"
        );
        // Where the imports landed: reserved device blocks copied in by the puller on a GPU,
        // reserved host blocks filled in place on a CPU.
        let metrics = exposition(&metrics_addr(&decode.ready))
            .await
            .expect("decode node metrics");
        let landing = if decode_device == "cuda" {
            "device_copy"
        } else {
            "in_place"
        };
        assert_eq!(
            metrics.sum("pd_node_kv_imports_total", &[("landing", landing)]),
            3.0,
            "{what}: imports landed {landing}"
        );
    }
}
