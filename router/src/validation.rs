//! Every client-controlled value of a request is checked here, once, at the edge: a
//! [`pd_proto::pb::GenerateRequest`] becomes a [`ValidRequest`] (token ids, resolved sampling parameters,
//! a request id) or a [`ValidationError`] that the client gets as INVALID_ARGUMENT with a
//! message a person can act on. Nothing downstream re-checks or re-derives these values.
//!
//! Rules, in the order they are checked:
//! - `model` is empty or names the served model (its served name, or the `--model` value).
//!   An unknown model is INVALID_ARGUMENT (as every bad input; ARCHITECTURE §7), not NOT_FOUND.
//! - `request_id`, when set, is 1..=[`MAX_REQUEST_ID_BYTES`] bytes without control
//!   characters; unset, the router makes one. Uniqueness among in-flight requests is checked
//!   when the request is registered (`crate::service`), also as INVALID_ARGUMENT.
//! - Exactly one input: `text` (tokenized raw), `chat` (rendered with the model's chat
//!   template with the generation prompt, then tokenized; roles must be system / user /
//!   assistant / tool, tools at most [`MAX_CHAT_TOOLS`] JSON objects, a message's tool calls
//!   at most [`MAX_TOOL_CALLS`] JSON objects with a function name and arguments, and the
//!   template may refuse a conversation) or `token_ids`.
//! - `truncate_prompt_tokens`, when set, is 1 to the context length; the prompt keeps its
//!   last that many tokens.
//! - `bad_words` (at most [`MAX_BAD_WORDS`]) are tokenized into the sampling parameters'
//!   token sequences.
//! - Sampling ranges and stop conditions: [`SamplingParams::validate`] with the model's
//!   vocabulary and `--max-tokens-cap` (max_tokens 0 or above the cap is refused; unset it is
//!   `min(cap, context − prompt)`).
//! - `tool_call_format` is a `ToolCallFormat`, set only with `parse_tool_calls`
//!   (`crate::answer`, which reads the answers).
//! - The prompt: [`validate_prompt`] (non-empty, every id inside the model's vocabulary,
//!   shorter than the context, prompt + max_tokens within the context).
//!
//! The context is the smallest of the model's `max_position_embeddings` and the
//! `max_model_len` every healthy node reports, so a request the router accepts fits on
//! whichever node it lands on.

use pd_engine::EngineError;
use pd_engine::model::ModelFiles;
use pd_engine::sampling::{MAX_BAD_WORDS, SamplingError, SamplingParams, bad_words_token_ids};
use pd_engine::serve::{truncate_prompt, validate_prompt};
use pd_engine::tokenizer::{
    ChatMessage, ChatRole, ChatTemplateOptions, ChatTool, ChatToolCall, MAX_CHAT_TOOLS,
    MAX_TOOL_CALLS, Tokenizer,
};
use pd_proto::pb;
use tonic::Status;

/// Longest accepted client request id, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// The model the router serves: its names and metadata (no weights).
#[derive(Debug, Clone)]
pub struct ModelMeta {
    /// The name in the API (`ModelCard.name`): the engine's served name.
    pub name: String,
    /// Other names a request may use (the `--model` value itself).
    pub aliases: Vec<String>,
    pub files: ModelFiles,
    /// The ids the engines stop at, so the router's text stream agrees with them.
    pub eos_token_ids: Vec<u32>,
}

