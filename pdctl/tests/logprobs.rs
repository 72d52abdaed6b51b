//! Log-probabilities as transformers computes them: over the model's whole output vocabulary
//! (151,936 rows for Qwen3, the checkpoint's padding rows past the tokenizer's 151,669 ids
//! included), not renormalized over the ids a token can be sampled from. The fixture is
//! transformers' output on the same `synthetic:tiny` checkpoint
//! (tools/golden/make_logprobs_golden.py); the run is `pdctl run` as a user starts it.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// transformers' f32 logits and ours differ by rounding (about 1e-6 here); renormalizing over
/// the tokenizer's ids would move every logprob by the padding rows' share, about 1.8e-3.
const TOLERANCE: f64 = 1e-4;

fn fixture() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/logprobs_full_vocab.json");
    serde_json::from_slice(&std::fs::read(&path).expect("fixture")).expect("fixture JSON")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

/// One scored position, ours against transformers': the token and its logprob, then the
/// listed alternatives (their order only where transformers' gaps exceed rounding).
fn check_position(what: &str, ours: &Value, theirs: &Value) {
    assert_eq!(ours["token_id"], theirs["token_id"], "{what}: token");
    let (a, b) = (
        ours["logprob"].as_f64().unwrap(),
        theirs["logprob"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() <= TOLERANCE,
        "{what}: logprob {a} against transformers' {b} (padding mass {})",
        theirs["padding_mass"]
    );
    let (ours_top, theirs_top) = (
        ours["top"].as_array().unwrap(),
        theirs["top"].as_array().unwrap(),
    );
    assert_eq!(ours_top.len(), theirs_top.len(), "{what}: alternatives");
    let ordered = theirs["top_min_gap"].as_f64().unwrap() > 10.0 * TOLERANCE;
    for (i, (o, t)) in ours_top.iter().zip(theirs_top).enumerate() {
        if ordered {
            assert_eq!(o["token_id"], t["token_id"], "{what}: alternative {i}");
        }
        let (a, b) = (
            o["logprob"].as_f64().unwrap(),
            t["logprob"].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() <= TOLERANCE,
            "{what}: alternative {i} logprob {a} against {b}"
        );
    }
}

#[test]
fn logprobs_are_normalized_over_the_whole_output_vocabulary_as_transformers_does() {
    let golden = fixture();
    let prompt: Vec<String> = ids(&golden["prompt_token_ids"])
        .iter()
        .map(u64::to_string)
        .collect();
    let generated = golden["generated"].as_array().unwrap();
    let top = golden["logprobs_top"].as_u64().unwrap().to_string();
    let max_tokens = generated.len().to_string();
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pdctl"))
        .args(["run", "--model", "synthetic:tiny", "--token-ids"])
        .arg(prompt.join(","))
        .args(["--max-tokens", &max_tokens, "--ignore-eos", "--json"])
        .args(["--logprobs", &top, "--prompt-logprobs", &top])
        .env("PD_CACHE_DIR", cache.path())
        .env_remove("PD_MODEL")
        .output()
        .expect("pdctl runs");
    assert!(
        out.status.success(),
        "pdctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");

    // The fixture can tell the two normalizations apart at every position.
    for e in golden["prompt_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .chain(generated)
    {
        assert!(-(1.0 - e["padding_mass"].as_f64().unwrap()).ln() > 10.0 * TOLERANCE);
    }

    let theirs_prompt = golden["prompt_logprobs"].as_array().unwrap();
    let ours_prompt = ours["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        ours_prompt.len(),
        theirs_prompt.len(),
        "scored prompt positions"
    );
    for (p, (o, t)) in ours_prompt.iter().zip(theirs_prompt).enumerate() {
        check_position(&format!("prompt position {}", p + 1), o, t);
    }
    let ours_generated = ours["logprobs"].as_array().unwrap();
    assert_eq!(ours_generated.len(), generated.len(), "generated tokens");
    for (i, (o, t)) in ours_generated.iter().zip(generated).enumerate() {
        check_position(&format!("generated token {i}"), o, t);
    }
}
