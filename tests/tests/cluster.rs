//! The keystone and the cluster's behaviour, through real processes started by `pdctl up`.

use pd_proto::pb;
use pd_tests::{
    Cluster, all_blocks_free, assert_each_equals_reference, client, collect, exposition, greedy,
    json_of, node_info, pdctl, reference_run_on, reference_run_with, reference_tokens,
    spread_prompts, token_ids,
};

/// Prompts of several lengths (some spanning many 16-token blocks).
fn prompts() -> Vec<Vec<u32>> {
    spread_prompts(6, 3, 13, 11)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keystone_pd_equals_one_mixed_engine_and_accounts_exactly() {
    let cache = tempfile::tempdir().unwrap();
    // Chunked prefill on: the prefill node computes long prompts in pieces of 7 tokens.
    let cluster = Cluster::up_chunked(cache.path(), "1").unwrap();
    let mut c = client(&cluster.router()).await;
    assert_each_equals_reference(&mut c, cache.path(), prompts(), 12).await;
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

    // Penalties and min_tokens across the split: the prefill node keeps the first token off
    // the stop id, the decode node penalises the output it continues (the prefill node's
    // token included) and keeps the minimum, as one engine does.
    let ids = prompts().remove(2);
    let stop = reference_tokens(cache.path(), &ids, 1)[0];
    let flags = [
        "--frequency-penalty",
        "1.5",
        "--presence-penalty",
        "0.5",
        "--min-tokens",
        "3",
        "--stop-token-ids",
        &stop.to_string(),
    ];
    let want = token_ids(&reference_run_with(cache.path(), &ids, 12, &flags));
    let mut req = greedy(ids, 12);
    req.stop_token_ids = vec![stop];
    let s = req.sampling.as_mut().unwrap();
    (s.frequency_penalty, s.presence_penalty, s.min_tokens) = (Some(1.5), Some(0.5), Some(3));
    let (got, last) = collect(&mut c, req).await.unwrap();
    assert_eq!(got, want);
    assert!(
        !got[..3].contains(&stop),
        "{got:?} starts with stop id {stop}"
    );
    let (reason, why) = if got.last() == Some(&stop) {
        (
            pb::FinishReason::Stop,
            Some(pb::generate_response::StopReason::StopTokenId(stop)),
        )
    } else {
        (pb::FinishReason::Length, None)
    };
    assert_eq!((last.finish_reason(), last.stop_reason), (reason, why));
    // Allowed ids and a logit bias: every token, the prefill node's first included, is one
    // of them, as one engine chooses.
    let ids = prompts().remove(3);
    let flags = [
        "--allowed-token-ids",
        "101,202,303,404",
        "--logit-bias",
        "202:1.5,999:50",
        "--frequency-penalty",
        "0.7",
    ];
    let want = token_ids(&reference_run_with(cache.path(), &ids, 12, &flags));
    let mut req = greedy(ids, 12);
    let s = req.sampling.as_mut().unwrap();
    s.allowed_token_ids = vec![101, 202, 303, 404];
    s.logit_bias = [(202, 1.5), (999, 50.0)].into_iter().collect();
    s.frequency_penalty = Some(0.7);
    let (got, _) = collect(&mut c, req).await.unwrap();
    assert_eq!(got, want);
    assert!(
        got.iter().all(|t| [101, 202, 303, 404].contains(t)),
        "{got:?}"
    );
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

/// Each sampled token's log-probability from a `pdctl run --json` object.
/// A greedy request of `max_tokens` tokens with each token's log-probability: (tokens,
/// log-probabilities).
async fn greedy_with_logprobs(
    c: &mut pd_proto::pb::generation_client::GenerationClient<tonic::transport::Channel>,
    ids: &[u32],
    max_tokens: u32,
) -> (Vec<u32>, Vec<f64>) {
    let mut req = greedy(ids.to_vec(), max_tokens);
    req.sampling.as_mut().unwrap().logprobs = Some(0);
    let mut stream = c.generate(req).await.unwrap().into_inner();
    let (mut got, mut lps) = (Vec::new(), Vec::new());
    while let Some(chunk) = stream.message().await.unwrap() {
        got.extend_from_slice(&chunk.token_ids);
        lps.extend(chunk.logprobs.iter().map(|l| f64::from(l.logprob)));
    }
    (got, lps)
}

fn logprobs_of(v: &serde_json::Value) -> Vec<f64> {
    let lps = v["logprobs"].as_array().expect("logprobs");
    lps.iter()
        .map(|lp| lp["logprob"].as_f64().expect("logprob"))
        .collect()
}

/// Both nodes keep their KV cache in f16: the blocks travel as f32 (exact from f16) and land
/// through a conversion instead of in place, and the cluster still equals one engine with
/// the same cache type: the same tokens, and log-probabilities that show the f16 rounding
/// (they are not f32's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_16_bit_kv_cache_equals_one_engine_with_it() {
    let cache = tempfile::tempdir().unwrap();
    let f16 = ["--kv-cache-dtype", "f16"];
    let cluster = Cluster::up(cache.path(), &["--", f16[0], f16[1]]).unwrap();
    let mut c = client(&cluster.router()).await;
    let (mut off_f16, mut off_f32) = (0.0f64, 0.0f64);
    for ids in spread_prompts(3, 20, 23, 7) {
        let want = reference_run_with(cache.path(), &ids, 10, &["--logprobs", "0", f16[0], f16[1]]);
        let f32_run = reference_run_with(cache.path(), &ids, 10, &["--logprobs", "0"]);
        let (got, lps) = greedy_with_logprobs(&mut c, &ids, 10).await;
        assert_eq!(got, token_ids(&want), "prompt of {} tokens", ids.len());
        for (g, (w, w32)) in lps
            .iter()
            .zip(logprobs_of(&want).iter().zip(logprobs_of(&f32_run)))
        {
            off_f16 = off_f16.max((g - w).abs());
            off_f32 = off_f32.max((g - w32).abs());
        }
    }
    eprintln!("logprobs: {off_f16:e} from f16's, {off_f32:e} from f32's");
    assert!(
        off_f16 <= 1e-6,
        "the cluster's f16 logprobs are {off_f16} off one engine's"
    );
    assert!(
        off_f32 > 1e-5,
        "no sign of f16 rounding: {off_f32} from f32's"
    );
    // Both nodes say how they store KV, as vLLM does.
    for role in ["prefill", "decode"] {
        let e = exposition(&cluster.node_metrics(role)[0]).await.unwrap();
        let info = "vllm:cache_config_info";
        assert_eq!(e.label_values(info, "cache_dtype"), ["float16"], "{role}");
        assert_eq!(e.label_values(info, "block_size"), ["16"], "{role}");
        assert_eq!(e.sum(info, &[("role", role)]), 1.0, "{role}");
    }
    // KV travels as stored: whole f16 blocks (synthetic:tiny: 3 layers x K and V x 16
    // tokens x 2 KV heads x 32 dims x 2 bytes), landed in place on the CPU decode node.
    let e = exposition(&cluster.node_metrics("decode")[0])
        .await
        .unwrap();
    let moved = e.sum("pd_node_kv_transfer_bytes_total", &[]);
    let f16_block = f64::from(3 * 2 * 16 * 2 * 32 * 2);
    assert!(
        moved > 0.0 && moved % f16_block == 0.0,
        "{moved} bytes is not a whole number of f16 blocks"
    );
    let imports = "pd_node_kv_imports_total";
    assert!(e.sum(imports, &[("landing", "in_place")]) > 0.0);
    assert_eq!(e.sum(imports, &[("landing", "buffers")]), 0.0);
    all_blocks_free(&cluster).await;
    assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
}

/// Qwen3-MoE served disaggregated: the same tokens and log-probabilities as one mixed
/// engine (the experts each token is routed to are the same on both nodes), and a repeated
/// prompt's whole blocks come from the prefill node's prefix cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_moe_cluster_equals_one_engine() {
    const MODEL: &str = "synthetic:tiny-moe";
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &["--model", MODEL]).unwrap();
    let mut c = client(&cluster.router()).await;
    let prompts = spread_prompts(3, 9, 21, 5);
    for ids in &prompts {
        let want = reference_run_on(cache.path(), MODEL, ids, 10, &["--logprobs", "0"]);
        let (got, lps) = greedy_with_logprobs(&mut c, ids, 10).await;
        assert_eq!(got, token_ids(&want), "prompt of {} tokens", ids.len());
        let off = lps
            .iter()
            .zip(logprobs_of(&want))
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max);
        assert!(off <= 1e-6, "logprobs {off} off one engine's");
    }
    // A different model than synthetic:tiny: the tokens differ from the dense twin's.
    assert_ne!(
        token_ids(&reference_run_on(cache.path(), MODEL, &prompts[0], 10, &[])),
        reference_tokens(cache.path(), &prompts[0], 10)
    );
    let long = prompts.last().unwrap();
    let (_, last) = collect(&mut c, greedy(long.clone(), 4)).await.unwrap();
    let usage = last.usage.unwrap();
    let whole_blocks = ((long.len() - 1) / 16 * 16) as u32;
    assert_eq!(usage.local_cached_tokens, whole_blocks);
    all_blocks_free(&cluster).await;
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
        ("n=0", bad(&|r| r.n = Some(0))),
        ("n=17", bad(&|r| r.n = Some(17))),
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
    // A request id too long to name every choice (`ID-11`) is refused as such.
    let mut long_id = greedy(vec![1, 2, 3], 4);
    long_id.n = Some(12);
    long_id.request_id = Some("x".repeat(254));
    let err = collect(&mut c, long_id).await.expect_err("id too long");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("n = 12 must be at most 253 bytes"),
        "{err:?}"
    );
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
    // Abort of a request of several choices: every choice ends, and its KV comes back.
    let mut req = greedy((0..40).collect(), 3000);
    req.request_id = Some("to-abort-all".into());
    req.n = Some(2);
    let mut stream = c.generate(req).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    let abort = pb::AbortRequest {
        request_id: "to-abort-all".into(),
    };
    assert!(c.abort(abort).await.unwrap().into_inner().aborted);
    let mut aborted = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        if chunk.finish_reason != 0 {
            assert_eq!(chunk.finish_reason(), pb::FinishReason::Abort);
            aborted.push(chunk.index);
        }
    }
    aborted.sort_unstable();
    assert_eq!(aborted, [0, 1]);
    all_blocks_free(&cluster).await;
    // A request of several choices holds its own id: a request with that id is refused while
    // it runs, either way round; an empty id is refused as with one choice.
    let mut single = greedy((0..40).collect(), 3000);
    single.request_id = Some("held".into());
    let mut stream = c.generate(single.clone()).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    let mut several = single.clone();
    several.n = Some(2);
    let err = collect(&mut c, several.clone())
        .await
        .expect_err("id in flight");
    assert!(
        err.message().contains("`held` is already in flight"),
        "{err:?}"
    );
    drop(stream);
    all_blocks_free(&cluster).await;
    let mut stream = c.generate(several).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("a first chunk");
    let err = collect(&mut c, single).await.expect_err("id in flight");
    assert!(
        err.message().contains("`held` is already in flight"),
        "{err:?}"
    );
    drop(stream);
    let mut empty = greedy(vec![1, 2, 3], 4);
    empty.n = Some(2);
    empty.request_id = Some(String::new());
    let err = collect(&mut c, empty).await.expect_err("empty id");
    assert!(err.message().contains("request_id must be 1 to"), "{err:?}");
    all_blocks_free(&cluster).await;
    // Other requests are unaffected.
    let (ids, _) = collect(&mut c, greedy(vec![1, 2, 3], 4)).await.unwrap();
    assert_eq!(ids.len(), 4);
}

