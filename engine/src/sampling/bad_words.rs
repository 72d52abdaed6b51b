//! vLLM's `bad_words`: words the model must not produce. Each word becomes token sequences
//! (as written and with a leading space, since a word mid-text is usually tokenized with its
//! space); a sequence of one token bans that token, a longer one bans its last token whenever
//! the output so far ends with the rest. Does not decide where the mask applies (the sampler).

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Most bad words (or token sequences) one request may carry.
pub const MAX_BAD_WORDS: usize = 128;

/// Longest token sequence of one bad word.
pub const MAX_BAD_WORD_TOKENS: usize = 64;

/// The token sequences of `words`: each word with its leading white space removed, as is and
/// after one space, without repeats; an empty word gives none.
pub fn bad_words_token_ids(
    tokenizer: &Tokenizer,
    words: &[String],
) -> Result<Vec<Vec<u32>>, TokenizerError> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for word in words {
        let word = word.trim_start();
        if word.is_empty() {
            continue;
        }
        for text in [word.to_string(), format!(" {word}")] {
            let ids = tokenizer.encode(&text)?;
            if !ids.is_empty() && !out.contains(&ids) {
                out.push(ids);
            }
        }
    }
    Ok(out)
}

/// Sets to `-inf` every token a bad word would complete after `output`.
pub(crate) fn mask_bad_words(logits: &mut [f32], bad_words: &[Vec<u32>], output: &[u32]) {
    for seq in bad_words {
        let Some((&last, prefix)) = seq.split_last() else {
            continue;
        };
        if output.ends_with(prefix)
            && let Some(l) = logits.get_mut(last as usize)
        {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_tokens_are_always_banned_longer_words_only_after_their_prefix() {
        let bad = vec![vec![2], vec![5, 6, 7]];
        let mut l = vec![0.0f32; 8];
        mask_bad_words(&mut l, &bad, &[1, 5]);
        assert_eq!(l[2], f32::NEG_INFINITY);
        assert_eq!(l[7], 0.0, "5 6 is not the tail yet");
        mask_bad_words(&mut l, &bad, &[9, 5, 6]);
        assert_eq!(l[7], f32::NEG_INFINITY);
        // Ids outside the row and empty sequences are ignored.
        mask_bad_words(&mut l, &[vec![], vec![99]], &[]);
    }

    #[test]
    fn words_give_their_plain_and_spaced_tokenizations_once() {
        let tok = Tokenizer::qwen3().unwrap();
        let ids =
            bad_words_token_ids(&tok, &["  hello".into(), "hello".into(), " ".into()]).unwrap();
        assert_eq!(
            ids,
            vec![tok.encode("hello").unwrap(), tok.encode(" hello").unwrap()]
        );
    }
}
