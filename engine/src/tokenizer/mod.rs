//! Text <-> token ids for Qwen3, and chat templates.
//!
//! The built-in tokenizer is Qwen's byte-level BPE (151,643 ranks, shared by Qwen2, Qwen2.5
//! and Qwen3) plus Qwen3's 26 added tokens (ids 151,643..=151,668), converted from the
//! tiktoken ranks by `tools/tokenizer/convert_qwen_tiktoken.py` into
//! `assets/qwen3/tokenizer.json` and `tokenizer_config.json`, which are compiled into the
//! crate. `tools/tokenizer/verify_against_tiktoken.py` checks the conversion against tiktoken;
//! `engine/tests/tokenizer_tiktoken.rs` checks this module against the same reference.
//!
//! The model's embedding has 151,936 rows; ids 151,669..151,935 are padding, not tokens, and
//! decoding them is an error.
//!
//! Decoding is byte-level: every token stands for a fixed byte string (the byte-level alphabet
//! mapped back to bytes for vocabulary entries, the UTF-8 content for added tokens), and the
//! text is the lossy UTF-8 reading of the concatenated bytes, exactly as Hugging Face's
//! ByteLevel decoder produces it. [`IncrementalDecoder`] emits the same text piece by piece.

mod chat;
mod config;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

pub use chat::{
    ChatMessage, ChatRole, ChatTemplateOptions, ChatTool, ChatToolCall, MAX_CHAT_TOOLS,
    MAX_TOOL_CALLS,
};
use chat::{ChatTemplate, TemplateOrigin};
use config::TokenizerConfig;

/// The converted Qwen3 `tokenizer.json` (also written into synthetic model directories).
pub const QWEN3_TOKENIZER_JSON: &str = include_str!("../../../assets/qwen3/tokenizer.json");
/// The Qwen3 `tokenizer_config.json` that goes with [`QWEN3_TOKENIZER_JSON`].
pub const QWEN3_TOKENIZER_CONFIG_JSON: &str =
    include_str!("../../../assets/qwen3/tokenizer_config.json");

/// How the built-in files are named in error messages.
const BUILT_IN_TOKENIZER_JSON: &str = "<built-in>/assets/qwen3/tokenizer.json";
const BUILT_IN_TOKENIZER_CONFIG_JSON: &str = "<built-in>/assets/qwen3/tokenizer_config.json";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can go wrong loading a tokenizer or using it. Each variant names the file,
/// field or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a valid tokenizer.json: {source}", .path.display())]
    TokenizerJson {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    #[error("{}: not valid JSON: {source}", .path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: field `{field}`: {message}", .path.display())]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error(
        "{}: decoder is {found}; only byte-level BPE tokenizers (decoder `ByteLevel`, as in \
         Qwen2/Qwen2.5/Qwen3) are supported",
        .path.display()
    )]
    UnsupportedDecoder { path: PathBuf, found: String },
    #[error("cannot encode text: {source}")]
    Encode {
        #[source]
        source: BoxError,
    },
    #[error("token id {id} is not a token (the vocabulary has {vocab_size} ids)")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("unknown chat role `{role}` (expected one of: system, user, assistant, tool)")]
    UnknownChatRole { role: String },
    #[error("{origin}: syntax error: {source}")]
    ChatTemplateSyntax {
        origin: String,
        #[source]
        source: minijinja::Error,
    },
    #[error("{origin}: rendering failed: {source}")]
    ChatTemplateRender {
        origin: String,
        #[source]
        source: minijinja::Error,
    },
}

/// A loaded tokenizer: encoding, decoding and chat templates. Cheap to clone (shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

/// Short on purpose: the vocabulary has 151k entries.
impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.vocab_size)
            .field("eos_token_id", &self.inner.eos_token_id)
            .field("chat_template", &self.inner.chat)
            .finish_non_exhaustive()
    }
}

struct Inner {
    hf: tokenizers::Tokenizer,
    /// Byte string and `special` flag of every id below `table.len()`; `None` for holes.
    table: Vec<Option<TokenBytes>>,
    vocab_size: usize,
    eos_token_id: Option<u32>,
    chat: ChatTemplate,
}

