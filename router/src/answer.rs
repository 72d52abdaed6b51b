//! The gRPC API's reading of answers (`GenerateRequest.parse_reasoning` /
//! `parse_tool_calls`): each choice's text goes through a parser of its own, the same one
//! the OpenAI-compatible API uses ([`AnswerParser`]: Qwen3's `<think>` block, Hermes-style
//! `<tool_call>` blocks: always Hermes's, whatever the router's `--tool-call-parser`, since
//! the request has no field to pick Qwen3-Coder's), and each chunk's `text` becomes what the
//! parser gave out as content, with `reasoning` and `tool_calls` beside it; every other field
//! (`token_ids`, `prompt_tokens`, usage, ...) passes as it is. Owns only that mapping onto the
//! wire's chunks; not the parsing.

use std::collections::HashMap;
use std::pin::Pin;

use pd_proto::pb;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::openai::parse::AnswerParser;

/// A response stream of the gRPC API.
pub(crate) type Chunks = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// What a request asks to be read out of its answers' text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Parse {
    reasoning: bool,
    tools: bool,
}

impl Parse {
    pub(crate) fn of(request: &pb::GenerateRequest) -> Self {
        Self {
            reasoning: request.parse_reasoning,
            tools: request.parse_tool_calls,
        }
    }
}

/// `chunks` with each choice's text read for reasoning and tool calls as `parse` says
/// (`chunks` itself when it asks for neither).
pub(crate) fn parsed(chunks: Chunks, parse: Parse) -> Chunks {
    let Parse { reasoning, tools } = parse;
    if !reasoning && !tools {
        return chunks;
    }
    let mut parsers: HashMap<u32, AnswerParser> = HashMap::new();
    Box::pin(chunks.map(move |item| {
        let mut chunk = item?;
        let parser = parsers
            .entry(chunk.index)
            .or_insert_with(|| AnswerParser::new(reasoning, tools));
        let mut parsed = parser.push(&chunk.text);
        if chunk.finish_reason != pb::FinishReason::Unspecified as i32 {
            parsed.append(parser.finish());
            parsers.remove(&chunk.index);
        }
        chunk.text = parsed.content;
        chunk.reasoning = parsed.reasoning;
        let request_id = &chunk.request_id;
        chunk.tool_calls = parsed
            .calls
            .into_iter()
            .map(|call| pb::ToolCallPart {
                index: call.index as u32,
                // The HTTP API's shape of id: `call-<choice's request id>.<call>`.
                id: call
                    .name
                    .is_some()
                    .then(|| format!("call-{request_id}.{}", call.index)),
                name: call.name,
                arguments: call.arguments,
            })
            .collect();
        Ok(chunk)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(index: u32, text: &str, last: bool) -> Result<pb::GenerateResponse, Status> {
        Ok(pb::GenerateResponse {
            request_id: format!("r-{index}"),
            text: text.into(),
            index,
            finish_reason: if last {
                pb::FinishReason::Stop as i32
            } else {
                pb::FinishReason::Unspecified as i32
            },
            ..Default::default()
        })
    }

    async fn run(
        request: &pb::GenerateRequest,
        items: Vec<Result<pb::GenerateResponse, Status>>,
    ) -> Vec<Result<pb::GenerateResponse, Status>> {
        parsed(Box::pin(tokio_stream::iter(items)), Parse::of(request))
            .collect()
            .await
    }

    #[tokio::test]
    async fn each_choice_is_read_apart_and_its_calls_stream_in_pieces() {
        let request = pb::GenerateRequest {
            parse_reasoning: true,
            parse_tool_calls: true,
            ..Default::default()
        };
        // Two choices interleaved, tags split across chunks.
        let out = run(
            &request,
            vec![
                chunk(0, "<thi", false),
                chunk(1, "plain ", false),
                chunk(0, "nk>why</think>\n\nok <tool_", false),
                chunk(1, "answer", true),
                chunk(0, "call>\n{\"name\": \"f\", \"arguments\": {\"a\"", false),
                chunk(0, ": 1}}\n</tool_call>", true),
            ],
        )
        .await;
        let out: Vec<pb::GenerateResponse> = out.into_iter().map(Result::unwrap).collect();
        let of = |i: u32| out.iter().filter(move |c| c.index == i);
        let text = |i: u32| of(i).map(|c| c.text.as_str()).collect::<String>();
        let reasoning = |i: u32| of(i).map(|c| c.reasoning.as_str()).collect::<String>();
        assert_eq!(text(0), "ok");
        assert_eq!(reasoning(0), "why");
        assert_eq!(text(1), "plain answer");
        assert_eq!(reasoning(1), "");
        // The held-back tag start gave out nothing.
        assert_eq!(out[0].text, "");
        let parts: Vec<&pb::ToolCallPart> = of(0).flat_map(|c| &c.tool_calls).collect();
        assert_eq!(parts[0].id.as_deref(), Some("call-r-0.0"));
        assert_eq!(parts[0].name.as_deref(), Some("f"));
        assert!(
            parts[1..]
                .iter()
                .all(|p| p.id.is_none() && p.name.is_none())
        );
        let arguments: String = parts.iter().map(|p| p.arguments.as_str()).collect();
        assert_eq!(arguments, "{\"a\": 1}");
    }

    #[tokio::test]
    async fn the_other_fields_pass_through() {
        let request = pb::GenerateRequest {
            parse_reasoning: true,
            parse_tool_calls: true,
            ..Default::default()
        };
        let mut first = chunk(0, "<think>a", false).unwrap();
        first.prompt_tokens = Some(7);
        first.token_ids = vec![1, 2];
        let out = run(&request, vec![Ok(first), chunk(0, "</think>b", true)]).await;
        let out: Vec<pb::GenerateResponse> = out.into_iter().map(Result::unwrap).collect();
        assert_eq!(out[0].prompt_tokens, Some(7));
        assert_eq!(out[0].token_ids, [1, 2]);
        assert_eq!(out[1].prompt_tokens, None);
    }

    #[tokio::test]
    async fn unasked_the_text_is_untouched_and_errors_pass() {
        let request = pb::GenerateRequest::default();
        let out = run(
            &request,
            vec![
                chunk(0, "<think>x</think>", false),
                Err(Status::internal("gone")),
            ],
        )
        .await;
        assert_eq!(out[0].as_ref().unwrap().text, "<think>x</think>");
        assert_eq!(out[1].as_ref().unwrap_err().message(), "gone");
        let tools_only = pb::GenerateRequest {
            parse_tool_calls: true,
            ..Default::default()
        };
        let out = run(&tools_only, vec![chunk(0, "<think>x</think>y", true)]).await;
        assert_eq!(out[0].as_ref().unwrap().text, "<think>x</think>y");
    }
}