/// `n` choices over gRPC: each is the request with `n = 1` and seed + i, on its own chunks
/// (`index`, `request_id` ID-i), with its own finish and usage; the later choices find the
/// prompt in the prefix cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_the_seeded_single_requests_and_share_the_prompt() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &[]).unwrap();
    let mut c = client(&cluster.router()).await;
    let prompt: Vec<u32> = (100..140).collect();
    let sampled = |seed: u64, n: Option<u32>| {
        let mut r = greedy(prompt.clone(), 6);
        let sampling = r.sampling.as_mut().unwrap();
        sampling.temperature = Some(1.0);
        sampling.seed = Some(seed);
        r.n = n;
        r.request_id = Some(format!("n-{seed}-{n:?}"));
        r
    };
    let mut stream = c.generate(sampled(5, Some(3))).await.unwrap().into_inner();
    let mut choices: Vec<(Vec<u32>, Option<pb::GenerateResponse>)> = vec![Default::default(); 3];
    while let Some(chunk) = stream.message().await.unwrap() {
        let (ids, last) = &mut choices[chunk.index as usize];
        assert!(last.is_none(), "a chunk after its choice's last: {chunk:?}");
        assert_eq!(
            chunk.request_id,
            format!("n-5-Some(3)-{}", chunk.index),
            "{chunk:?}"
        );
        ids.extend_from_slice(&chunk.token_ids);
        if chunk.finish_reason != 0 {
            *last = Some(chunk);
        }
    }
    let whole_blocks = (prompt.len() as u32 - 1) / 16 * 16;
    for (i, (ids, last)) in choices.iter().enumerate() {
        let last = last.as_ref().expect("every choice finishes");
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        let usage = last.usage.unwrap();
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, 6));
        if i > 0 {
            assert_eq!(usage.cached_tokens, whole_blocks, "choice {i}: {usage:?}");
        }
        let (alone, _) = collect(&mut c, sampled(5 + i as u64, None)).await.unwrap();
        assert_eq!(ids, &alone, "choice {i} is the request with seed {}", 5 + i);
    }
    assert_ne!(choices[0].0, choices[1].0, "choices sample apart");
    all_blocks_free(&cluster).await;
}

