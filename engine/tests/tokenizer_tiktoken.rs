//! The built-in Qwen3 tokenizer against tiktoken.
//!
//! `fixtures/tokenizer_corpus.jsonl` holds strings with the ids tiktoken gives them (Qwen's
//! ranks, Qwen2's split regex, Qwen3's added tokens allowed, text in NFC). It is written by
//! `tools/tokenizer/verify_against_tiktoken.py --write-fixture`, which also checks a much
//! larger corpus in Python.

use pd_engine::tokenizer::{Tokenizer, TokenizerError};

const RANKS: usize = 151_643;
const ADDED: [&str; 26] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];
/// Rows of Qwen3's embedding (config.json `vocab_size`); the ids past the tokens are padding.
const MODEL_VOCAB: u32 = 151_936;

struct Line {
    category: String,
    text: String,
    ids: Vec<u32>,
    /// The text after NFC, when that differs (what decoding gives back).
    nfc: Option<String>,
}

fn fixture() -> Vec<Line> {
    load_jsonl(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer_corpus.jsonl"
    ))
}

fn load_jsonl(path: &str) -> Vec<Line> {
    let data = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    data.lines()
        .enumerate()
        .map(|(i, line)| {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{path}:{}: {e}", i + 1));
            Line {
                category: v["category"].as_str().unwrap().to_string(),
                text: v["text"].as_str().unwrap().to_string(),
                ids: v["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
                    .collect(),
                nfc: v.get("nfc").and_then(|s| s.as_str()).map(str::to_string),
            }
        })
        .collect()
}

/// Lines whose ids differ from tiktoken's, described for a failure message.
fn mismatches(tok: &Tokenizer, lines: &[Line]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|line| {
            let ids = tok.encode(&line.text).unwrap();
            (ids != line.ids).then(|| {
                format!(
                    "[{}] {:?}\n  tiktoken: {:?}\n  ours:     {:?}",
                    line.category, line.text, line.ids, ids
                )
            })
        })
        .collect()
}

fn qwen3() -> Tokenizer {
    Tokenizer::qwen3().expect("the built-in tokenizer loads")
}

/// A small deterministic generator (xorshift64) for id sequences.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % u64::from(n)) as u32
    }
}

#[test]
fn encode_matches_tiktoken_on_the_fixture() {
    let tok = qwen3();
    let lines = fixture();
    assert!(lines.len() >= 300, "fixture has {} lines", lines.len());
    let tokens: usize = lines.iter().map(|l| l.ids.len()).sum();
    assert!(tokens > 10_000, "fixture covers only {tokens} tokens");
    let bad = mismatches(&tok, &lines);
    assert!(
        bad.is_empty(),
        "{} of {} lines differ from tiktoken:\n{}",
        bad.len(),
        lines.len(),
        bad[..bad.len().min(10)].join("\n")
    );
}

/// The whole generated corpus (~19,000 strings) that `PD_TOKENIZER_CORPUS` points at: the
/// output of `verify_against_tiktoken.py --write-corpus PATH`.
#[test]
#[ignore = "needs the generated corpus PD_TOKENIZER_CORPUS names: scripts/test.sh writes it and runs this"]
fn encode_matches_tiktoken_on_the_full_generated_corpus() {
    let path = std::env::var_os("PD_TOKENIZER_CORPUS")
        .expect("PD_TOKENIZER_CORPUS names the corpus verify_against_tiktoken.py wrote");
    let tok = qwen3();
    let lines = load_jsonl(path.to_str().expect("UTF-8 path"));
    let bad = mismatches(&tok, &lines);
    let tokens: usize = lines.iter().map(|l| l.ids.len()).sum();
    eprintln!(
        "full corpus: {} strings, {tokens} tokens, {} mismatches",
        lines.len(),
        bad.len()
    );
    assert!(bad.is_empty(), "{}", bad[..bad.len().min(10)].join("\n"));
    for line in &lines {
        let expected = line.nfc.as_deref().unwrap_or(&line.text);
        assert_eq!(tok.decode(&line.ids, false).unwrap(), expected);
    }
}

#[test]
fn decode_round_trips_the_fixture() {
    let tok = qwen3();
    for line in fixture() {
        let expected = line.nfc.as_deref().unwrap_or(&line.text);
        assert_eq!(
            tok.decode(&line.ids, false).unwrap(),
            expected,
            "[{}] {:?}",
            line.category,
            line.text
        );
        // Skipping special tokens drops exactly the special added tokens' text.
        let mut without = expected.to_string();
        for special in &ADDED[..14] {
            without = without.replace(special, "");
        }
        assert_eq!(tok.decode(&line.ids, true).unwrap(), without);
    }
}

