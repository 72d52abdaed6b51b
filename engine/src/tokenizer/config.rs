//! `tokenizer_config.json`: the special-token names and the chat template (a string, or the
//! template named `default` of a list), validated with errors naming the file and field.
//! What the tokenizer does with them is mod.rs's and chat.rs's.

use std::path::{Path, PathBuf};

use super::TokenizerError;
use super::chat::SpecialTokenNames;

/// The parts of `tokenizer_config.json` this module uses.
pub(super) struct TokenizerConfig {
    pub(super) path: PathBuf,
    pub(super) special: SpecialTokenNames,
    pub(super) chat_template: Option<(PathBuf, String)>,
}

impl TokenizerConfig {
    pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Self, TokenizerError> {
        let json: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|source| TokenizerError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let config_error = |field: &str, message: &str| TokenizerError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            message: message.to_string(),
        };
        if !json.is_object() {
            return Err(config_error("(root)", "expected a JSON object"));
        }
        // A special token is a string, or an AddedToken object with `content`.
        let token_field = |field: &str| -> Result<Option<String>, TokenizerError> {
            match json.get(field) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(obj @ serde_json::Value::Object(_)) => match obj.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(config_error(field, "object without a string `content`")),
                },
                Some(_) => Err(config_error(field, "expected a string, an object or null")),
            }
        };
        let special = SpecialTokenNames {
            bos_token: token_field("bos_token")?,
            eos_token: token_field("eos_token")?,
            pad_token: token_field("pad_token")?,
        };
        let chat_template = match json.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => {
                let default = named
                    .iter()
                    .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"));
                match default {
                    Some(t) => match t.get("template") {
                        Some(serde_json::Value::String(s)) => Some(s.clone()),
                        _ => {
                            return Err(config_error(
                                "chat_template",
                                "template named `default` has no string `template`",
                            ));
                        }
                    },
                    None => {
                        return Err(config_error(
                            "chat_template",
                            "a list of named templates without one named `default`",
                        ));
                    }
                }
            }
            Some(_) => {
                return Err(config_error(
                    "chat_template",
                    "expected a string or a list of {name, template} objects",
                ));
            }
        };
        Ok(TokenizerConfig {
            path: path.to_path_buf(),
            special,
            chat_template: chat_template.map(|t| (path.to_path_buf(), t)),
        })
    }
}
