//! Compiled guides kept per node ([`GuideCache`]): the same specification sent again is
//! not compiled again. Owns the cache and its eviction; not the compiling (`super`).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use super::{Guide, GuideVocabulary, StructuredError, StructuredOutput};

/// Compiled guides a [`GuideCache`] keeps (the least recently used goes first)...
pub(super) const GUIDE_CACHE_ENTRIES: usize = 64;
/// ...and the (state, token) transitions they may hold together, about 16 bytes each: a state
/// inside a JSON string allows nearly every token, 151k transitions for Qwen3. The newest
/// guide stays whatever its size.
const GUIDE_CACHE_TRANSITIONS: usize = 16 << 20;

/// Compiled guides by specification, shared by a node's requests: the same schema sent
/// again is not compiled again. The vocabulary is built on first use (a request without a
/// structured output never pays for it).
pub struct GuideCache {
    vocabulary: OnceLock<Result<GuideVocabulary, StructuredError>>,
    make_vocabulary: Box<dyn Fn() -> Result<GuideVocabulary, StructuredError> + Send + Sync>,
    entries: Mutex<Vec<(StructuredOutput, Arc<Guide>)>>,
}

impl std::fmt::Debug for GuideCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuideCache").finish_non_exhaustive()
    }
}

impl GuideCache {
    /// Guides over `tokenizer`'s ordinary tokens, ended by `eos_token_ids`.
    pub fn new(tokenizer: crate::tokenizer::Tokenizer, eos_token_ids: Vec<u32>) -> Self {
        Self::with_vocabulary(move || GuideVocabulary::from_tokenizer(&tokenizer, &eos_token_ids))
    }

    /// Guides over the vocabulary `make` builds (when the first guide is compiled).
    pub fn with_vocabulary(
        make: impl Fn() -> Result<GuideVocabulary, StructuredError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            vocabulary: OnceLock::new(),
            make_vocabulary: Box::new(make),
            entries: Mutex::new(Vec::new()),
        }
    }

    /// The guide of `spec`, compiled now (blocking: up to seconds for a large schema) or
    /// found.
    pub fn get(&self, spec: &StructuredOutput) -> Result<Arc<Guide>, StructuredError> {
        {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = entries.iter().position(|(s, _)| s == spec) {
                // Most recently used last.
                let entry = entries.remove(i);
                let guide = entry.1.clone();
                entries.push(entry);
                return Ok(guide);
            }
        }
        let vocabulary = self
            .vocabulary
            .get_or_init(|| (self.make_vocabulary)())
            .as_ref()
            .map_err(Clone::clone)?;
        // Not under the lock: other specifications are served meanwhile; two requests
        // compiling the same one at once keep one result.
        let guide = Arc::new(Guide::compile(spec, vocabulary)?);
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if !entries.iter().any(|(s, _)| s == spec) {
            entries.push((spec.clone(), guide.clone()));
            let weight = |entries: &[(StructuredOutput, Arc<Guide>)]| {
                entries.iter().map(|(_, g)| g.transitions).sum::<usize>()
            };
            while entries.len() > 1
                && (entries.len() > GUIDE_CACHE_ENTRIES
                    || weight(&entries) > GUIDE_CACHE_TRANSITIONS)
            {
                entries.remove(0);
            }
        }
        Ok(guide)
    }
}