#[test]
fn incremental_decoding_concatenates_to_decode() {
    let tok = qwen3();
    let check = |ids: &[u32], skip: bool| {
        let mut dec = tok.incremental_decoder(skip);
        let mut text = String::new();
        for &id in ids {
            text.push_str(&dec.push(id).unwrap());
        }
        text.push_str(&dec.finish().unwrap());
        assert_eq!(text, tok.decode(ids, skip).unwrap(), "ids {ids:?}");
    };
    for line in fixture() {
        check(&line.ids, false);
        check(&line.ids, true);
    }
    // Random ids: byte-level pieces that split characters, invalid UTF-8, special tokens.
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let vocab = tok.vocab_size() as u32;
    for _ in 0..2_000 {
        let len = 1 + rng.below(24) as usize;
        let ids: Vec<u32> = (0..len).map(|_| rng.below(vocab)).collect();
        check(&ids, false);
        check(&ids, true);
    }
    // Only single-byte tokens (the first 256 ranks are the 256 bytes), and ids around them.
    for _ in 0..4_000 {
        let len = 1 + rng.below(12) as usize;
        let ids: Vec<u32> = (0..len).map(|_| rng.below(256)).collect();
        check(&ids, false);
        let ids: Vec<u32> = (0..len).map(|_| rng.below(1_000)).collect();
        check(&ids, false);
    }
}

#[test]
fn incremental_decoding_holds_back_partial_characters() {
    let tok = qwen3();
    // A character whose UTF-8 bytes are split over several tokens.
    let text = "\u{1F9D1}\u{200D}\u{1F680} \u{10FFFD}";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() > 3, "expected byte-level pieces, got {ids:?}");
    let mut dec = tok.incremental_decoder(false);
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "emitted a partial character");
        out.push_str(&piece);
    }
    assert_eq!(dec.finish().unwrap(), "");
    assert_eq!(out, text);

    // A stream cut in the middle of a character: finish() gives U+FFFD, like decode().
    let cut = &ids[..ids.len() - 1];
    let mut dec = tok.incremental_decoder(false);
    let mut out = String::new();
    for &id in cut {
        out.push_str(&dec.push(id).unwrap());
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, tok.decode(cut, false).unwrap());
    assert!(out.ends_with('\u{FFFD}'));
}

#[test]
fn vocabulary_counts_and_added_tokens() {
    let tok = qwen3();
    assert_eq!(tok.vocab_size(), RANKS + ADDED.len());
    assert_eq!(tok.vocab_size(), 151_669);
    for (i, token) in ADDED.iter().enumerate() {
        let id = (RANKS + i) as u32;
        assert_eq!(tok.token_id(token), Some(id), "{token}");
        assert_eq!(tok.encode(token).unwrap(), vec![id], "{token}");
        assert_eq!(tok.decode(&[id], false).unwrap(), *token);
        // Qwen3 marks 151643..=151656 special; tool, FIM and think markers are not.
        let special = i < 14;
        let skipped = tok.decode(&[id], true).unwrap();
        assert_eq!(
            skipped.is_empty(),
            special,
            "{token}: special should be {special}"
        );
    }
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.token_id("Ġthe"), Some(279));
    assert_eq!(tok.token_id("<|not_a_token|>"), None);

    // Every id below the vocabulary decodes; the model's padding ids are not tokens.
    let all: Vec<u32> = (0..tok.vocab_size() as u32).collect();
    tok.decode(&all, false).unwrap();
    for id in [
        tok.vocab_size() as u32,
        151_700,
        MODEL_VOCAB - 1,
        MODEL_VOCAB,
        u32::MAX,
    ] {
        match tok.decode(&[1, id], false) {
            Err(TokenizerError::UnknownTokenId {
                id: bad,
                vocab_size,
            }) => {
                assert_eq!((bad, vocab_size), (id, 151_669));
            }
            other => panic!("id {id}: expected UnknownTokenId, got {other:?}"),
        }
        assert!(tok.incremental_decoder(false).push(id).is_err());
    }
}

#[test]
fn special_tokens_in_text_are_recognised() {
    let tok = qwen3();
    let ids = tok
        .encode("<|im_start|>user\nHi<|im_end|>\n<think>\n\n</think>\n\n")
        .unwrap();
    assert_eq!(ids.first(), Some(&151_644));
    assert!(ids.contains(&151_645));
    assert!(ids.contains(&151_667));
    assert!(ids.contains(&151_668));
    // Near misses stay plain text.
    let ids = tok.encode("<|im_start").unwrap();
    assert!(ids.iter().all(|&id| id < RANKS as u32));
}

#[test]
fn the_built_in_tokenizer_is_shared_and_thread_safe() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Tokenizer>();
    let a = qwen3();
    let debug = format!("{a:?}");
    assert!(debug.len() < 300, "Debug output should stay short: {debug}");
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let tok = a.clone();
            std::thread::spawn(move || tok.encode(&format!("thread {i} says hello")).unwrap())
        })
        .collect();
    for h in handles {
        assert!(!h.join().unwrap().is_empty());
    }
}