struct TokenBytes {
    bytes: Box<[u8]>,
    /// A special added token: dropped by `skip_special_tokens`.
    special: bool,
}

impl Tokenizer {
    /// The embedded Qwen3 tokenizer. Parsed once per process; later calls share it.
    pub fn qwen3() -> Result<Self, TokenizerError> {
        static QWEN3: OnceLock<Tokenizer> = OnceLock::new();
        if let Some(tok) = QWEN3.get() {
            return Ok(tok.clone());
        }
        let tok = Self::from_parts(
            Path::new(BUILT_IN_TOKENIZER_JSON),
            QWEN3_TOKENIZER_JSON.as_bytes(),
            Some((
                Path::new(BUILT_IN_TOKENIZER_CONFIG_JSON),
                QWEN3_TOKENIZER_CONFIG_JSON.as_bytes(),
            )),
            None,
        )?;
        Ok(QWEN3.get_or_init(|| tok).clone())
    }

    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` from a model
    /// directory. The chat template is taken from `chat_template.jinja` if the directory has
    /// one (newer transformers versions save it there), else from the config's
    /// `chat_template` (a string, or a list of named templates of which `default` is used),
    /// else the built-in Qwen3 template is used.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer_json = read(&tokenizer_path)?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read(&config_path)?)
        } else {
            None
        };
        let template_path = dir.join("chat_template.jinja");
        let template_file = if template_path.is_file() {
            let bytes = read(&template_path)?;
            let text = String::from_utf8(bytes).map_err(|e| TokenizerError::Io {
                path: template_path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            })?;
            Some((template_path, text))
        } else {
            None
        };
        Self::from_parts(
            &tokenizer_path,
            &tokenizer_json,
            config.as_deref().map(|c| (config_path.as_path(), c)),
            template_file,
        )
    }

    fn from_parts(
        tokenizer_path: &Path,
        tokenizer_json: &[u8],
        config: Option<(&Path, &[u8])>,
        template_file: Option<(PathBuf, String)>,
    ) -> Result<Self, TokenizerError> {
        let mut hf = tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|source| {
            TokenizerError::TokenizerJson {
                path: tokenizer_path.to_path_buf(),
                source,
            }
        })?;
        // `encode` is raw text to ids: no truncation, no padding, whatever the file says.
        hf.with_truncation(None)
            .map_err(|source| TokenizerError::TokenizerJson {
                path: tokenizer_path.to_path_buf(),
                source,
            })?;
        hf.with_padding(None);
        match hf.get_decoder() {
            Some(tokenizers::DecoderWrapper::ByteLevel(_)) => {}
            other => {
                return Err(TokenizerError::UnsupportedDecoder {
                    path: tokenizer_path.to_path_buf(),
                    found: match other {
                        None => "missing".to_string(),
                        Some(d) => format!("`{}`", decoder_name(d)),
                    },
                });
            }
        }
        let table = byte_table(&hf);
        let vocab_size = hf.get_vocab_size(true);

        let config = match config {
            Some((path, bytes)) => Some(TokenizerConfig::parse(path, bytes)?),
            None => None,
        };
        let special = config
            .as_ref()
            .map(|c| c.special.clone())
            .unwrap_or_default();
        let eos_token_id = match (&config, &special.eos_token) {
            (Some(config), Some(eos)) => {
                Some(hf.token_to_id(eos).ok_or_else(|| TokenizerError::Config {
                    path: config.path.clone(),
                    field: "eos_token".to_string(),
                    message: format!("`{eos}` is not a token of {}", tokenizer_path.display()),
                })?)
            }
            _ => None,
        };
        let (source, origin) = match (template_file, config.and_then(|c| c.chat_template)) {
            (Some((path, text)), _) => (text, TemplateOrigin::File(path)),
            (None, Some((path, text))) => (text, TemplateOrigin::File(path)),
            (None, None) => (built_in_chat_template()?, TemplateOrigin::BuiltIn),
        };
        let chat = ChatTemplate::compile(source, origin, special)?;
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                hf,
                table,
                vocab_size,
                eos_token_id,
                chat,
            }),
        })
    }

    /// Number of token ids, added tokens included (151,669 for Qwen3).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// Raw text to ids: nothing is added, and added tokens written in the text (such as
    /// `<|im_start|>`) are recognised, like tiktoken with `allowed_special="all"`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .hf
            .encode_fast(text, false)
            .map_err(|source| TokenizerError::Encode { source })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids to text. Byte sequences that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let token = self.token_bytes(id)?;
            if !(skip_special_tokens && token.special) {
                bytes.extend_from_slice(&token.bytes);
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The id of a token written as it appears in the vocabulary (byte-level alphabet for
    /// BPE entries, e.g. `"Ġthe"`; plain text for added tokens, e.g. `"<|im_end|>"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.hf.token_to_id(token)
    }

    /// The bytes a token id stands for (special tokens' text included); `None` for an id
    /// outside the table. Exact where `decode` of one id would show U+FFFD for a piece of a
    /// UTF-8 character (logprobs' `bytes`).
    pub fn bytes_of(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes(id).ok().map(|t| &t.bytes[..])
    }

    /// Every id that is not a special token, with its bytes (what a structured output's
    /// guide may spell text with).
    pub fn ordinary_tokens(&self) -> impl Iterator<Item = (u32, &[u8])> {
        self.inner
            .table
            .iter()
            .enumerate()
            .filter_map(|(id, token)| match token {
                Some(t) if !t.special => Some((id as u32, &t.bytes[..])),
                _ => None,
            })
    }

    /// The id of the config's `eos_token` (`<|im_end|>` for Qwen3); `None` without a config
    /// or without that field.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.inner.eos_token_id
    }

    /// Renders a conversation with the chat template, leaving `enable_thinking` undefined.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(
            messages,
            &ChatTemplateOptions {
                add_generation_prompt,
                ..ChatTemplateOptions::default()
            },
        )
    }

    /// Renders a conversation with the chat template and the given template variables.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        options: &ChatTemplateOptions,
    ) -> Result<String, TokenizerError> {
        self.inner.chat.render(messages, options)
    }

    /// A decoder that turns ids into text one id at a time.
    pub fn incremental_decoder(&self, skip_special_tokens: bool) -> IncrementalDecoder<'_> {
        IncrementalDecoder {
            tokenizer: self,
            skip_special_tokens,
            pending: Vec::new(),
        }
    }

    fn token_bytes(&self, id: u32) -> Result<&TokenBytes, TokenizerError> {
        self.inner
            .table
            .get(id as usize)
            .and_then(Option::as_ref)
            .ok_or(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.inner.vocab_size,
            })
    }
}

