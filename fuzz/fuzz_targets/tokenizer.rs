//! The Qwen3 tokenizer on arbitrary bytes: as text to encode (invalid UTF-8 read lossily, as
//! a request's text never is, so the text path sees every character), and as ids to decode.
//!
//! Properties: nothing panics; every id encoding gives lies inside the vocabulary; decoding
//! the ids gives back the text (after NFC, the tokenizer's normalizer: byte-level BPE loses
//! nothing else), also with special tokens written in the text; the incremental decoder,
//! fed any ids one at a time, gives exactly what `decode` gives; an id outside the vocabulary
//! is the typed `UnknownTokenId`.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pd_engine::tokenizer::{Tokenizer, TokenizerError};
use unicode_normalization::UnicodeNormalization;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::qwen3().expect("the embedded Qwen3 tokenizer"))
}

fuzz_target!(|data: &[u8]| {
    let t = tokenizer();
    let text = String::from_utf8_lossy(data);
    let ids = t.encode(&text).expect("any text encodes");
    assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
    let back = t.decode(&ids, false).expect("encoded ids decode");
    assert_eq!(
        back,
        text.nfc().collect::<String>(),
        "decode(encode(text)) is the NFC text"
    );

    // The bytes as ids: three bytes each, so most land inside the vocabulary.
    let ids: Vec<u32> = data
        .chunks_exact(3)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2] & 0x03, 0]))
        .collect();
    for skip in [false, true] {
        let whole = t.decode(&ids, skip);
        let mut incremental = t.incremental_decoder(skip);
        let mut pieces = String::new();
        let mut failed = None;
        for &id in &ids {
            match incremental.push(id) {
                Ok(piece) => pieces.push_str(&piece),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        match (whole, failed) {
            (Ok(whole), None) => {
                pieces.push_str(&incremental.finish().expect("finish"));
                assert_eq!(pieces, whole, "incremental decoding is decode");
            }
            (Err(a), Some(b)) => {
                assert!(matches!(a, TokenizerError::UnknownTokenId { .. }), "{a:?}");
                assert!(matches!(b, TokenizerError::UnknownTokenId { .. }), "{b:?}");
                assert_eq!(a.to_string(), b.to_string(), "the same unknown id");
            }
            (a, b) => panic!("decode {a:?} and the incremental decoder {b:?} disagree"),
        }
    }
});