impl ModelMeta {
    /// Loads the metadata of a `--model` value (config and tokenizer; never the weights).
    pub fn load(model: &str) -> Result<Self, EngineError> {
        let source = pd_engine::model::ModelSource::parse(model)?;
        let files = source.open_metadata()?;
        let name = source.served_name();
        let aliases = if model == name {
            Vec::new()
        } else {
            vec![model.to_string()]
        };
        let eos_token_ids = files.eos_token_ids();
        Ok(Self {
            name,
            aliases,
            files,
            eos_token_ids,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.files.tokenizer
    }

    /// Token ids the model accepts (config.json's `vocab_size`, padding rows included).
    pub fn vocab_size(&self) -> usize {
        self.files.config.vocab_size
    }

    /// The model's own context length.
    pub fn max_position_embeddings(&self) -> usize {
        self.files.config.max_position_embeddings
    }

    fn accepts_name(&self, requested: &str) -> bool {
        requested.is_empty()
            || requested == self.name
            || self.aliases.iter().any(|a| a == requested)
    }
}

/// Why a request was refused. Every variant is INVALID_ARGUMENT.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    #[error("unknown model `{requested}`: this cluster serves `{served}` (or leave model empty)")]
    UnknownModel { requested: String, served: String },
    #[error("no input: set exactly one of `text`, `chat` or `token_ids`")]
    MissingInput,
    #[error("`chat.messages` is empty: send at least one message")]
    EmptyConversation,
    #[error(
        "chat.messages[{index}].role is `{role}`: expected one of system, user, assistant, tool"
    )]
    UnknownChatRole { index: usize, role: String },
    #[error("chat.tools[{index}]: {message}")]
    BadTool { index: usize, message: String },
    #[error("chat.tools has {0} tools; at most {max} are accepted", max = MAX_CHAT_TOOLS)]
    TooManyTools(usize),
    #[error("chat.messages[{index}].tool_calls[{call}]: {message}")]
    BadToolCall {
        index: usize,
        call: usize,
        message: String,
    },
    #[error(
        "chat.messages[{index}] has {count} tool calls; at most {max} are accepted",
        max = MAX_TOOL_CALLS
    )]
    TooManyToolCalls { index: usize, count: usize },
    #[error("the chat template refused the conversation: {0}")]
    ChatTemplate(String),
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(String),
    #[error("request_id must be 1 to {max} bytes without control characters, got {len} bytes", max = MAX_REQUEST_ID_BYTES)]
    BadRequestId { len: usize },
    #[error(
        "request_id `{0}` is already in flight: request ids must be unique among open requests"
    )]
    DuplicateRequestId(String),
    #[error("n must be 1 to {max}, got {0}", max = crate::choices::MAX_N)]
    Choices(u32),
    #[error("request_id of a request with n = {n} must be at most {max} bytes (its choices are `ID-0` ... `ID-{last}`), got {len} bytes", last = n - 1)]
    ChoicesRequestId { n: u32, max: usize, len: usize },
    #[error(
        "tool_call_format {0} is not a ToolCallFormat (0 unspecified, 1 HERMES, 2 QWEN3_CODER)"
    )]
    UnknownToolCallFormat(i32),
    #[error(
        "tool_call_format is set but parse_tool_calls is not: set parse_tool_calls to read calls"
    )]
    ToolCallFormatWithoutParsing,
    #[error("{0}")]
    Sampling(#[from] SamplingError),
    #[error("{0}")]
    Prompt(String),
}

impl From<ValidationError> for Status {
    fn from(e: ValidationError) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

/// A client's request id: 1 to [`MAX_REQUEST_ID_BYTES`] bytes, no control characters.
pub fn check_request_id(id: &str) -> Result<(), ValidationError> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES || id.chars().any(char::is_control) {
        return Err(ValidationError::BadRequestId { len: id.len() });
    }
    Ok(())
}

/// The input of a request, resolved to what the nodes need.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    /// Sampling and stop conditions; `max_tokens` resolved (it counts the first token).
    pub params: SamplingParams,
    /// What the nodes hash the prompt's blocks with: the client's salt, or with API keys on
    /// one derived from the tenant ([`crate::tenant::Tenancy::cache_salt`]).
    pub cache_salt: Option<String>,
    /// Whose request it is (set by the service from the caller's API key).
    pub tenant: crate::tenant::Tenant,
}

impl ValidRequest {
    /// Whether the client asked for per-token logprobs.
    pub fn wants_logprobs(&self) -> bool {
        self.params.logprobs.is_some()
    }
}

/// Turns requests into [`ValidRequest`]s.
#[derive(Debug, Clone)]
pub struct Validator {
    model: std::sync::Arc<ModelMeta>,
    max_tokens_cap: u32,
}

impl Validator {
    pub fn new(model: std::sync::Arc<ModelMeta>, max_tokens_cap: u32) -> Self {
        Self {
            model,
            max_tokens_cap,
        }
    }

    pub fn model(&self) -> &ModelMeta {
        &self.model
    }

    pub fn check_model(&self, requested: &str) -> Result<(), ValidationError> {
        if self.model.accepts_name(requested) {
            Ok(())
        } else {
            Err(ValidationError::UnknownModel {
                requested: requested.to_string(),
                served: self.model.name.clone(),
            })
        }
    }

