//! The serving engine on the tiny transformers-golden checkpoint: exact prefix-cache
//! accounting, equivalence of every scheduling path with plain generation, leases, abort,
//! preemption, and no block left behind.
//!
//! One test binary: the tests are grouped by concept in the modules below; the engine
//! builders, request helpers and bookkeeping checks they share live here.

mod disaggregation;
mod prefix_cache;
mod scheduling;
mod stopping;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::Executor;
use pd_engine::model::Qwen3;
use pd_engine::sampling::{PromptLogprob, SamplingParams};
use pd_engine::serve::{
    Engine, EngineConfig, EngineCounters, EngineRequest, Finished, RequestEvent, RequestId, Role,
};
use pd_engine::weights::Checkpoint;

const BS: usize = 4;
/// Ids the engines' tokenizer knows (the model's vocabulary is larger).
const VOCAB_LIMIT: usize = 400;

fn config() -> EngineConfig {
    EngineConfig {
        role: Role::Mixed,
        enable_prefix_caching: true,
        hash_algo: Default::default(),
        host_cache_blocks: 0,
        max_num_batched_tokens: 256,
        max_num_seqs: 16,
        max_model_len: 512,
        lease_timeout: Duration::from_secs(30),
        seed: 0,
    }
}

fn engine(num_blocks: usize, cfg: EngineConfig) -> Engine<CpuBackend> {
    engine_on(CpuBackend::new(), num_blocks, cfg)
}

fn engine_on(backend: CpuBackend, num_blocks: usize, cfg: EngineConfig) -> Engine<CpuBackend> {
    let exec = executor_on(backend, num_blocks);
    Engine::new(exec, cfg, vec![399], VOCAB_LIMIT).unwrap()
}

fn executor(num_blocks: usize) -> Executor<CpuBackend> {
    executor_on(CpuBackend::new(), num_blocks)
}

fn executor_on(backend: CpuBackend, num_blocks: usize) -> Executor<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa");
    let mc = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Qwen3::load(&backend, &ckpt, &mc, &mut |_, _| {}).unwrap();
    Executor::new(backend, model, BS, num_blocks).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed * 101 + 7) % 390)
        .collect()
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId::from(id),
        prompt,
        params: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        cache_salt: None,
        imported: None,
        lease_kv: true,
        guide: None,
        resumed: 0,
    }
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    tokens: Vec<u32>,
    prompt_logprobs: Option<Vec<PromptLogprob>>,
    finished: Option<Finished>,
}

/// Step until idle, collecting every request's tokens and its single terminal event.
fn drain(engine: &mut Engine<CpuBackend>) -> HashMap<String, Outcome> {
    let mut out: HashMap<String, Outcome> = HashMap::new();
    let mut steps = 0;
    while engine.has_work() {
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
        for (id, event) in engine.step() {
            let o = out.entry(id.0).or_default();
            assert!(o.finished.is_none(), "an event after the terminal one");
            match event {
                RequestEvent::Token(t) => o.tokens.push(t.token_id),
                RequestEvent::PromptLogprobs(scores) => {
                    // Once, before the first token.
                    assert!(o.tokens.is_empty() && o.prompt_logprobs.is_none());
                    o.prompt_logprobs = Some(scores);
                }
                RequestEvent::Finished(f) => o.finished = Some(*f),
                RequestEvent::Failed(e) => panic!("request failed: {e}"),
            }
        }
    }
    out
}

fn run_one(engine: &mut Engine<CpuBackend>, r: EngineRequest) -> Outcome {
    let id = r.id.0.clone();
    engine.submit(r).unwrap();
    drain(engine).remove(&id).unwrap()
}

/// Hit rates stay in [0, 1] and the books balance.
fn check_counters(c: &EngineCounters) {
    assert!(c.prefix_cache_hits <= c.prefix_cache_queries);
    assert!(c.external_prefix_cache_hits <= c.external_prefix_cache_queries);
    assert!(c.external_prefix_cache_queries <= c.prefix_cache_queries);
}

fn all_free(engine: &Engine<CpuBackend>) {
    assert_eq!(
        engine.num_free_blocks(),
        engine.num_blocks(),
        "every block came back"
    );
    assert_eq!(engine.num_open(), 0);
}
