//! The vocabulary as a byte trie, and the token masks of byte-level recognizers read from it.
//!
//! A regex guide lists each state's tokens ahead of time (outlines' index). The JSON
//! grammar's states are unbounded (its stack), so its masks are computed when a state is
//! first met: one walk down the trie, carrying the recognizer's state byte by byte and
//! pruning every subtree whose prefix it refuses, so tokens that share a prefix share its
//! work. A walk visits up to every node (inside a string nearly every token is allowed:
//! milliseconds for Qwen3's 151k tokens), so masks are kept per state ([`Masks`]): a JSON
//! text meets few distinct states, and requests share them. Owns the trie and the mask
//! cache; not the recognizers (`super::json`, `super::free`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// Every ordinary token's bytes, as a trie laid out in depth-first order.
pub(crate) struct TokenTrie {
    /// Per node: the byte on the edge into it...
    bytes: Vec<u8>,
    /// ...its depth (1 for a first byte)...
    depth: Vec<u16>,
    /// ...the index just past its subtree...
    end: Vec<u32>,
    /// ...and where its tokens start in `ids` (one more entry than nodes: node i's tokens
    /// are `ids[ids_at[i]..ids_at[i + 1]]`).
    ids_at: Vec<u32>,
    ids: Vec<u32>,
    /// Each token's bytes by id (`text[spans[id]]`); ids with no ordinary token are empty.
    spans: Vec<(u32, u32)>,
    text: Vec<u8>,
    /// The tokens that stay inside a JSON string, apart (built at the first string state).
    string_split: OnceLock<Box<StringSplit>>,
}

/// The vocabulary split for a state inside a JSON string, between characters: `inside`
/// tokens stay in any such string whatever surrounds it (no closing quote, nothing refused),
/// so every such state allows all of them (nearly the whole vocabulary); only the `edge`
/// tokens (a quote, a backslash, a control or stray UTF-8 byte) depend on the state and are
/// walked.
struct StringSplit {
    inside: Vec<u32>,
    edge: TokenTrie,
}