    /// Validates a request against the model and a context length (see the module doc).
    /// `new_id` makes the request id when the client did not send one.
    pub fn validate(
        &self,
        req: pb::GenerateRequest,
        context_len: usize,
        new_id: impl FnOnce() -> String,
    ) -> Result<ValidRequest, ValidationError> {
        self.check_model(&req.model)?;
        let request_id = match req.request_id {
            Some(id) => {
                check_request_id(&id)?;
                id
            }
            None => new_id(),
        };
        let mut prompt = self.prompt(req.input)?;
        if let Some(keep) = req.truncate_prompt_tokens {
            truncate_prompt(&mut prompt, keep, context_len)
                .map_err(|e| ValidationError::Prompt(engine_message(e)))?;
        }

        let vocab_size = self.model.vocab_size();
        let room = context_len.saturating_sub(prompt.len());
        let max_tokens = match req.max_tokens {
            Some(n) => n,
            // At least 1, so a prompt that fills the context is refused below for its length,
            // not for a max_tokens of 0 the client never sent.
            None => u32::try_from(room)
                .unwrap_or(u32::MAX)
                .min(self.max_tokens_cap)
                .max(1),
        };
        let mut params = pd_proto::convert::sampling_params(
            req.sampling.as_ref(),
            max_tokens,
            req.stop,
            req.stop_token_ids,
            req.ignore_eos,
            req.include_stop_str_in_output,
            req.skip_special_tokens.unwrap_or(true),
        );
        if !req.bad_words.is_empty() {
            if req.bad_words.len() > MAX_BAD_WORDS {
                return Err(SamplingError::TooManyBadWords(req.bad_words.len()).into());
            }
            let words = bad_words_token_ids(self.model.tokenizer(), &req.bad_words)
                .map_err(|e| ValidationError::Tokenize(e.to_string()))?;
            params.bad_words_token_ids.extend(words);
        }
        params.validate(vocab_size, self.max_tokens_cap)?;
        validate_prompt(&prompt, vocab_size, context_len, max_tokens)
            .map_err(|e| ValidationError::Prompt(engine_message(e)))?;
        Ok(ValidRequest {
            request_id,
            prompt,
            params,
            cache_salt: req.cache_salt,
            tenant: crate::tenant::Tenant::default(),
        })
    }

    /// Raw text to ids (the Tokenize RPC, and text input).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, ValidationError> {
        self.model
            .tokenizer()
            .encode(text)
            .map_err(|e| ValidationError::Tokenize(e.to_string()))
    }

    /// An input's token ids: text tokenized, a chat rendered with the template (generation
    /// prompt added) and tokenized, ids as given (not checked against the vocabulary here).
    pub fn prompt(
        &self,
        input: Option<pb::generate_request::Input>,
    ) -> Result<Vec<u32>, ValidationError> {
        use pb::generate_request::Input;
        match input {
            None => Err(ValidationError::MissingInput),
            Some(Input::Text(text)) => self.tokenize(&text),
            Some(Input::TokenIds(ids)) => Ok(ids.ids),
            Some(Input::Chat(chat)) => {
                if chat.messages.is_empty() {
                    return Err(ValidationError::EmptyConversation);
                }
                let messages = chat
                    .messages
                    .into_iter()
                    .enumerate()
                    .map(|(index, m)| {
                        let role = m.role.parse::<ChatRole>().map_err(|_| {
                            ValidationError::UnknownChatRole {
                                index,
                                role: m.role.clone(),
                            }
                        })?;
                        if m.tool_calls.len() > MAX_TOOL_CALLS {
                            return Err(ValidationError::TooManyToolCalls {
                                index,
                                count: m.tool_calls.len(),
                            });
                        }
                        let tool_calls = m
                            .tool_calls
                            .iter()
                            .enumerate()
                            .map(|(call, json)| {
                                ChatToolCall::from_json(json).map_err(|message| {
                                    ValidationError::BadToolCall {
                                        index,
                                        call,
                                        message,
                                    }
                                })
                            })
                            .collect::<Result<Vec<_>, _>>()?;
                        let mut message = ChatMessage::new(role, m.content);
                        message.tool_calls = tool_calls;
                        Ok(message)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if chat.tools.len() > MAX_CHAT_TOOLS {
                    return Err(ValidationError::TooManyTools(chat.tools.len()));
                }
                let tools = chat
                    .tools
                    .iter()
                    .enumerate()
                    .map(|(index, json)| {
                        ChatTool::from_json(json)
                            .map_err(|message| ValidationError::BadTool { index, message })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let options = ChatTemplateOptions {
                    add_generation_prompt: true,
                    enable_thinking: chat.enable_thinking,
                    tools,
                };
                let text = self
                    .model
                    .tokenizer()
                    .apply_chat_template_with(&messages, &options)
                    .map_err(|e| ValidationError::ChatTemplate(error_chain(&e)))?;
                self.tokenize(&text)
            }
        }
    }
}

/// The engine's message without its `invalid request: ` prefix (the status code says that).
fn engine_message(e: EngineError) -> String {
    match e {
        EngineError::InvalidRequest(message) => message,
        other => other.to_string(),
    }
}

/// An error and its sources on one line (template errors keep the template's own message in
/// the source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let piece = s.to_string();
        if !text.contains(&piece) {
            text.push_str(": ");
            text.push_str(&piece);
        }
        source = s.source();
    }
    text
}
