//! The generate flow: prefill then decode, text, usage, logprobs and stop strings. Cancellation
//! and deadlines are in [`cancel`]; retries, failures and routing in [`failover`]; engine
//! panics, the retry budget and circuit breakers in [`isolation`]; a request
//! of `n` choices in [`choices`]; the first chunk's `prompt_tokens` in [`prompt_tokens`].

mod cancel;
mod choices;
mod failover;
mod isolation;
mod prompt_tokens;

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use pd_proto::pb;
use pd_router::{PolicyKind, RouterConfig};

use crate::fake::*;

const IM_END: u32 = 151_645;

/// Waits until the router sees every node up.
async fn all_up(router: &RouterUnderTest) {
    eventually("all nodes up", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
}

/// Waits until the decode node `d` is told to abort the first request it saw.
async fn decode_aborted(d: &FakeNode) {
    let decode_id = d.state.decodes.lock().unwrap()[0].request_id.clone();
    eventually("the decode node is aborted", || {
        d.state.aborted() == [decode_id.clone()]
    })
    .await;
}

/// Two prefill nodes taken in turn (round robin) and one decode node, behind a router started
/// with `edit` applied to its config, once it sees every node up: `(p0, p1, d, router)`.
async fn two_prefills_in_turn(
    edit: impl FnOnce(&mut RouterConfig),
) -> (FakeNode, FakeNode, FakeNode, RouterUnderTest) {
    let p0 = FakeNode::prefill().await;
    let p1 = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p0, &p1], &[&d]);
    cfg.policy = PolicyKind::RoundRobin;
    edit(&mut cfg);
    let router = RouterUnderTest::start(cfg).await;
    all_up(&router).await;
    (p0, p1, d, router)
}

#[tokio::test]
async fn streams_the_prefill_token_then_the_decode_tokens() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let ids = tok
        .encode(" The quick brown fox jumps over the lazy dog.")
        .unwrap();
    p.state.first_token.store(ids[0], SeqCst);
    let mut rest = ids[1..].to_vec();
    rest.push(IM_END);
    *d.state.script.lock().unwrap() = Script {
        messages: vec![rest[..2].to_vec(), rest[2..5].to_vec(), rest[5..].to_vec()],
        end: End::Finish(pb::FinishReason::Stop),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let prompt = "Write a sentence about a fox.";
    let mut req = text_request(prompt);
    req.max_tokens = Some(50);
    let (chunks, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none(), "{error:?}");

    assert_eq!(
        chunks.len(),
        4,
        "first token, then one chunk per decode message"
    );
    assert_eq!(chunks[0].token_ids, [ids[0]]);
    assert_eq!(chunks[0].text, tok.decode(&ids[..1], true).unwrap());
    assert_eq!(
        all_text(&chunks),
        " The quick brown fox jumps over the lazy dog."
    );
    let mut want_ids = ids.clone();
    want_ids.push(IM_END);
    assert_eq!(all_ids(&chunks), want_ids);
    let request_id = &chunks[0].request_id;
    assert!(!request_id.is_empty());
    for c in &chunks {
        assert_eq!(&c.request_id, request_id);
        assert!(c.logprobs.is_empty(), "no logprobs unless asked for");
        assert!(c.prompt_logprobs.is_empty());
    }
    for c in &chunks[..3] {
        assert_eq!(c.finish_reason(), pb::FinishReason::Unspecified);
        assert!(c.usage.is_none());
    }
    let last = chunks.last().unwrap();
    assert_eq!(last.finish_reason(), pb::FinishReason::Stop);
    let prompt_ids = tok.encode(prompt).unwrap();
    assert_eq!(
        last.usage,
        Some(pb::Usage {
            prompt_tokens: prompt_ids.len() as u32,
            completion_tokens: want_ids.len() as u32,
            // The prefill node's cache savings; never the decode node's numbers.
            cached_tokens: LOCAL_CACHED + EXTERNAL_CACHED,
            local_cached_tokens: LOCAL_CACHED,
            external_cached_tokens: EXTERNAL_CACHED,
            external_host_cached_tokens: EXTERNAL_CACHED,
            external_peer_cached_tokens: 0,
        })
    );

    let prefill = p.state.prefills.lock().unwrap()[0].clone();
    assert_eq!(prefill.token_ids, prompt_ids);
    assert!(prefill.request_id.starts_with(request_id.as_str()));
    let decode = d.state.decodes.lock().unwrap()[0].clone();
    assert_eq!(decode.prompt_token_ids, prompt_ids);
    assert_eq!(decode.first_token, ids[0]);
    assert_eq!(decode.max_tokens, 50, "max_tokens counts the first token");
    let kv = decode.kv.unwrap();
    assert_eq!(kv.layout_fingerprint, FINGERPRINT);
    assert_eq!(*p.state.leases.lock().unwrap(), [kv.lease_id]);
    eventually("the lease is released", || {
        p.state.released() == [kv.lease_id]
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        d.state.aborted().is_empty(),
        "the decode node finished on its own"
    );
    assert_eq!(d.state.streams_cancelled.load(SeqCst), 0);
    assert!(p.state.aborted().is_empty());
    assert_eq!(p.state.released().len(), 1, "released exactly once");
}

#[tokio::test]
async fn a_first_token_that_ends_the_request_skips_decode() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();

    let mut req = text_request("Hi");
    req.max_tokens = Some(1);
    let (chunks, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none());
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].token_ids, [100]);
    assert_eq!(chunks[0].finish_reason(), pb::FinishReason::Length);
    assert_eq!(chunks[0].usage.unwrap().completion_tokens, 1);

    // EOS as the first token: STOP, no text.
    p.state.first_token.store(IM_END, SeqCst);
    let (chunks, _) = collect(&mut client, text_request("Hi")).await.unwrap();
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].finish_reason(), pb::FinishReason::Stop);
    assert_eq!(chunks[0].text, "");

    assert_eq!(d.state.decode_count(), 0);
    eventually("both leases released right away", || {
        let mut r = p.state.released();
        r.sort();
        r == *p.state.leases.lock().unwrap()
    })
    .await;
}

