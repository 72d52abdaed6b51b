//! The serving engine on the tiny transformers-golden checkpoint: exact prefix-cache
//! accounting, equivalence of every scheduling path with plain generation, leases, abort,
//! preemption, and no block left behind.
//!
//! One test binary: the tests are grouped by concept in the modules below; the engine
//! builders, request helpers and bookkeeping checks they share live here.

mod cache_events;
mod disaggregation;
mod prefix_cache;
mod scheduling;
mod stopping;

use std::collections::HashMap;

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::executor::Executor;
use pd_engine::sampling::PromptLogprob;
use pd_engine::serve::{
    Engine, EngineConfig, EngineCounters, EngineRequest, Finished, RequestEvent, Role,
};
use pd_test_support::engine as support;

const BS: usize = 4;

fn config() -> EngineConfig {
    support::config(Role::Mixed)
}

fn engine(num_blocks: usize, cfg: EngineConfig) -> Engine<CpuBackend> {
    engine_on(CpuBackend::new(), num_blocks, cfg)
}

fn engine_on(backend: CpuBackend, num_blocks: usize, cfg: EngineConfig) -> Engine<CpuBackend> {
    support::engine(executor_on(backend, num_blocks), cfg)
}

fn executor(num_blocks: usize) -> Executor<CpuBackend> {
    executor_on(CpuBackend::new(), num_blocks)
}

fn executor_on(backend: CpuBackend, num_blocks: usize) -> Executor<CpuBackend> {
    support::executor(backend, BS, num_blocks)
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed * 101 + 7) % 390)
        .collect()
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    support::request(id, prompt, max_tokens, true)
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
    // External hits split by source, summing to the external total.
    assert_eq!(
        c.external_prefix_cache_hits_by_source.total(),
        c.external_prefix_cache_hits
    );
    assert_eq!(
        c.prompt_tokens_external_by_source.total(),
        c.prompt_tokens_external
    );
}

/// A finished request's usage balances: computed + local + host + peer = prompt tokens, and
/// host + peer = external. Returns (local, host, peer).
fn usage_split(u: &pd_engine::serve::Usage) -> (usize, usize, usize) {
    use pd_engine::serve::TierKind;
    let by = u.external_cached_by_source;
    let (host, peer) = (by[TierKind::Host], by[TierKind::Peer]);
    assert_eq!(host + peer, u.external_cached_tokens, "{u:?}");
    assert!(
        u.local_cached_tokens + host + peer <= u.prompt_tokens,
        "{u:?}"
    );
    (u.local_cached_tokens, host, peer)
}

fn all_free(engine: &Engine<CpuBackend>) {
    assert_eq!(
        engine.num_free_blocks(),
        engine.num_blocks(),
        "every block came back"
    );
    assert_eq!(engine.num_open(), 0);
}