impl TokenTrie {
    /// From `(id, bytes)` of each token (non-empty bytes).
    pub(crate) fn new(tokens: &[(u32, Vec<u8>)]) -> Self {
        let mut sorted: Vec<&(u32, Vec<u8>)> = tokens.iter().collect();
        sorted.sort_unstable_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)));
        let mut trie = Self {
            bytes: Vec::new(),
            depth: Vec::new(),
            end: Vec::new(),
            ids_at: Vec::new(),
            ids: Vec::with_capacity(sorted.len()),
            spans: Vec::new(),
            text: Vec::new(),
            string_split: OnceLock::new(),
        };
        let mut path: Vec<u8> = Vec::new();
        for (id, bytes) in sorted {
            // Sorted, so a token shares with the previous one exactly the prefix it shares
            // with the trie built so far, and its remaining bytes are new nodes.
            let shared = path.iter().zip(bytes).take_while(|(a, b)| a == b).count();
            path.truncate(shared);
            for (d, &b) in bytes.iter().enumerate().skip(shared) {
                trie.bytes.push(b);
                trie.depth.push(d as u16 + 1);
                trie.ids_at.push(trie.ids.len() as u32);
                path.push(b);
            }
            // A token with the same bytes as the previous one lands on its node.
            trie.ids.push(*id);
            let at = *id as usize;
            if trie.spans.len() <= at {
                trie.spans.resize(at + 1, (0, 0));
            }
            trie.spans[at] = (trie.text.len() as u32, bytes.len() as u32);
            trie.text.extend_from_slice(bytes);
        }
        trie.ids_at.push(trie.ids.len() as u32);
        // A subtree ends at the next node no deeper than its root.
        let nodes = trie.bytes.len();
        trie.end = vec![nodes as u32; nodes];
        let mut open: Vec<usize> = Vec::new();
        for i in 0..nodes {
            while let Some(&j) = open.last() {
                if trie.depth[j] >= trie.depth[i] {
                    trie.end[j] = i as u32;
                    open.pop();
                } else {
                    break;
                }
            }
            open.push(i);
        }
        trie
    }

    /// The bytes of token `id`; empty for an id that is no ordinary token.
    pub(crate) fn spelling(&self, id: u32) -> &[u8] {
        match self.spans.get(id as usize) {
            Some(&(start, len)) => &self.text[start as usize..(start + len) as usize],
            None => &[],
        }
    }

    /// The tokens whose bytes `step` accepts from `start`, where `start` is inside a JSON
    /// string between characters and `stays_inside` says which spellings stay in any such
    /// string: those without a walk, the others walked.
    fn allowed_in_string<S: Copy>(
        &self,
        start: S,
        step: impl Fn(S, u8) -> Option<S>,
        stays_inside: impl Fn(&[u8]) -> bool,
        out: &mut Vec<u32>,
    ) {
        let split = self.string_split.get_or_init(|| {
            let (mut inside, mut edge) = (Vec::new(), Vec::new());
            for &id in &self.ids {
                let spelling = self.spelling(id);
                if stays_inside(spelling) {
                    inside.push(id);
                } else {
                    edge.push((id, spelling.to_vec()));
                }
            }
            Box::new(StringSplit {
                inside,
                edge: TokenTrie::new(&edge),
            })
        });
        split.edge.allowed(start, step, out);
        out.extend_from_slice(&split.inside);
    }

    /// The tokens whose bytes `step` accepts one by one from `start`, in byte order.
    pub(crate) fn allowed<S: Copy>(
        &self,
        start: S,
        step: impl Fn(S, u8) -> Option<S>,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        let mut states = vec![start; 1];
        let mut i = 0;
        while i < self.bytes.len() {
            let depth = self.depth[i] as usize;
            // Depth-first: the last node seen one level up is this node's parent.
            match step(states[depth - 1], self.bytes[i]) {
                Some(next) => {
                    states.truncate(depth);
                    states.push(next);
                    out.extend_from_slice(
                        &self.ids[self.ids_at[i] as usize..self.ids_at[i + 1] as usize],
                    );
                    i += 1;
                }
                None => i = self.end[i] as usize,
            }
        }
    }
}

/// Most token ids the masks of one guide keep together (4 bytes each): about 50 masks of a
/// state inside a string, where nearly all of Qwen3's tokens are allowed. Past it the least
/// recently used masks go.
pub(super) const MASK_CACHE_IDS: usize = 8 << 20;

/// A recognizer's masks over one vocabulary, computed on first use per state `S` and kept.
pub(crate) struct Masks<S> {
    trie: Arc<TokenTrie>,
    cache: Mutex<MaskCache<S>>,
}

struct MaskCache<S> {
    /// Each state's mask and when it was last used (`clock` then).
    masks: HashMap<S, (Arc<[u32]>, u64)>,
    ids: usize,
    budget: usize,
    clock: u64,
}

impl<S: Copy + Eq + std::hash::Hash> Masks<S> {
    pub(crate) fn new(trie: Arc<TokenTrie>) -> Self {
        Self::with_budget(trie, MASK_CACHE_IDS)
    }

    /// Keeping masks of at most `budget` ids together (the newest whatever its size).
    fn with_budget(trie: Arc<TokenTrie>, budget: usize) -> Self {
        Self {
            trie,
            cache: Mutex::new(MaskCache {
                masks: HashMap::new(),
                ids: 0,
                budget,
                clock: 0,
            }),
        }
    }

    pub(crate) fn trie(&self) -> &TokenTrie {
        &self.trie
    }

