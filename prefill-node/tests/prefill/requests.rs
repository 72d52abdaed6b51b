//! In-process prefill requests: the answer (first token, usage, KV handle, prompt logprobs,
//! prefix-cache hits, lease-less requests), lease expiry, and refusal of bad input.

use pd_proto::pb;
use tonic::Code;

use crate::{prefill_node, prefill_request, prompt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_answers_the_first_token_usage_and_a_kv_handle_released_on_request() {
    let node = prefill_node(&[]).await;
    let mut client = node.prefill().await;
    let tokens = prompt(37, 1);
    let r = client
        .prefill(prefill_request("a", tokens.clone()))
        .await
        .expect("prefill")
        .into_inner();
    let first = r.first_token.expect("first token");
    assert!(first.token_id < 151_936);
    let usage = r.usage.expect("usage");
    assert_eq!(usage.prompt_tokens, 37);
    assert_eq!(usage.completion_tokens, 1);
    assert_eq!(usage.cached_tokens, 0, "nothing cached on a fresh node");
    let kv = r.kv.expect("kv handle");
    assert_eq!(kv.addr, node.ready.kv.expect("kv addr").to_string());
    assert_eq!(kv.layout_fingerprint, node.ready.fingerprint);
    assert_eq!(kv.block_size, 16);
    assert_eq!(kv.num_tokens, 37);
    assert_eq!(kv.num_blocks, 3);
    // synthetic:tiny: 3 layers, 2 KV heads of 32, K and V, 16 tokens per block, f32.
    assert_eq!(kv.block_bytes, 2 * 3 * 16 * 2 * 32 * 4);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        kv.lease_deadline_unix_ms > now_ms + 20_000 && kv.lease_deadline_unix_ms <= now_ms + 30_000,
        "the default lease lasts 30 s: {} vs now {now_ms}",
        kv.lease_deadline_unix_ms
    );
    assert!(r.prompt_logprobs.is_empty());

    let info = node.info().await;
    assert_eq!(info.role, pb::Role::Prefill as i32);
    assert_eq!(info.model, "synthetic:tiny");
    assert_eq!(info.layout_fingerprint, node.ready.fingerprint);
    assert_eq!(info.kv_transport_addr, kv.addr);
    assert!(info.healthy);
    assert_eq!(info.vocab_size, 151_936);
    assert_eq!(info.max_model_len, 4096);
    assert!(
        info.free_blocks <= info.num_blocks - 3,
        "the lease pins the prompt's 3 blocks: {info:?}"
    );

    let released = client
        .release_kv(crate::release_of(&kv))
        .await
        .unwrap()
        .into_inner();
    assert!(released.released);
    let again = client
        .release_kv(crate::release_of(&kv))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.released, "a lease is released once");

    // The same prompt again: its full blocks come from this node's prefix cache.
    let r2 = client
        .prefill(prefill_request("b", tokens.clone()))
        .await
        .expect("prefill")
        .into_inner();
    let u2 = r2.usage.unwrap();
    assert_eq!(u2.local_cached_tokens, 32);
    assert_eq!(u2.cached_tokens, 32);
    assert_eq!(u2.external_cached_tokens, 0);
    assert_eq!(r2.first_token.unwrap().token_id, first.token_id);
    client
        .release_kv(crate::release_of(r2.kv.as_ref().unwrap()))
        .await
        .unwrap();

    // Prompt logprobs: one per position after the first.
    let mut with_lp = prefill_request("c", prompt(9, 2));
    with_lp.sampling.as_mut().unwrap().prompt_logprobs = Some(2);
    let r3 = client.prefill(with_lp).await.expect("prefill").into_inner();
    assert_eq!(r3.prompt_logprobs.len(), 8);
    assert!(r3.prompt_logprobs.iter().all(|l| l.top.len() == 2));
    client
        .release_kv(crate::release_of(r3.kv.as_ref().unwrap()))
        .await
        .unwrap();

    // A request that ends with its first token asks for no lease: no handle, nothing held
    // once it answered, and the same first token and cache hits as with a lease.
    let mut no_lease = prefill_request("d", tokens);
    no_lease.skip_kv_lease = true;
    let r4 = client
        .prefill(no_lease)
        .await
        .expect("prefill")
        .into_inner();
    assert!(r4.kv.is_none(), "no KV handle without a lease");
    assert_eq!(r4.first_token.unwrap().token_id, first.token_id);
    assert_eq!(r4.usage.unwrap().local_cached_tokens, 32);
    let info = node.info().await;
    assert_eq!(
        (info.free_blocks, info.num_running),
        (info.num_blocks, 0),
        "nothing held once the answer came: {info:?}"
    );

    node.assert_all_blocks_free().await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_never_pulled_expires_and_its_blocks_come_back() {
    let node = prefill_node(&["--kv-lease-timeout", "0.3"]).await;
    let mut client = node.prefill().await;
    let r = client
        .prefill(prefill_request("never-pulled", prompt(50, 3)))
        .await
        .expect("prefill")
        .into_inner();
    let kv = r.kv.unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(kv.lease_deadline_unix_ms <= now_ms + 300);
    node.assert_all_blocks_free().await;
    let late = client
        .release_kv(crate::release_of(&kv))
        .await
        .unwrap()
        .into_inner();
    assert!(!late.released, "the lease expired already");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_invalid_argument_and_an_actionable_message() {
    let node = prefill_node(&["--max-model-len", "64"]).await;
    let mut client = node.prefill().await;
    let mut cases: Vec<(pb::PrefillRequest, &str)> = vec![
        (prefill_request("", prompt(4, 0)), "request_id"),
        (prefill_request("empty", vec![]), "empty"),
        (prefill_request("vocab", vec![1, 2, 151_936]), "vocabulary"),
        (prefill_request("long", prompt(64, 0)), "context"),
    ];
    let mut sampled = |f: fn(&mut pb::SamplingParams), needle: &'static str| {
        let mut r = prefill_request("sampling", prompt(4, 0));
        f(r.sampling.as_mut().unwrap());
        cases.push((r, needle));
    };
    sampled(|s| s.temperature = Some(-1.0), "temperature");
    sampled(|s| s.top_p = Some(0.0), "top_p");
    sampled(|s| s.min_p = Some(1.5), "min_p");
    sampled(|s| s.repetition_penalty = Some(0.0), "repetition_penalty");
    sampled(|s| s.presence_penalty = Some(-3.0), "presence_penalty");
    sampled(|s| s.frequency_penalty = Some(2.5), "frequency_penalty");
    sampled(|s| s.prompt_logprobs = Some(21), "logprobs");
    for (req, needle) in cases {
        let id = req.request_id.clone();
        let e = client.prefill(req).await.expect_err(&id);
        assert_eq!(e.code(), Code::InvalidArgument, "{id}: {e:?}");
        assert!(
            e.message().contains(needle),
            "{id}: {:?} should mention {needle:?}",
            e.message()
        );
    }
    let e = client
        .abort(pb::NodeAbortRequest {
            request_id: String::new(),
        })
        .await
        .expect_err("empty id");
    assert_eq!(e.code(), Code::InvalidArgument);
    let unknown = client
        .abort(pb::NodeAbortRequest {
            request_id: "nobody".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.aborted, "no such request");
    node.assert_all_blocks_free().await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_keeps_the_first_token_off_the_stop_ids_and_eos() {
    let node = prefill_node(&[]).await;
    let mut client = node.prefill().await;
    let tokens = prompt(20, 3);
    let mut first = async |id: &str, min_tokens: u32, stop: Vec<u32>| {
        let mut r = prefill_request(id, tokens.clone());
        r.skip_kv_lease = true;
        r.sampling.as_mut().unwrap().min_tokens = Some(min_tokens);
        r.stop_token_ids = stop;
        let answer = client.prefill(r).await.unwrap().into_inner();
        answer.first_token.expect("first token").token_id
    };
    let plain = first("plain", 0, vec![]).await;
    let again = first("unmasked", 0, vec![plain]).await;
    assert_eq!(again, plain, "no minimum: the stop id may come first");
    // A minimum above 1 is the decode node's to keep; here it means the first token only.
    let masked = first("masked", 5, vec![plain]).await;
    assert_ne!(
        masked, plain,
        "the greedy choice is a stop id: the next best comes"
    );
    node.assert_all_blocks_free().await;
    node.shutdown().await;
}