/// A structured output through the router, prefill node and decode node: the first token is
/// chosen under the guide on the prefill node, the rest on the decode node, which walks the
/// guide over that first token; bad specifications are refused at the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_hold_across_the_prefill_decode_handoff() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &[]).unwrap();
    let mut c = client(&cluster.router()).await;
    let request = |seed: u64, kind: pb::structured_output::Kind| {
        let mut r = greedy((1..20).collect(), 48);
        r.ignore_eos = false;
        let s = r.sampling.as_mut().unwrap();
        s.temperature = Some(1.0);
        s.seed = Some(seed);
        s.structured_output = Some(pb::StructuredOutput { kind: Some(kind) });
        r
    };
    use pb::structured_output::Kind;
    let schema = r#"{"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok", "n"]}"#;
    let tokenizer = pd_engine::tokenizer::Tokenizer::qwen3().unwrap();
    let re = regex::Regex::new("^[0-9]{2}-[a-z]{2}$").unwrap();
    let [quote, brace] = ["\"", "}"].map(|t| tokenizer.encode(t).unwrap()[0]);
    let mut objects = 0;
    for seed in 0..4 {
        let (ids, last) = collect(
            &mut c,
            request(seed, Kind::Regex("[0-9]{2}-[a-z]{2}".into())),
        )
        .await
        .unwrap();
        let text = tokenizer.decode(&ids, true).unwrap();
        assert!(re.is_match(&text), "seed {seed}: {text:?}");
        assert_eq!(last.finish_reason(), pb::FinishReason::Stop, "seed {seed}");

        let (ids, last) = collect(&mut c, request(seed, Kind::JsonSchema(schema.into())))
            .await
            .unwrap();
        let text = tokenizer.decode(&ids, true).unwrap();
        if last.finish_reason() == pb::FinishReason::Stop {
            let doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
            assert!(
                doc["ok"].is_boolean() && doc["n"].is_i64(),
                "seed {seed}: {text}"
            );
        } else {
            assert!(text.starts_with("{\"ok\":"), "seed {seed}: {text}");
        }

        // Any JSON object: the grammar's stack is walked again on the decode node. Quotes
        // and closing braces are favoured so that the random model closes its object.
        let mut r = request(seed, Kind::JsonObject(true));
        let s = r.sampling.as_mut().unwrap();
        s.logit_bias = [(quote, 8.0), (brace, 6.0)].into_iter().collect();
        let (ids, last) = collect(&mut c, r).await.unwrap();
        let text = tokenizer.decode(&ids, true).unwrap();
        if last.finish_reason() == pb::FinishReason::Stop {
            serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text)
                .unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
            // Closed on the decode node: more than the prefill node's first token.
            objects += usize::from(tokenizer.decode(&ids[..1], true).unwrap() != text);
        } else {
            assert!(text.starts_with('{'), "seed {seed}: {text}");
        }
    }
    assert!(objects > 0, "no JSON object was closed");
    for (name, req) in [
        ("regex", request(0, Kind::Regex("(".into()))),
        ("schema", request(0, Kind::JsonSchema("[".into()))),
        (
            "choices",
            request(0, Kind::Choice(pb::Choices { choices: vec![] })),
        ),
        ("ignore_eos", {
            let mut r = request(0, Kind::Regex("a".into()));
            r.ignore_eos = true;
            r
        }),
    ] {
        let err = collect(&mut c, req).await.expect_err(name);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name}: {err:?}");
        assert!(
            err.message().contains("structured output"),
            "{name}: {err:?}"
        );
    }
    all_blocks_free(&cluster).await;
    assert!(cluster.stop());
}