    /// The ids whose bytes `step` accepts from `state` (not EOS: the caller adds it where
    /// the text is whole). `in_string`: `state` is inside a JSON string between characters,
    /// and `stays_inside` tells the spellings that stay in any such string.
    pub(crate) fn allowed(
        &self,
        state: S,
        step: impl Fn(S, u8) -> Option<S>,
        in_string: Option<fn(&[u8]) -> bool>,
    ) -> Arc<[u32]> {
        {
            let mut cache = self.lock();
            cache.clock += 1;
            let now = cache.clock;
            if let Some((mask, used)) = cache.masks.get_mut(&state) {
                *used = now;
                return mask.clone();
            }
        }
        // Not under the lock: other requests' states are served meanwhile.
        let mut ids = Vec::new();
        match in_string {
            Some(stays_inside) => self
                .trie
                .allowed_in_string(state, step, stays_inside, &mut ids),
            None => self.trie.allowed(state, step, &mut ids),
        }
        let mask: Arc<[u32]> = ids.into();
        let mut cache = self.lock();
        cache.clock += 1;
        let now = cache.clock;
        if let Some((old, _)) = cache.masks.insert(state, (mask.clone(), now)) {
            // Computed twice at once (two requests met the state together): one kept.
            cache.ids -= old.len();
        }
        cache.ids += mask.len();
        while cache.ids > cache.budget && cache.masks.len() > 1 {
            let oldest = cache
                .masks
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(s, _)| *s)
                .expect("more than one mask");
            if let Some((gone, _)) = cache.masks.remove(&oldest) {
                cache.ids -= gone.len();
            }
        }
        mask
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MaskCache<S>> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::super::json::JsonState;
    use super::*;

    fn step(s: JsonState, b: u8) -> Option<JsonState> {
        s.step(b)
    }

    fn tokens(spellings: &[&str]) -> Vec<(u32, Vec<u8>)> {
        spellings
            .iter()
            .enumerate()
            .map(|(i, s)| (i as u32 * 3 + 1, s.as_bytes().to_vec()))
            .collect()
    }

    /// The trie walk lists exactly the tokens whose bytes the grammar accepts one by one.
    #[test]
    fn the_walk_allows_exactly_what_the_grammar_accepts_token_by_token() {
        let vocab = tokens(&[
            "{", "}", "{\"", "\"", "\":", "a", "ab", "abc", "b", " ", "  ", "\n", "1", "12", "1.",
            "-", "true", "tr", "ue", "}}", "}]", "]", "[", ",", ",\"", "\\", "\\u", "e9", "00",
            "é", "\u{e9}\"", "n", "null", "{}", "\":[", "x",
        ]);
        let trie = TokenTrie::new(&vocab);
        let mut states = vec![JsonState::START];
        let mut seen = 0;
        // Walk a few texts and compare the mask at every token boundary.
        for text in [
            vec![
                "{\"", "ab", "\":", "[", "1", ",", "true", ",", "{}", "]", "}",
            ],
            vec!["{", " ", "\"", "\\u", "00", "e9", "\":[", "-", "12", "]}"],
            vec![
                "{", "\"", "é", "\"", ":", "null", ",\"", "x", "\":", "{}", "}",
            ],
        ] {
            let mut state = JsonState::START;
            for piece in text {
                states.push(state);
                let id = vocab.iter().find(|(_, b)| b == piece.as_bytes());
                state = match id {
                    Some((id, _)) => state.walk(trie.spelling(*id)),
                    None => state.walk(piece.as_bytes()),
                }
                .unwrap_or_else(|| panic!("{piece:?} refused"));
            }
            assert!(state.is_complete());
            states.push(state);
        }
        for state in states {
            let mut walked = Vec::new();
            trie.allowed(state, step, &mut walked);
            walked.sort_unstable();
            let mut brute: Vec<u32> = vocab
                .iter()
                .filter(|(_, b)| state.walk(b).is_some())
                .map(|&(id, _)| id)
                .collect();
            brute.sort_unstable();
            assert_eq!(walked, brute, "{state:?}");
            seen += usize::from(!brute.is_empty());
        }
        assert!(seen > 20);
        assert_eq!(trie.spelling(4), b"}");
        assert_eq!(trie.spelling(0), b"");
        assert_eq!(trie.spelling(10_000), b"");
    }

