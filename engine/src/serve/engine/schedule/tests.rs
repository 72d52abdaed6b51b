//! The plan of a step as a value: budget split, admission limits and preemption, read off
//! the `Schedule` before anything runs (on the tiny golden checkpoint, CPU backend).

use std::path::Path;
use std::time::{Duration, Instant};

use crate::backend::cpu::CpuBackend;
use crate::config::ModelConfig;
use crate::executor::Executor;
use crate::model::Qwen3;
use crate::sampling::SamplingParams;
use crate::serve::config::{EngineConfig, Role};
use crate::serve::engine::Engine;
use crate::serve::request::{EngineRequest, RequestId};
use crate::weights::Checkpoint;

use super::{Schedule, Scheduled};

const BS: usize = 4;

fn engine(num_blocks: usize, budget: usize, max_num_seqs: usize) -> Engine<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa");
    let mc = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let backend = CpuBackend::new();
    let model = Qwen3::load(
        &backend,
        &Checkpoint::open(&dir).unwrap(),
        &mc,
        &mut |_, _| {},
    )
    .unwrap();
    let exec = Executor::new(backend, model, BS, num_blocks).unwrap();
    let config = EngineConfig {
        role: Role::Mixed,
        enable_prefix_caching: true,
        hash_algo: Default::default(),
        host_cache_blocks: 0,
        max_num_batched_tokens: budget,
        max_num_seqs,
        max_model_len: 512,
        lease_timeout: Duration::from_secs(30),
        seed: 0,
    };
    Engine::new(exec, config, vec![399], 400).unwrap()
}

fn submit(engine: &mut Engine<CpuBackend>, id: &str, prompt_len: usize, max_tokens: u32) {
    let prompt = (0..prompt_len as u32).map(|i| (i * 37 + id.len() as u32 * 101) % 390);
    engine
        .submit(EngineRequest {
            id: RequestId::from(id),
            prompt: prompt.collect(),
            params: SamplingParams {
                max_tokens,
                ignore_eos: true,
                ..SamplingParams::default()
            },
            cache_salt: None,
            imported: None,
            lease_kv: false,
            guide: None,
            resumed: 0,
        })
        .unwrap();
}

fn item(id: &str, tokens: usize) -> Scheduled {
    Scheduled {
        id: RequestId::from(id),
        tokens,
    }
}

#[test]
fn the_token_budget_is_split_in_arrival_order_and_chunks_the_last_prompt() {
    let mut e = engine(32, 8, 16);
    submit(&mut e, "a", 5, 4);
    submit(&mut e, "bb", 6, 4);
    submit(&mut e, "ccc", 3, 4);
    let plan = e.schedule(Instant::now());
    // "a" whole, "bb" chunked to the budget's rest, "ccc" waits: the budget is spent.
    assert_eq!(
        plan,
        Schedule {
            items: vec![item("a", 5), item("bb", 3)],
            preempted: false,
        }
    );
    assert_eq!(plan.num_tokens(), 8);
}

#[test]
fn running_sequences_come_first_and_max_num_seqs_caps_admission() {
    let mut e = engine(32, 64, 2);
    submit(&mut e, "a", 5, 4);
    submit(&mut e, "bb", 6, 4);
    submit(&mut e, "ccc", 3, 4);
    let first = e.schedule(Instant::now());
    assert_eq!(first.items, vec![item("a", 5), item("bb", 6)]);
    let outputs = e.execute(&first);
    let _ = e.post_process(first, outputs, Instant::now());
    // Both decode one token each; "ccc" is not admitted past max_num_seqs = 2.
    let second = e.schedule(Instant::now());
    assert_eq!(second.items, vec![item("a", 1), item("bb", 1)]);
}

#[test]
fn a_full_pool_preempts_the_newest_and_admits_nothing() {
    // Three blocks: after one step "a" and "bb" hold one each and need a second each.
    let mut e = engine(3, 64, 16);
    submit(&mut e, "a", 4, 8);
    submit(&mut e, "bb", 4, 8);
    let first = e.schedule(Instant::now());
    assert_eq!(first.items, vec![item("a", 4), item("bb", 4)]);
    let outputs = e.execute(&first);
    let _ = e.post_process(first, outputs, Instant::now());
    submit(&mut e, "ccc", 2, 2);
    // "a" takes the last free block; "bb" finds none and is preempted (the newest goes
    // first), so "ccc" is not admitted either.
    let second = e.schedule(Instant::now());
    assert_eq!(
        second,
        Schedule {
            items: vec![item("a", 1)],
            preempted: true,
        }
    );
}
