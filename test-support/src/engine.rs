//! Tiny CPU engines over the committed `tiny-gqa` checkpoint (the transformers golden
//! fixture under `engine/tests/fixtures`), with the configuration the engine tests share,
//! requests to them, and running a request to its end.

use std::path::PathBuf;
use std::time::Duration;

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::Executor;
use pd_engine::model::Qwen3;
use pd_engine::sampling::SamplingParams;
use pd_engine::serve::{Engine, EngineConfig, EngineRequest, RequestEvent, RequestId, Role};
use pd_engine::weights::Checkpoint;

/// The end-of-sequence id the tests' engines stop on.
pub const EOS: u32 = 399;
/// Ids the tests' tokenizer knows (the model's vocabulary is larger).
pub const VOCAB_LIMIT: usize = 400;

/// The `tiny-gqa` checkpoint's directory.
pub fn tiny_gqa() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/fixtures/golden/tiny-gqa")
}

/// The engine configuration of the tests, for `role`: prefix caching on, no host tier, 256
/// tokens and 16 sequences a step, 512-token contexts, 30 s leases, seed 0.
pub fn config(role: Role) -> EngineConfig {
    EngineConfig {
        role,
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

/// `tiny-gqa` loaded on `backend`, with `num_blocks` KV blocks of `block_size` tokens.
pub fn executor(backend: CpuBackend, block_size: usize, num_blocks: usize) -> Executor<CpuBackend> {
    let dir = tiny_gqa();
    let mc = ModelConfig::from_file(&dir.join("config.json")).expect("config.json");
    let ckpt = Checkpoint::open(&dir).expect("checkpoint");
    let model = Qwen3::load(&backend, &ckpt, &mc, &mut |_, _| {}).expect("weights load");
    Executor::new(backend, model, block_size, num_blocks).expect("executor")
}

/// An engine over `exec` with `cfg`, stopping on [`EOS`], sampling below [`VOCAB_LIMIT`].
pub fn engine(exec: Executor<CpuBackend>, cfg: EngineConfig) -> Engine<CpuBackend> {
    Engine::new(exec, cfg, vec![EOS], VOCAB_LIMIT).expect("engine")
}

/// A request for `max_tokens` tokens of `prompt`, EOS ignored, default (greedy) sampling;
/// `lease_kv`: keep the prompt's KV leased for a transfer.
pub fn request(id: &str, prompt: Vec<u32>, max_tokens: u32, lease_kv: bool) -> EngineRequest {
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
        lease_kv,
        guide: None,
        resumed: 0,
    }
}

/// Submits `request` and steps `engine` until it has no work: the tokens generated.
pub fn run(engine: &mut Engine<CpuBackend>, request: EngineRequest) -> Vec<u32> {
    engine.submit(request).expect("submit");
    let mut tokens = Vec::new();
    while engine.has_work() {
        for (_, event) in engine.step() {
            match event {
                RequestEvent::Token(t) => tokens.push(t.token_id),
                RequestEvent::Finished(_) | RequestEvent::PromptLogprobs(_) => {}
                RequestEvent::Failed(e) => panic!("{e}"),
            }
        }
    }
    tokens
}