    /// Inside a string, the split (the tokens that stay inside listed whole, the rest
    /// walked) lists what the full walk lists, in keys and values, at any depth.
    #[test]
    fn a_string_state_lists_the_same_tokens_through_the_split() {
        let vocab = tokens(&[
            "a", "ab", "\"", "\":", "\"}", "\"]}", "\"},", "\\", "\\n", "\\u00", "é", "\u{e9}\"",
            "\n", " ", "x\"", "\u{1}", "}", "\"}}}",
        ]);
        let mut spellings = vocab.clone();
        // A character split across two tokens, as byte-level vocabularies do.
        spellings.push((1000, vec![0xC3]));
        spellings.push((1001, vec![0xA9, b'"']));
        let trie = TokenTrie::new(&spellings);
        for prefix in [
            "{\"",
            "{\"k\":\"",
            "{\"k\":[\"",
            "{\"k\":[{\"a\":\"x",
            "{\"k\":[[[{\"",
        ] {
            let state = JsonState::START.walk(prefix.as_bytes()).unwrap();
            assert!(state.in_plain_string(), "{prefix}");
            let (mut full, mut split) = (Vec::new(), Vec::new());
            trie.allowed(state, step, &mut full);
            trie.allowed_in_string(state, step, super::super::json::stays_in_string, &mut split);
            full.sort_unstable();
            split.sort_unstable();
            assert_eq!(full, split, "{prefix}");
            assert!(full.contains(&1000), "{prefix}");
        }
    }

    #[test]
    fn tokens_with_the_same_bytes_are_both_listed() {
        let trie = TokenTrie::new(&[(5, b"{".to_vec()), (2, b"{".to_vec()), (9, b"[".to_vec())]);
        let mut ids = Vec::new();
        trie.allowed(JsonState::START, step, &mut ids);
        assert_eq!(ids, vec![2, 5]);
        let masks = Masks::new(Arc::new(trie));
        let first = masks.allowed(JsonState::START, step, None);
        assert!(Arc::ptr_eq(
            &first,
            &masks.allowed(JsonState::START, step, None)
        ));
    }

    /// Past its budget the cache lets the least recently used masks go, not all of them.
    #[test]
    fn the_least_recently_used_masks_go_first() {
        let trie = Arc::new(TokenTrie::new(&tokens(&[
            "{", "}", "\"", "a", "1", " ", "[",
        ])));
        let states: Vec<JsonState> = ["{", "{\"", "{\"a\":", "{\"a\":[", "{\"a\":1"]
            .iter()
            .map(|t| JsonState::START.walk(t.as_bytes()).unwrap())
            .collect();
        let sizes: Vec<usize> = states
            .iter()
            .map(|&s| Masks::new(trie.clone()).allowed(s, step, None).len())
            .collect();
        // Room for the first three masks, not for a fourth.
        let masks = Masks::with_budget(trie, sizes[..3].iter().sum());
        let kept: Vec<_> = states[..3]
            .iter()
            .map(|&s| masks.allowed(s, step, None))
            .collect();
        // State 0 used again: state 1 is now the least recently used.
        assert!(Arc::ptr_eq(&kept[0], &masks.allowed(states[0], step, None)));
        masks.allowed(states[3], step, None);
        assert!(Arc::ptr_eq(&kept[0], &masks.allowed(states[0], step, None)));
        assert!(Arc::ptr_eq(&kept[2], &masks.allowed(states[2], step, None)));
        assert!(!Arc::ptr_eq(
            &kept[1],
            &masks.allowed(states[1], step, None)
        ));
        assert!(masks.lock().ids <= sizes[..3].iter().sum::<usize>());
    }
}