/// Incremental detokenizer: feed ids one at a time and get the text they complete.
///
/// Bytes that do not yet form a complete UTF-8 character are held back until a later token
/// completes them (a character may span several byte-level tokens). Invalid sequences become
/// U+FFFD as soon as they are known to be invalid. The concatenation of every `push` result
/// and the final `finish` equals `decode` of all the ids.
#[derive(Debug)]
pub struct IncrementalDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    pending: Vec<u8>,
}

impl IncrementalDecoder<'_> {
    /// Adds one id; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let token = self.tokenizer.token_bytes(id)?;
        if self.skip_special_tokens && token.special {
            return Ok(String::new());
        }
        self.pending.extend_from_slice(&token.bytes);
        Ok(self.take_complete())
    }

    /// Ends the stream: returns whatever is still held back (an incomplete UTF-8 sequence
    /// becomes U+FFFD). The decoder can be reused afterwards.
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Ok(rest)
    }

    /// Everything in `pending` up to a trailing incomplete UTF-8 sequence, read as
    /// `String::from_utf8_lossy` would read it.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(text) => {
                    out.push_str(text);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid])
                            .expect("prefix reported valid"),
                    );
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + bad;
                        }
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

/// The chat template of the built-in `tokenizer_config.json` (the single copy of it).
fn built_in_chat_template() -> Result<String, TokenizerError> {
    let path = Path::new(BUILT_IN_TOKENIZER_CONFIG_JSON);
    TokenizerConfig::parse(path, QWEN3_TOKENIZER_CONFIG_JSON.as_bytes())?
        .chat_template
        .map(|(_, t)| t)
        .ok_or_else(|| TokenizerError::Config {
            path: path.to_path_buf(),
            field: "chat_template".to_string(),
            message: "missing".to_string(),
        })
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizerError> {
    std::fs::read(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn decoder_name(decoder: &tokenizers::DecoderWrapper) -> &'static str {
    use tokenizers::DecoderWrapper as D;
    match decoder {
        D::BPE(_) => "BPEDecoder",
        D::ByteLevel(_) => "ByteLevel",
        D::WordPiece(_) => "WordPiece",
        D::Metaspace(_) => "Metaspace",
        D::CTC(_) => "CTC",
        D::Sequence(_) => "Sequence",
        D::Replace(_) => "Replace",
        D::Fuse(_) => "Fuse",
        D::Strip(_) => "Strip",
        D::ByteFallback(_) => "ByteFallback",
    }
}

/// The byte-level alphabet: byte `b` is written as `BYTE_LEVEL_CHARS[b]`. Printable Latin-1
/// bytes stand for themselves; the other 68 bytes take U+0100.. in byte order.
fn byte_level_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        chars[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("below the surrogate range");
            next += 1;
            c
        };
    }
    chars
}

