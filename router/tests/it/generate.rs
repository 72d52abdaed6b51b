//! The generate flow: prefill then decode, text, usage, stop strings, cancellation, retries.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use pd_router::PolicyKind;
use tonic::Code;
use tonic::transport::Channel;

use crate::fake::*;

const IM_END: u32 = 151_645;

fn abort_request(id: &str) -> pb::AbortRequest {
    pb::AbortRequest {
        request_id: id.into(),
    }
}

/// The request `id` leaves the router's in-flight table within a second (`Abort` no longer
/// finds it).
async fn assert_leaves_flight(client: &mut GenerationClient<Channel>, id: &str) {
    for _ in 0..100 {
        let r = client.abort(abort_request(id)).await.unwrap();
        if !r.into_inner().aborted {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("request {id} is still in flight");
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
    let sent = p.state.prefills.lock().unwrap()[0].sampling.unwrap();
    assert_eq!(sent.temperature, Some(0.0));
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
        last.usage.unwrap().completion_tokens as usize,
        all_ids(&chunks).len()
    );
    assert!(all_ids(&chunks).len() < ids.len(), "ended early");

    let decode_id = d.state.decodes.lock().unwrap()[0].request_id.clone();
    eventually("the decode node is aborted", || {
        d.state.aborted() == [decode_id.clone()]
    })
    .await;
    eventually("the decode stream is dropped", || {
        d.state.streams_cancelled.load(SeqCst) == 1
    })
    .await;
    eventually("the lease is released", || p.state.released().len() == 1).await;
}

#[tokio::test]
async fn a_client_that_goes_away_aborts_downstream() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102]],
        end: End::Hang,
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("tell me a long story");
    req.request_id = Some("going-away".into());
    let mut stream = client.generate(req).await.unwrap().into_inner();
    for _ in 0..3 {
        assert!(stream.message().await.unwrap().is_some());
    }
    drop(stream);

    let decode_id = d.state.decodes.lock().unwrap()[0].request_id.clone();
    eventually("the decode node is aborted", || {
        d.state.aborted() == [decode_id.clone()]
    })
    .await;
    eventually("the decode stream is dropped", || {
        d.state.streams_cancelled.load(SeqCst) == 1
    })
    .await;
    assert_eq!(p.state.released().len(), 1);
    assert_leaves_flight(&mut client, "going-away").await;
}

#[tokio::test]
async fn abort_ends_the_stream_with_finish_reason_abort() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102]],
        end: End::Hang,
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    assert!(
        !client
            .abort(abort_request("nobody"))
            .await
            .unwrap()
            .into_inner()
            .aborted,
        "unknown ids are not aborted"
    );
    let mut req = text_request("go on");
    req.request_id = Some("mine".into());
    let mut stream = client.generate(req).await.unwrap().into_inner();
    for _ in 0..3 {
        assert!(stream.message().await.unwrap().is_some());
    }
    let r = client.abort(abort_request("mine")).await.unwrap();
    assert!(r.into_inner().aborted);
    let last = stream.message().await.unwrap().expect("a last chunk");
    assert_eq!(last.finish_reason(), pb::FinishReason::Abort);
    assert_eq!(last.usage.unwrap().completion_tokens, 3);
    assert!(stream.message().await.unwrap().is_none());

    let decode_id = d.state.decodes.lock().unwrap()[0].request_id.clone();
    eventually("the decode node is aborted", || {
        d.state.aborted() == [decode_id.clone()]
    })
    .await;
    eventually("the lease is released", || p.state.released().len() == 1).await;
    assert!(
        !client
            .abort(abort_request("mine"))
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
}

#[tokio::test]
async fn abort_while_prefilling_aborts_the_prefill_node() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_secs(30);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("slow");
    req.request_id = Some("slow".into());
    let mut c = client.clone();
    let pending = tokio::spawn(async move { collect(&mut c, req).await });
    eventually("the prefill started", || p.state.prefill_count() == 1).await;
    assert!(
        client
            .abort(abort_request("slow"))
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
    let (chunks, error) = pending.await.unwrap().unwrap();
    assert!(error.is_none());
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].finish_reason(), pb::FinishReason::Abort);
    assert_eq!(chunks[0].usage.unwrap().completion_tokens, 0);
    let prefill_id = p.state.prefills.lock().unwrap()[0].request_id.clone();
    eventually("the prefill node is aborted", || {
        p.state.aborted() == [prefill_id.clone()]
    })
    .await;
    assert_eq!(d.state.decode_count(), 0);
}

