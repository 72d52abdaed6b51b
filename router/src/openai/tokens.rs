//! vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer and chat
//! template, so a client counts tokens exactly as a request will be counted.

use axum::http::StatusCode;
use axum::response::Response;
use pd_proto::pb;
use serde::Deserialize;
use serde_json::{Value, json};

use axum::response::IntoResponse;

use super::request::{chat_messages, parse_json};
use super::{Api, error, json_response};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    model: Option<String>,
    /// Raw text (no template, no special tokens added)…
    prompt: Option<String>,
    /// …or a conversation, rendered as a chat request's would be.
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `{"count", "max_model_len", "tokens"}` of a prompt or a conversation.
pub(super) async fn tokenize(api: Api, bytes: &[u8]) -> Response {
    let body: TokenizeBody = match parse_json(bytes) {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    if let Some(refused) = api.refuse_model(body.model.as_deref()) {
        return refused;
    }
    let input = match (body.prompt, body.messages) {
        (Some(text), None) => pb::generate_request::Input::Text(text),
        (None, Some(messages)) => {
            match chat_messages(
                &messages,
                body.tools.as_deref(),
                body.chat_template_kwargs.as_ref(),
            ) {
                Ok(chat) => pb::generate_request::Input::Chat(chat),
                Err(e) => return error(StatusCode::BAD_REQUEST, &e.0),
            }
        }
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "set exactly one of `prompt` and `messages`",
            );
        }
    };
    let shared = api.shared.clone();
    let ids = tokio::task::spawn_blocking(move || shared.validator.prompt(Some(input))).await;
    let context = api
        .shared
        .registry
        .context_len(api.shared.model.max_position_embeddings());
    match ids {
        Ok(Ok(ids)) => json_response(
            StatusCode::OK,
            &json!({"count": ids.len(), "max_model_len": context, "tokens": ids}),
        ),
        Ok(Err(e)) => error(StatusCode::BAD_REQUEST, &e.to_string()),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("tokenizing panicked: {e}"),
        ),
    }
}

/// `{"prompt"}`: the text of token ids (special tokens included).
pub(super) async fn detokenize(api: Api, bytes: &[u8]) -> Response {
    let body: DetokenizeBody = match parse_json(bytes) {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    if let Some(refused) = api.refuse_model(body.model.as_deref()) {
        return refused;
    }
    match api.shared.model.tokenizer().decode(&body.tokens, false) {
        Ok(text) => json_response(StatusCode::OK, &json!({"prompt": text})),
        Err(e) => error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}