/// `pdctl generate` against a cluster, as the README's first command (scripts/demo.sh) runs
/// it: a streamed chat, the same long prompt twice (the second's whole blocks from the prefill
/// node's cache), and the answer parsers' flags — a request without `--parse-tool-calls`
/// carries no tool-call format (the router refuses one without the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdctl_generate_serves_the_demo_s_requests() {
    let cache = tempfile::tempdir().unwrap();
    let cluster = Cluster::up(cache.path(), &[]).unwrap();
    let router = cluster.router();
    let generate = |extra: &[&str]| {
        let base = ["generate", "--router", router.as_str()];
        pdctl(cache.path(), &[&base[..], extra].concat())
    };
    let streamed = generate(&["--chat", "Write a haiku about caches", "--max-tokens", "8"]);
    assert!(
        streamed.status.success(),
        "a streamed chat: {}",
        String::from_utf8_lossy(&streamed.stderr)
    );
    assert!(!streamed.stdout.is_empty(), "the text was streamed");
    let prompt = "A shared system prompt that many requests start with. ".repeat(6);
    let ask = |question: &str| {
        let prompt = format!("{prompt}{question}");
        json_of(&generate(&[
            "--prompt",
            &prompt,
            "--max-tokens",
            "8",
            "--json",
        ]))
    };
    let first = ask("Question one?");
    assert_eq!(first["token_ids"].as_array().unwrap().len(), 8);
    let second = ask("Question two?");
    assert!(
        second["usage"]["local_cached_tokens"].as_u64().unwrap() >= 16,
        "the shared prefix came from the prefill node's cache: {}",
        second["usage"]
    );
    for format in [&[][..], &["--tool-call-format", "qwen3-coder"][..]] {
        let base = [
            "--chat",
            "Weather?",
            "--max-tokens",
            "4",
            "--parse-tool-calls",
        ];
        let v = json_of(&generate(&[&base[..], format, &["--json"][..]].concat()));
        assert!(v["tool_calls"].is_array(), "{format:?}: {v}");
    }
    let refused = generate(&["--chat", "x", "--tool-call-format", "hermes"]);
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr).contains("--parse-tool-calls"),
        "--tool-call-format alone is refused by the command line"
    );
    all_blocks_free(&cluster).await;
    assert!(cluster.stop(), "pdctl up exits 0 on SIGTERM");
}
