//! The vocabulary guides are compiled over: a tokenizer's ordinary tokens, for outlines'
//! index and as the trie the grammars' masks are read from, and the ids that end a sequence.
//! Owns building them once per node; not the guides.

use std::sync::Arc;

use outlines_core::vocabulary::Vocabulary;

use super::StructuredError;
use super::trie::TokenTrie;

/// A tokenizer's vocabulary as guides see it: every ordinary token's bytes (special tokens
/// are never part of a structured output), and the ids that end a sequence.
pub struct GuideVocabulary {
    pub(super) vocabulary: Vocabulary,
    /// The same tokens as a trie, for the JSON grammar's and the grammars' masks.
    pub(super) trie: Arc<TokenTrie>,
    pub(super) eos_token_ids: Vec<u32>,
}

impl GuideVocabulary {
    /// From `(id, bytes)` of each ordinary token and the model's EOS ids (at least one).
    pub fn new<'a>(
        tokens: impl IntoIterator<Item = (u32, &'a [u8])>,
        eos_token_ids: &[u32],
    ) -> Result<Self, StructuredError> {
        let &first_eos = eos_token_ids.first().ok_or_else(|| {
            StructuredError::Vocabulary("the model has no EOS token to end a match".into())
        })?;
        let mut vocabulary = Vocabulary::new(first_eos);
        let mut spellings = Vec::new();
        for (id, bytes) in tokens {
            if !bytes.is_empty() && !eos_token_ids.contains(&id) {
                vocabulary
                    .try_insert(bytes.to_vec(), id)
                    .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
                spellings.push((id, bytes.to_vec()));
            }
        }
        // Each once, the index's own EOS id first (`Guide::allowed` relies on it).
        let mut unique = Vec::with_capacity(eos_token_ids.len());
        for &id in eos_token_ids {
            if !unique.contains(&id) {
                unique.push(id);
            }
        }
        let eos_token_ids = unique;
        Ok(Self {
            vocabulary,
            trie: Arc::new(TokenTrie::new(&spellings)),
            eos_token_ids,
        })
    }

    /// A tokenizer's ordinary tokens, ended by the model's EOS ids.
    pub fn from_tokenizer(
        tokenizer: &crate::tokenizer::Tokenizer,
        eos_token_ids: &[u32],
    ) -> Result<Self, StructuredError> {
        Self::new(tokenizer.ordinary_tokens(), eos_token_ids)
    }
}