#[tokio::test]
async fn logprobs_and_prompt_logprobs_when_asked_for() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101, 102], vec![103]],
        end: End::Finish(pb::FinishReason::Length),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("one two three four");
    req.max_tokens = Some(4);
    req.bad_words = vec!["  fox".into()];
    req.sampling = Some(pb::SamplingParams {
        logprobs: Some(1),
        prompt_logprobs: Some(0),
        temperature: Some(0.0),
        ..Default::default()
    });
    let (chunks, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none());
    let prompt_len = tok.encode("one two three four").unwrap().len();
    assert_eq!(chunks[0].prompt_logprobs.len(), prompt_len - 1);
    assert!(chunks[1..].iter().all(|c| c.prompt_logprobs.is_empty()));
    for c in &chunks {
        assert_eq!(c.logprobs.len(), c.token_ids.len());
        for (l, &id) in c.logprobs.iter().zip(&c.token_ids) {
            assert_eq!(l.token_id, id);
        }
    }
    assert_eq!(all_ids(&chunks), [100, 101, 102, 103]);
    assert_eq!(
        chunks.last().unwrap().finish_reason(),
        pb::FinishReason::Length
    );
    let sent = p.state.prefills.lock().unwrap()[0]
        .sampling
        .clone()
        .unwrap();
    assert_eq!(sent.temperature, Some(0.0));
    // The bad word, tokenized as written and after a space, for the nodes.
    assert_eq!(
        sent.bad_words_token_ids,
        [
            pb::TokenSequence {
                ids: tok.encode("fox").unwrap()
            },
            pb::TokenSequence {
                ids: tok.encode(" fox").unwrap()
            }
        ]
    );
    assert_eq!(sent.logprobs, Some(1));
    assert_eq!(sent.prompt_logprobs, Some(0));
}

#[tokio::test]
async fn a_stop_string_ends_the_request_and_aborts_the_decode_node() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let ids = tok.encode(" one two three STOP four five six").unwrap();
    p.state.first_token.store(ids[0], SeqCst);
    *d.state.script.lock().unwrap() = Script {
        messages: ids[1..].iter().map(|&t| vec![t]).collect(),
        // The decode node would go on forever: only the router's stop string ends it.
        end: End::Hang,
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("count");
    req.stop = vec!["STOP".into()];
    let (chunks, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none());
    assert_eq!(all_text(&chunks), " one two three ");
    let last = chunks.last().unwrap();
    assert_eq!(last.finish_reason(), pb::FinishReason::Stop);
    assert_eq!(
        last.stop_reason,
        Some(pb::generate_response::StopReason::StopString("STOP".into()))
    );
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c.stop_reason.is_none()),
        "only the last chunk says why"
    );
    assert_eq!(
        last.usage.unwrap().completion_tokens as usize,
        all_ids(&chunks).len()
    );
    assert!(all_ids(&chunks).len() < ids.len(), "ended early");

    decode_aborted(&d).await;
    eventually("the decode stream is dropped", || {
        d.state.streams_cancelled.load(SeqCst) == 1
    })
    .await;
    eventually("the lease is released", || p.state.released().len() == 1).await;
}

#[tokio::test]
async fn truncate_prompt_tokens_sends_only_the_prompts_tail() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101]],
        end: End::Finish(pb::FinishReason::Length),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let req = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
            ids: (1..=10).collect(),
        })),
        max_tokens: Some(2),
        truncate_prompt_tokens: Some(4),
        ..Default::default()
    };
    let (chunks, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(p.state.prefills.lock().unwrap()[0].token_ids, [7, 8, 9, 10]);
    assert_eq!(
        d.state.decodes.lock().unwrap()[0].prompt_token_ids,
        [7, 8, 9, 10]
    );
    assert_eq!(chunks.last().unwrap().usage.unwrap().prompt_tokens, 4);
}
