//! What the workspace's tests share, so that each test says only what it checks: scraping
//! and parsing `/metrics` ([`metrics`], [`exposition`]), the synthetic model cache
//! ([`cache`]), greedy sampling parameters ([`greedy`]) and, with the feature `nodes`, prefill
//! and decode nodes started in process (`node`), and with `engine` tiny CPU engines
//! (`engine`).
//!
//! A dev-dependency of the product crates; the one crate that depends on it otherwise is
//! pd-tests, itself only tests and the soak, which reads /metrics with it (checked by
//! `scripts/test.sh`).

#[cfg(feature = "engine")]
pub mod engine;
pub mod exposition;
pub mod metrics;
#[cfg(feature = "nodes")]
pub mod node;

use std::path::Path;

use pd_proto::pb;

pub use exposition::Exposition;

/// A synthetic model cache shared by the tests of one test binary, so `synthetic:tiny` is
/// written once per binary rather than once per test (it lives until the process exits).
pub fn cache() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("tempdir"))
        .path()
}

/// Greedy sampling (temperature 0): what most tests compare tokens under, since two runs of
/// a prompt must then agree token for token.
pub fn greedy() -> Option<pb::SamplingParams> {
    Some(pb::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    })
}

/// A conversation of `(role, content)` messages as the gRPC API takes it (no tools, the
/// template's default thinking).
pub fn chat_input(messages: &[(&str, &str)]) -> pb::ChatInput {
    pb::ChatInput {
        messages: messages
            .iter()
            .map(|(role, content)| pb::ChatMessage {
                role: role.to_string(),
                content: content.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A greedy prefill of `token_ids` whose KV is leased for a decode node to pull (what the
/// router sends a prefill node).
pub fn prefill_request(id: &str, token_ids: Vec<u32>) -> pb::PrefillRequest {
    pb::PrefillRequest {
        request_id: id.into(),
        token_ids,
        sampling: greedy(),
        cache_salt: None,
        skip_kv_lease: false,
        ..Default::default()
    }
}

/// `len` spread token ids (below 150,000, inside every test vocabulary) that differ by
/// `salt`, so tests that must not share cached prefixes do not.
pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + salt * 104_729 + 11) % 150_000)
        .collect()
}