#[tokio::test]
async fn a_client_that_goes_away_while_prefilling_aborts_the_prefill_node() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_secs(30);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("slow");
    req.request_id = Some("impatient".into());
    let mut c = client.clone();
    // The response comes with the first message, so the call is still waiting for it.
    let call = tokio::spawn(async move { c.generate(req).await.map(|_| ()) });
    eventually("the prefill started", || p.state.prefill_count() == 1).await;
    call.abort();
    let prefill_id = p.state.prefills.lock().unwrap()[0].request_id.clone();
    eventually("the prefill node is aborted", || {
        p.state.aborted() == [prefill_id.clone()]
    })
    .await;
    assert_eq!(d.state.decode_count(), 0);
    assert_leaves_flight(&mut client, "impatient").await;
}

#[tokio::test]
async fn deadlines_end_requests_and_abort_the_nodes() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_secs(30);
    let mut cfg = config(&[&p], &[&d]);
    cfg.request_timeout = Some(Duration::from_millis(300));
    let router = RouterUnderTest::start(cfg).await;
    let mut client = router.client();

    // The router's --request-timeout.
    let (chunks, error) = collect(&mut client, text_request("slow")).await.unwrap();
    assert!(chunks.is_empty());
    assert_eq!(error.unwrap().code(), Code::DeadlineExceeded);
    eventually("the prefill node is aborted", || {
        p.state.aborted().len() == 1
    })
    .await;

    // The client's own grpc-timeout, when shorter.
    let mut request = tonic::Request::new(text_request("slow"));
    request.set_timeout(Duration::from_millis(100));
    let started = std::time::Instant::now();
    let outcome = client.generate(request).await;
    let status = match outcome {
        Err(s) => s,
        Ok(r) => r.into_inner().message().await.unwrap_err(),
    };
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(290));
    eventually("the prefill node is aborted again", || {
        p.state.aborted().len() == 2
    })
    .await;
    let sent = p.state.prefills.lock().unwrap()[1].clone();
    assert_eq!(sent.token_ids, tokenizer().encode("slow").unwrap());
    // Both deadlines travelled to the prefill node as grpc-timeout, no longer than they were.
    let timeouts = p.state.prefill_timeouts.lock().unwrap().clone();
    for (timeout, limit) in timeouts.iter().zip([300, 100]) {
        let value = timeout
            .as_deref()
            .expect("a deadline travels as grpc-timeout");
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("grpc-timeout", value.parse().expect("ASCII"));
        let timeout = pd_router::grpc_timeout(&metadata).expect("a valid grpc-timeout");
        assert!(timeout <= Duration::from_millis(limit), "{value}");
    }
}

#[tokio::test]
async fn without_a_deadline_the_nodes_get_none() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let mut req = text_request("no hurry");
    req.max_tokens = Some(1);
    let (_, error) = collect(&mut client, req).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    // The router enforces --node-timeout itself (and aborts the node when it passes); the
    // node is not told one, which spares it a timer per request.
    assert_eq!(*p.state.prefill_timeouts.lock().unwrap(), vec![None]);
}

#[tokio::test]
async fn a_failed_prefill_is_retried_once_on_another_node() {
    let p0 = FakeNode::prefill().await;
    let p1 = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let mut cfg = config(&[&p0, &p1], &[&d]);
    cfg.policy = PolicyKind::RoundRobin;
    let router = RouterUnderTest::start(cfg).await;
    eventually("all nodes up", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    p0.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("retry me"))
        .await
        .unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    assert_eq!(p0.state.prefill_count(), 1);
    assert_eq!(p1.state.prefill_count(), 1);
    let lease = d.state.decodes.lock().unwrap()[0]
        .kv
        .clone()
        .unwrap()
        .lease_id;
    assert_eq!(*p1.state.leases.lock().unwrap(), [lease]);
    eventually("p1's lease is released", || p1.state.released() == [lease]).await;
    let failed_id = p0.state.prefills.lock().unwrap()[0].request_id.clone();
    eventually("the failed attempt is aborted", || {
        p0.state.aborted() == [failed_id.clone()]
    })
    .await;
}

