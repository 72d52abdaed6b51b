//! The prompt checks every entry point shares, before a request goes anywhere: the
//! router's validation, both nodes' services, `pdctl run` and the engine's own `submit`
//! (which also checks what only the engine knows: ids, the pool, imported KV). Sampling
//! parameters are checked by [`crate::sampling::SamplingParams::validate`].

use crate::error::EngineError;

/// vLLM's `truncate_prompt_tokens`: keep only the last `keep` tokens of `prompt` (left
/// truncation, after any chat template), `keep` in `1..=max_model_len`. A shorter prompt is
/// kept whole.
pub fn truncate_prompt(
    prompt: &mut Vec<u32>,
    keep: u32,
    max_model_len: usize,
) -> Result<(), EngineError> {
    if keep == 0 || keep as usize > max_model_len {
        return Err(EngineError::InvalidRequest(format!(
            "truncate_prompt_tokens must be between 1 and the model's context of \
             {max_model_len} tokens, got {keep}"
        )));
    }
    let excess = prompt.len().saturating_sub(keep as usize);
    prompt.drain(..excess);
    Ok(())
}

/// The prompt checks every entry point shares: non-empty, ids inside the vocabulary, and
/// room in the context for the prompt plus `max_tokens`.
pub fn validate_prompt(
    prompt: &[u32],
    vocab_size: usize,
    max_model_len: usize,
    max_tokens: u32,
) -> Result<(), EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if let Some((i, id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab_size)
    {
        return Err(EngineError::InvalidRequest(format!(
            "token id {id} at position {i} is outside the vocabulary (size {vocab_size})"
        )));
    }
    if prompt.len() >= max_model_len {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {} tokens; the model's context is {max_model_len} tokens",
            prompt.len()
        )));
    }
    if prompt.len() + max_tokens as usize > max_model_len {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {max_model_len} tokens",
            prompt.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_the_last_tokens_within_the_context() {
        let mut p: Vec<u32> = (0..10).collect();
        truncate_prompt(&mut p, 4, 16).unwrap();
        assert_eq!(p, [6, 7, 8, 9]);
        truncate_prompt(&mut p, 16, 16).unwrap();
        assert_eq!(p, [6, 7, 8, 9], "a shorter prompt stays whole");
        for bad in [0, 17] {
            let e = truncate_prompt(&mut p, bad, 16).unwrap_err().to_string();
            assert!(
                e.contains("truncate_prompt_tokens must be between 1 and"),
                "{e}"
            );
        }
    }
}
