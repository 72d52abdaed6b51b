//! What a structured output costs the host sampler per token (`cargo bench -p pd-engine
//! --bench guided`), over Qwen3's vocabulary (151,936 logits, temperature 1): each guide
//! replays the tokens of one JSON text (Qwen3's own tokenization), a step being
//! `Sampler::sample` after that many tokens. Printed per case: µs per step (minimum and
//! median over rounds; the machines are shared, read the minimum) and the ratio to the same
//! steps without a guide, measured in the same run.
//!
//! - `none`: no guide (the baseline);
//! - `json_schema`: a schema outlines turns into a regex (an index compiled ahead);
//! - `json_object`: any JSON object (the pushdown grammar, masks read from the trie when a
//!   state is first met, then kept: `warm` replays with the masks kept, `cold` compiles a
//!   new guide per replay, so every state's first mask is paid);
//! - `free-form schema`: a schema with an any-object part (DFA + grammar, masks as above);
//! - `gbnf json`: JSON written as a GBNF grammar (the stack recognizer, masks as above).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::sampling::{Guide, GuideVocabulary, Sampler, SamplingParams, StructuredOutput};
use pd_engine::tokenizer::Tokenizer;

const ROUNDS: usize = 5;
const ROUND_TIME: Duration = Duration::from_millis(400);

const TEXT: &str = r#"{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "meta": {"source": "wiki", "verified": true, "tags": ["a", "b"]}}"#;

fn main() {
    let tokenizer = Tokenizer::qwen3().expect("the embedded Qwen3 tokenizer");
    let eos = vec![
        tokenizer.token_id("<|im_end|>").unwrap(),
        tokenizer.token_id("<|endoftext|>").unwrap(),
    ];
    let vocabulary = GuideVocabulary::from_tokenizer(&tokenizer, &eos).unwrap();
    let tokens = tokenizer.encode(TEXT).unwrap();
    let logits: Vec<f32> = (0..tokenizer.vocab_size())
        .map(|i| ((i as u64).wrapping_mul(0x9e37_79b9) % 1000) as f32 / 100.0)
        .collect();
    let params = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "fields": {"type": "array", "items": {"type": "string"}}, "meta": {"type": "object"}}, "required": ["name", "born", "fields", "meta"]}"#;
    let fixed = r#"{"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "fields": {"type": "array", "items": {"type": "string"}}, "meta": {"type": "object", "properties": {"source": {"type": "string"}, "verified": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["source", "verified", "tags"]}}, "required": ["name", "born", "fields", "meta"]}"#;
    let compile = |spec: &StructuredOutput| Arc::new(Guide::compile(spec, &vocabulary).unwrap());
    let json_schema = compile(&StructuredOutput::JsonSchema(fixed.into()));
    let json_object = compile(&StructuredOutput::JsonObject);
    let free_form = compile(&StructuredOutput::JsonSchema(schema.into()));
    let gbnf = || {
        StructuredOutput::Grammar(
            include_str!("../src/sampling/structured/grammar/json.gbnf").into(),
        )
    };
    let grammar = compile(&gbnf());

    // One replay of the text's tokens: the time of its sampling steps.
    let replay = |guide: Option<Arc<Guide>>| {
        let mut sampler = Sampler::new(&params, 0, &eos);
        if let Some(g) = guide {
            sampler = sampler.with_guide(g);
        }
        let start = Instant::now();
        for end in 0..tokens.len() {
            let token = sampler.sample(&logits, &[], &tokens[..end]).token_id;
            // Off its guide a sampler allows only EOS: the replay must stay on it.
            assert!(!eos.contains(&black_box(token)), "off the guide at {end}");
        }
        start.elapsed()
    };
    println!("{} steps per replay, {} logits", tokens.len(), logits.len());
    let base = report("none", tokens.len(), || replay(None), None);
    report(
        "json_schema",
        tokens.len(),
        || replay(Some(json_schema.clone())),
        Some(base),
    );
    report(
        "json_object (warm)",
        tokens.len(),
        || replay(Some(json_object.clone())),
        Some(base),
    );
    report(
        "json_object (cold)",
        tokens.len(),
        || replay(Some(compile(&StructuredOutput::JsonObject))),
        Some(base),
    );
    report(
        "free-form schema (warm)",
        tokens.len(),
        || replay(Some(free_form.clone())),
        Some(base),
    );
    report(
        "gbnf json (warm)",
        tokens.len(),
        || replay(Some(grammar.clone())),
        Some(base),
    );
    report(
        "gbnf json (cold)",
        tokens.len(),
        || replay(Some(compile(&gbnf()))),
        Some(base),
    );
}

/// Runs `f` (a replay of `steps` steps, returning their time) in rounds; prints µs per step
/// and, given the baseline's minimum, the ratio to it. Returns the minimum.
fn report(name: &str, steps: usize, mut f: impl FnMut() -> Duration, base: Option<f64>) -> f64 {
    f(); // warm-up
    let mut per_step = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let (mut spent, mut iters) = (Duration::ZERO, 0u32);
        let start = Instant::now();
        while start.elapsed() < ROUND_TIME {
            spent += f();
            iters += 1;
        }
        per_step.push(spent.as_secs_f64() * 1e6 / (f64::from(iters) * steps as f64));
    }
    per_step.sort_by(f64::total_cmp);
    let (min, median) = (per_step[0], per_step[ROUNDS / 2]);
    match base {
        Some(b) => println!(
            "{name:<26} {min:>9.1} µs/step (median {median:.1})  {:.2}x none",
            min / b
        ),
        None => println!("{name:<26} {min:>9.1} µs/step (median {median:.1})"),
    }
    min
}