/// Every id's byte string, as the ByteLevel decoder turns it back into bytes: a token made
/// only of byte-level characters maps character by character, anything else (added tokens)
/// stands for its own UTF-8.
fn byte_table(hf: &tokenizers::Tokenizer) -> Vec<Option<TokenBytes>> {
    let chars = byte_level_chars();
    let mut char_to_byte = [None::<u8>; 0x144];
    for (b, c) in chars.iter().enumerate() {
        char_to_byte[*c as usize] = Some(b as u8);
    }
    let added = hf.get_added_vocabulary();
    let max_model_id = hf
        .get_vocab(false)
        .values()
        .copied()
        .max()
        .map_or(0, |m| m as usize + 1);
    let max_added_id = hf
        .get_added_tokens_decoder()
        .keys()
        .copied()
        .max()
        .map_or(0, |m| m as usize + 1);
    (0..max_model_id.max(max_added_id))
        .map(|id| {
            let token = hf.id_to_token(id as u32)?;
            let mapped: Option<Vec<u8>> = token
                .chars()
                .map(|c| char_to_byte.get(c as usize).copied().flatten())
                .collect();
            let bytes = mapped.unwrap_or_else(|| token.as_bytes().to_vec());
            Some(TokenBytes {
                bytes: bytes.into_boxed_slice(),
                special: added.is_special_token(&token),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_a_bijection_onto_known_chars() {
        let chars = byte_level_chars();
        let mut seen = std::collections::HashSet::new();
        for c in chars {
            assert!(seen.insert(c));
            assert!((c as u32) < 0x144);
        }
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[b'a' as usize], 'a');
    }

    #[test]
    fn decode_matches_hugging_face_decode() {
        let tok = Tokenizer::qwen3().unwrap();
        let hf = &tok.inner.hf;
        let texts = [
            "Hello, world! 你好 👨‍👩‍👧‍👦 <|im_start|>user\nhi<|im_end|>\n<think>x</think>",
            "tabs\tand\r\nCRLF  spaces",
        ];
        for text in texts {
            let ids = tok.encode(text).unwrap();
            for skip in [false, true] {
                assert_eq!(
                    tok.decode(&ids, skip).unwrap(),
                    hf.decode(&ids, skip).unwrap()
                );
            }
        }
        // Arbitrary id runs, including ones that split characters.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..200 {
            let ids: Vec<u32> = (0..16)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % tok.vocab_size() as u64) as u32
                })
                .collect();
            for skip in [false, true] {
                assert_eq!(
                    tok.decode(&ids, skip).unwrap(),
                    hf.decode(&ids, skip).unwrap()
                );
            }
        }
    }
}