#[tokio::test]
async fn prefill_failures_reach_the_client_without_hanging() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();

    // Unavailable, and no other node to retry on.
    p.state.fail_next.store(1, SeqCst);
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(chunks.is_empty());
    let status = error.unwrap();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains(&p.address()), "{status:?}");
    assert!(status.message().contains("scripted failure"), "{status:?}");

    // The node's verdict on the request is passed on, not retried.
    eventually("the prefill node is up again", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    *p.state.fail_code.lock().unwrap() = Code::InvalidArgument;
    p.state.fail_next.store(1, SeqCst);
    let before = p.state.prefill_count();
    let (_, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert_eq!(error.unwrap().code(), Code::InvalidArgument);
    assert_eq!(p.state.prefill_count(), before + 1);
    assert_eq!(d.state.decode_count(), 0);
}

#[tokio::test]
async fn a_decode_failure_after_tokens_is_unavailable() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102]],
        end: End::Fail(Code::Internal),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    let status = error.expect("an error after the tokens");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("decode node"), "{status:?}");
    assert!(status.message().contains("after 3 tokens"), "{status:?}");
    eventually("the lease is released", || p.state.released().len() == 1).await;
    assert_eq!(d.state.decode_count(), 1, "no retry once tokens streamed");
}

#[tokio::test]
async fn a_decode_node_failing_before_its_first_token_is_replaced() {
    let p = FakeNode::prefill().await;
    let d0 = FakeNode::decode().await;
    let d1 = FakeNode::decode().await;
    // d0 is the least loaded, so it is tried first.
    d1.state.load.store(3, SeqCst);
    let router = RouterUnderTest::start(config(&[&p], &[&d0, &d1])).await;
    eventually("all nodes up with their load", || {
        router
            .registry
            .nodes()
            .iter()
            .all(|n| n.is_up() && n.info().is_some())
            && router.registry.nodes()[2].load() == 3
    })
    .await;
    d0.state.fail_next.store(1, SeqCst);
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("x")).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(all_ids(&chunks), [100, 101, 102]);
    assert_eq!(d0.state.decode_count(), 1);
    assert_eq!(d1.state.decode_count(), 1);
    let kv0 = d0.state.decodes.lock().unwrap()[0].kv.clone().unwrap();
    let kv1 = d1.state.decodes.lock().unwrap()[0].kv.clone().unwrap();
    assert_eq!(kv0, kv1, "the same lease, still held");
    eventually("released once", || p.state.released() == [kv1.lease_id]).await;
}

#[tokio::test]
async fn prefix_aware_routing_follows_the_prompt_and_yields_to_load() {
    let p0 = FakeNode::prefill().await;
    let p1 = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    let router = RouterUnderTest::start(config(&[&p0, &p1], &[&d])).await;
    eventually("all nodes up", || {
        router.registry.nodes().iter().all(|n| n.is_up())
    })
    .await;
    let mut client = router.client();
    let doc = "The history of the city begins with a small settlement by the river. ".repeat(8);
    let (_, e) = collect(&mut client, text_request(&doc)).await.unwrap();
    assert!(e.is_none());
    let (home, away) = if p0.state.prefill_count() == 1 {
        (&p0, &p1)
    } else {
        (&p1, &p0)
    };
    for suffix in ["Summarize.", "Translate it.", "Who lived there?"] {
        let (_, e) = collect(&mut client, text_request(&format!("{doc}{suffix}")))
            .await
            .unwrap();
        assert!(e.is_none());
    }
    assert_eq!(
        home.state.prefill_count(),
        4,
        "the shared prefix stays home"
    );
    assert_eq!(away.state.prefill_count(), 0);

    // The home node gets busy: balance wins over affinity.
    home.state.load.store(50, SeqCst);
    let home_node = router
        .registry
        .nodes()
        .iter()
        .find(|n| n.addr == home.address())
        .unwrap()
        .clone();
    eventually("the router sees the load", || home_node.load() >= 50).await;
    let (_, e) = collect(&mut client, text_request(&format!("{doc}Again.")))
        .await
        .unwrap();
    assert!(e.is_none());
    assert_eq!(away.state.prefill_count(), 1);
}
