//! `GenerateResponse.prompt_tokens`: the first chunk of every choice carries the prompt's
//! length as usage counts it, whichever path sends that chunk; later chunks do not.

use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::generate_request::Input;

use super::cancel::abort_request;
use crate::fake::*;

/// The chunks of choice `index`, in order.
fn of(chunks: &[pb::GenerateResponse], index: u32) -> Vec<&pb::GenerateResponse> {
    chunks.iter().filter(|c| c.index == index).collect()
}

/// Choice `index`'s first chunk carries `prompt_tokens`, equal to its last chunk's
/// usage.prompt_tokens; no other chunk carries it. Returns it.
fn assert_first_only(chunks: &[pb::GenerateResponse], index: u32) -> u32 {
    let choice = of(chunks, index);
    let first = choice.first().expect("a chunk of the choice");
    let prompt_tokens = first
        .prompt_tokens
        .unwrap_or_else(|| panic!("choice {index}'s first chunk has no prompt_tokens: {first:?}"));
    for later in &choice[1..] {
        assert_eq!(
            later.prompt_tokens, None,
            "choice {index}: only the first chunk carries prompt_tokens: {later:?}"
        );
    }
    let last = choice.last().unwrap();
    assert_ne!(last.finish_reason, 0, "choice {index} ended");
    assert_eq!(last.usage.unwrap().prompt_tokens, prompt_tokens);
    prompt_tokens
}

#[tokio::test]
async fn the_first_chunk_carries_the_prompt_s_length_and_later_ones_do_not() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102, 103], vec![104]],
        end: End::Finish(pb::FinishReason::Length),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let prompt = "Write a sentence about a fox.";

    // Prefill's first token, then decode messages.
    let (chunks, error) = collect(&mut client, text_request(prompt)).await.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(chunks.len(), 4, "{chunks:?}");
    let want = tok.encode(prompt).unwrap().len() as u32;
    assert_eq!(assert_first_only(&chunks, 0), want);

    // A request that ends with the prefill node's first token: one chunk, both.
    let mut one = text_request(prompt);
    one.max_tokens = Some(1);
    let (chunks, _) = collect(&mut client, one).await.unwrap();
    assert_eq!(chunks.len(), 1);
    assert_eq!(assert_first_only(&chunks, 0), want);

    // Counted after truncate_prompt_tokens.
    let truncated = pb::GenerateRequest {
        input: Some(Input::TokenIds(pb::TokenIds {
            ids: (1..=10).collect(),
        })),
        max_tokens: Some(8),
        truncate_prompt_tokens: Some(4),
        ..Default::default()
    };
    let (chunks, _) = collect(&mut client, truncated).await.unwrap();
    assert_eq!(assert_first_only(&chunks, 0), 4);

    // A chat prompt: the rendered template's tokens, more than the message's own.
    let chat = pb::GenerateRequest {
        input: Some(Input::Chat(pb::ChatInput {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: prompt.into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        max_tokens: Some(8),
        ..Default::default()
    };
    let (chunks, _) = collect(&mut client, chat).await.unwrap();
    assert!(assert_first_only(&chunks, 0) > want);
}

/// Every choice of a request of `n` is a stream of its own: each one's first chunk carries
/// it, also when the request asks for its answers to be parsed (the parsing wrapper passes it
/// through).
#[tokio::test]
async fn every_choice_s_first_chunk_carries_it() {
    let tok = tokenizer();
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![101], vec![102], vec![103]],
        end: End::Finish(pb::FinishReason::Length),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut client = router.client();
    let want = tok.encode("once upon a time").unwrap().len() as u32;
    for parse in [false, true] {
        let mut req = text_request("once upon a time");
        req.n = Some(3);
        req.parse_reasoning = parse;
        req.parse_tool_calls = parse;
        let (chunks, error) = collect(&mut client, req).await.unwrap();
        assert!(error.is_none(), "{error:?}");
        for index in 0..3 {
            assert_eq!(of(&chunks, index).len(), 4, "{chunks:?}");
            assert_eq!(assert_first_only(&chunks, index), want, "parse: {parse}");
        }
    }
}

/// Aggregated mode (decode nodes only): the decode node's first message makes the first chunk.
#[tokio::test]
async fn aggregated_mode_s_first_chunk_carries_it() {
    let tok = tokenizer();
    let d = FakeNode::decode().await;
    *d.state.script.lock().unwrap() = Script {
        messages: vec![vec![100, 101], vec![102]],
        end: End::Finish(pb::FinishReason::Length),
        ..Default::default()
    };
    let router = RouterUnderTest::start(config(&[], &[&d])).await;
    let mut client = router.client();
    let (chunks, error) = collect(&mut client, text_request("Hello there"))
        .await
        .unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    let want = tok.encode("Hello there").unwrap().len() as u32;
    assert_eq!(assert_first_only(&chunks, 0), want);
}

/// A request aborted before its first token: its only chunk, the ABORT one, carries it.
#[tokio::test]
async fn an_abort_before_the_first_token_carries_it_too() {
    let p = FakeNode::prefill().await;
    let d = FakeNode::decode().await;
    *p.state.prefill_delay.lock().unwrap() = Duration::from_millis(300);
    let router = RouterUnderTest::start(config(&[&p], &[&d])).await;
    let mut req = text_request("stop me");
    req.request_id = Some("stopped".into());
    let running = tokio::spawn({
        let mut client = router.client();
        async move { collect(&mut client, req).await }
    });
    eventually("the request prefills", || p.state.prefill_count() == 1).await;
    let mut client = router.client();
    assert!(
        client
            .abort(abort_request("stopped"))
            .await
            .unwrap()
            .into_inner()
            .aborted
    );
    let (chunks, error) = running.await.unwrap().unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(chunks.len(), 1, "{chunks:?}");
    assert_eq!(chunks[0].finish_reason(), pb::FinishReason::Abort);
    let want = tokenizer().encode("stop me").unwrap().len() as u32;
    assert_eq!(assert_first_only(&chunks, 0), want);
}
