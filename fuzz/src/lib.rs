//! What the fuzz targets share: the router's validator over the real Qwen3 tokenizer (a
//! `synthetic:tiny` model: metadata only, no weights), the invariants every validated request
//! must hold, and a guide walk for the structured-output targets.

use std::sync::{Arc, OnceLock};

use pd_engine::sampling::structured::{Guide, GuideState, GuideVocabulary, StructuredOutput};
use pd_router::validation::{
    ModelMeta, ValidRequest, ValidationError, Validator, check_request_id,
};

/// The context length requests are validated against (the tiny preset's own).
pub const CONTEXT: usize = 4096;
/// `--max-tokens-cap` of the fuzzed router.
pub const MAX_TOKENS_CAP: u32 = 1024;
/// The id the router makes when a request carries none.
pub const NEW_ID: &str = "fuzz-generated-id";

/// The router's validator, built once per process.
pub fn validator() -> &'static Validator {
    static V: OnceLock<Validator> = OnceLock::new();
    V.get_or_init(|| {
        let meta = ModelMeta::load("synthetic:tiny").expect("the synthetic model's metadata");
        Validator::new(Arc::new(meta), MAX_TOKENS_CAP)
    })
}

/// Checks what a validated request promises the rest of the router and the nodes.
pub fn check_valid(v: &Validator, req: &ValidRequest) {
    let vocab = v.model().vocab_size();
    assert!(!req.prompt.is_empty(), "a valid prompt is never empty");
    assert!(
        req.prompt.iter().all(|&id| (id as usize) < vocab),
        "a valid prompt's ids lie inside the vocabulary"
    );
    let max_tokens = req.params.max_tokens;
    assert!(
        (1..=MAX_TOKENS_CAP).contains(&max_tokens),
        "max_tokens {max_tokens} outside 1..=cap"
    );
    assert!(
        req.prompt.len() + max_tokens as usize <= CONTEXT,
        "prompt {} + max_tokens {max_tokens} exceed the context",
        req.prompt.len()
    );
    assert!(check_request_id(&req.request_id).is_ok() || req.request_id == NEW_ID);
    // Validation is idempotent: what passed once passes again.
    req.params
        .validate(vocab, MAX_TOKENS_CAP)
        .expect("validated sampling parameters validate again");
    let p = &req.params;
    assert!(p.temperature.is_finite() && p.temperature >= 0.0);
    assert!(p.top_p > 0.0 && p.top_p <= 1.0, "top_p {}", p.top_p);
    assert!(p.min_p.is_finite() && (0.0..=1.0).contains(&p.min_p));
    assert!(p.min_tokens <= p.max_tokens);
    if let Some(so) = &p.structured_output {
        so.validate()
            .expect("a validated structured output validates");
    }
    assert!(p.allowed_token_ids.iter().all(|&id| (id as usize) < vocab));
    assert!(
        p.logit_bias
            .iter()
            .all(|&(id, b)| (id as usize) < vocab && b.is_finite())
    );
}

/// A refusal: a message a client can act on, and INVALID_ARGUMENT on the wire.
pub fn check_refusal(e: ValidationError) {
    assert!(!e.to_string().is_empty(), "a refusal says why");
    let status = tonic::Status::from(e);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
}

/// The multi-byte tokens of the fuzz vocabulary (ids 256 on).
const WORDS: [&[u8]; 12] = [
    b"{\"",
    b"\":",
    b"\": ",
    b"\", \"",
    b"true",
    b"false",
    b"null",
    b"},",
    b"[{",
    b"00",
    b"ab",
    "é".as_bytes(),
];

/// EOS id of the fuzz vocabulary.
pub const EOS: u32 = 1000;

/// A small vocabulary: every byte as a token of its own (so every text can be spelled), and a
/// few multi-byte tokens as a real vocabulary has (so spellings differ in their splits).
pub fn vocabulary() -> &'static GuideVocabulary {
    static V: OnceLock<GuideVocabulary> = OnceLock::new();
    V.get_or_init(|| {
        let bytes: Vec<[u8; 1]> = (0..=255u8).map(|b| [b]).collect();
        let tokens = bytes
            .iter()
            .enumerate()
            .map(|(i, b)| (i as u32, &b[..]))
            .chain(WORDS.iter().enumerate().map(|(i, w)| (256 + i as u32, *w)));
        GuideVocabulary::new(tokens, &[EOS]).expect("the fuzz vocabulary")
    })
}

/// The bytes of `token` in [`vocabulary`].
pub fn spelling(token: u32) -> Vec<u8> {
    match token {
        0..=255 => vec![token as u8],
        256..=267 => WORDS[token as usize - 256].to_vec(),
        _ => panic!("token {token} is not in the fuzz vocabulary"),
    }
}

/// Walks `guide` as the sampler does, choosing among the allowed tokens with `choices`; returns
/// the text and whether the walk ended with EOS. Checks on the way that some token is always
/// allowed, that every allowed id is a vocabulary id, and that walking the output from scratch
/// allows what walking it one token at a time allowed (every 8 tokens).
pub fn walk(guide: Arc<Guide>, choices: &[u8]) -> (Vec<u8>, bool) {
    let mut state = GuideState::new(guide.clone());
    let mut out: Vec<u32> = Vec::new();
    let mut text = Vec::new();
    for &c in choices.iter().take(96) {
        let mut allowed = state.allowed(&out).to_vec();
        assert!(
            !allowed.is_empty(),
            "a guide always allows something (EOS at least)"
        );
        allowed.sort_unstable();
        let before = allowed.len();
        allowed.dedup();
        assert_eq!(before, allowed.len(), "an allowed id is listed once");
        assert!(
            allowed.iter().all(|&t| t == EOS || t < 268),
            "unknown id allowed"
        );
        // The same walk from scratch allows the same ids (checked every 8 tokens: each check
        // walks the whole output again).
        if out.len().is_multiple_of(8) {
            let mut fresh = GuideState::new(guide.clone());
            let mut again = fresh.allowed(&out).to_vec();
            again.sort_unstable();
            assert_eq!(
                allowed, again,
                "an incremental walk and a fresh one disagree"
            );
        }
        let others: Vec<u32> = allowed.iter().copied().filter(|&t| t != EOS).collect();
        let eos = allowed.contains(&EOS);
        if others.is_empty() || (eos && c & 1 == 0) {
            assert!(eos, "where no text may follow, EOS is allowed");
            return (text, true);
        }
        let t = others[(c >> 1) as usize % others.len()];
        text.extend(spelling(t));
        out.push(t);
    }
    (text, false)
}

/// `StructuredOutput` for a target.
pub fn compile(
    spec: &StructuredOutput,
) -> Result<Arc<Guide>, pd_engine::sampling::structured::StructuredError> {
    Guide::compile(spec, vocabulary()).map(Arc::new)
}
