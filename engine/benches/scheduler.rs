//! Scheduler overhead per step with many running sequences, on `synthetic:tiny` (a tiny model
//! makes the forward pass small, so overhead shows). Prints, per decode step with 256
//! running sequences: planning (admission, preemption, allocation), the forward pass, and
//! post-processing (sampling over the 151,936-token vocabulary, registration, stops).
//!
//! `cargo bench -p pd-engine --bench scheduler`

use std::time::Duration;

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::executor::Executor;
use pd_engine::model::ModelFiles;
use pd_engine::sampling::SamplingParams;
use pd_engine::serve::{Engine, EngineConfig, EngineRequest, RequestId, Role};
use pd_engine::synthetic::{self, Preset};

fn main() {
    let seqs: usize = std::env::var("SEQS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let cache = std::env::temp_dir().join("pd-bench-cache");
    let dir = synthetic::materialize(Preset::Tiny, 0, &cache, &|_, _| {}).expect("synthetic model");
    let files = ModelFiles::open(&dir).expect("model files");
    let model = files
        .load_weights(&CpuBackend::new(), &mut |_, _| {})
        .expect("weights");
    let exec = Executor::new(CpuBackend::new(), model, 16, seqs * 8).expect("executor");
    let config = EngineConfig {
        role: Role::Mixed,
        enable_prefix_caching: true,
        hash_algo: Default::default(),
        host_cache_blocks: 0,
        max_num_batched_tokens: 8192,
        max_num_seqs: seqs,
        max_model_len: 4096,
        lease_timeout: Duration::from_secs(30),
        seed: 0,
    };
    let mut engine = Engine::new(exec, config, vec![], 151_669).expect("engine");
    for i in 0..seqs {
        engine
            .submit(EngineRequest {
                id: RequestId(format!("r{i}")),
                prompt: (0..32)
                    .map(|t| ((i * 131 + t * 17) % 150_000) as u32)
                    .collect(),
                params: SamplingParams {
                    max_tokens: 100,
                    ignore_eos: true,
                    ..Default::default()
                },
                cache_salt: None,
                imported: None,
                lease_kv: false,
                guide: None,
                resumed: 0,
            })
            .expect("submit");
    }
    // Prefill everything, then time decode steps with all sequences running.
    while engine.counters().num_waiting > 0 || engine.last_step().tokens != seqs {
        engine.step();
    }
    let steps = 20;
    let (mut plan, mut fwd, mut post) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for _ in 0..steps {
        engine.step();
        let s = engine.last_step();
        assert_eq!(s.seqs, seqs);
        plan += s.schedule;
        fwd += s.forward;
        post += s.postprocess;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
    let total = ms(plan) + ms(fwd) + ms(post);
    println!("decode step with {seqs} running sequences (synthetic:tiny, mean of {steps} steps)");
    println!(
        "  scheduling      {:8.3} ms  {:5.2} % of the step",
        ms(plan),
        100.0 * ms(plan) / total
    );
    println!(
        "  forward pass    {:8.3} ms  {:5.2} %",
        ms(fwd),
        100.0 * ms(fwd) / total
    );
    println!(
        "  post-processing {:8.3} ms  {:5.2} %  (sampling over the full vocabulary)",
        ms(post),
        100.0 * ms(post) / total
    );
}
