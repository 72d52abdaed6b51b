//! The gRPC API's reading of answers (`GenerateRequest.parse_reasoning` /
//! `parse_tool_calls` / `tool_call_format`): each choice's text goes through a parser of its
//! own, the same one the OpenAI-compatible API uses ([`AnswerParser`]: Qwen3's `<think>` block,
//! Hermes-style or Qwen3-Coder's `<tool_call>` blocks, as the request says, whatever the
//! router's flags), and each chunk's `text` becomes what the parser gave out as content, with
//! `reasoning` and `tool_calls` beside it; every other field (`token_ids`, `prompt_tokens`,
//! usage, ...) passes as it is. Owns only that mapping onto the wire's chunks (and the check of
//! `tool_call_format`); not the parsing.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use pd_proto::pb;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::parse::AnswerParser;
use crate::parse::coder::Schemas;
use crate::validation::ValidationError;

/// A response stream of the gRPC API.
pub(crate) type Chunks = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// What a request asks to be read out of its answers' text.
#[derive(Debug, Clone)]
pub(crate) struct Parse {
    reasoning: bool,
    tools: bool,
    /// Qwen3-Coder's blocks, typed by the request's tools (`TOOL_CALL_FORMAT_QWEN3_CODER`).
    coder: Option<Arc<Schemas>>,
}

impl Parse {
    /// What `request` asks for; a `tool_call_format` that is not one, or is set without
    /// `parse_tool_calls`, is refused.
    pub(crate) fn of(request: &pb::GenerateRequest) -> Result<Self, ValidationError> {
        let format = pb::ToolCallFormat::try_from(request.tool_call_format)
            .map_err(|_| ValidationError::UnknownToolCallFormat(request.tool_call_format))?;
        if format != pb::ToolCallFormat::Unspecified && !request.parse_tool_calls {
            return Err(ValidationError::ToolCallFormatWithoutParsing);
        }
        let coder = (format == pb::ToolCallFormat::Qwen3Coder)
            .then(|| Arc::new(Schemas::of_request(request)));
        Ok(Self {
            reasoning: request.parse_reasoning,
            tools: request.parse_tool_calls,
            coder,
        })
    }

    /// A parser for one choice's answer.
    fn parser(&self) -> AnswerParser {
        AnswerParser::reading(self.reasoning, self.tools, self.coder.as_ref())
    }
}

/// `chunks` with each choice's text read for reasoning and tool calls as `parse` says
/// (`chunks` itself when it asks for neither).
pub(crate) fn parsed(chunks: Chunks, parse: Parse) -> Chunks {
    if !parse.reasoning && !parse.tools {
        return chunks;
    }
    let mut parsers: HashMap<u32, AnswerParser> = HashMap::new();
    Box::pin(chunks.map(move |item| {
        let mut chunk = item?;
        let parser = parsers.entry(chunk.index).or_insert_with(|| parse.parser());
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
        parsed(
            Box::pin(tokio_stream::iter(items)),
            Parse::of(request).unwrap(),
        )
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
    async fn qwen3_coder_blocks_are_typed_by_the_chat_s_tools() {
        let tool = r#"{"type": "function", "function": {"name": "f", "parameters":
            {"type": "object", "properties": {"n": {"type": "integer"}}}}}"#;
        let request = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Chat(pb::ChatInput {
                tools: vec![tool.into()],
                ..Default::default()
            })),
            parse_tool_calls: true,
            tool_call_format: pb::ToolCallFormat::Qwen3Coder as i32,
            ..Default::default()
        };
        let answer = "ok <tool_call>\n<function=f>\n<parameter=n>\n4";
        let items = vec![
            chunk(0, answer, false),
            chunk(0, "2\n</parameter>\n</function>\n</tool_call>", true),
        ];
        let out: Vec<pb::GenerateResponse> = run(&request, items.clone())
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let parts: Vec<&pb::ToolCallPart> = out.iter().flat_map(|c| &c.tool_calls).collect();
        assert_eq!(parts[0].name.as_deref(), Some("f"));
        let arguments: String = parts.iter().map(|p| p.arguments.as_str()).collect();
        assert_eq!(arguments, r#"{"n": 42}"#);
        assert_eq!(
            out.iter().map(|c| c.text.as_str()).collect::<String>(),
            "ok"
        );
        // Hermes (the default) leaves the block in the text.
        let hermes = pb::GenerateRequest {
            tool_call_format: pb::ToolCallFormat::Hermes as i32,
            ..request.clone()
        };
        let out = run(&hermes, items).await;
        assert!(
            out.iter()
                .all(|c| c.as_ref().unwrap().tool_calls.is_empty())
        );
        // Without a chat's tools the values stay strings.
        let text_input = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Text("x".into())),
            ..request
        };
        let out = run(&text_input, vec![chunk(0, answer, true)]).await;
        let args = &out[0].as_ref().unwrap().tool_calls[0].arguments;
        assert_eq!(args, r#"{"n": "4"}"#);
    }

    #[test]
    fn a_tool_call_format_needs_parsing_and_a_known_value() {
        let mut request = pb::GenerateRequest {
            tool_call_format: pb::ToolCallFormat::Qwen3Coder as i32,
            ..Default::default()
        };
        assert_eq!(
            Parse::of(&request).unwrap_err(),
            ValidationError::ToolCallFormatWithoutParsing
        );
        request.parse_tool_calls = true;
        assert!(Parse::of(&request).unwrap().coder.is_some());
        request.tool_call_format = 3;
        assert_eq!(
            Parse::of(&request).unwrap_err(),
            ValidationError::UnknownToolCallFormat(3)
        );
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
