//! A step in which no row wants logits (prompt chunks that do not finish their prompt) only
//! writes its K/V: the executor skips the last layer's attention and MLP and the LM head.
//! What a user would notice if that went wrong — different K/V, so different tokens later —
//! is checked here against the same chunks run with their logits.

use std::path::Path;

use pd_engine::backend::HostMatrix;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::{ExecItem, Executor, ItemWants, NextToken, StepOutput};
use pd_engine::model::Qwen3;
use pd_engine::weights::Checkpoint;

const BS: usize = 4;

fn executor() -> Executor<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa");
    let mc = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Qwen3::load(&CpuBackend::new(), &ckpt, &mc, &mut |_, _| {}).unwrap();
    Executor::new(CpuBackend::new(), model, BS, 16).unwrap()
}

/// Every block's bytes, K and V of every layer.
fn kv_bytes(exec: &Executor<CpuBackend>) -> Vec<Vec<u8>> {
    (0..exec.num_blocks() as u32)
        .map(|b| {
            let mut bytes = vec![0; exec.block_bytes()];
            exec.read_block(b, &mut bytes);
            bytes
        })
        .collect()
}

/// Two prompts, each run in chunks (`(start, end)` per step and prompt) in the same steps.
/// `skip`: the chunks that do not end a prompt ask for nothing (`NextToken::None`), so the
/// first steps want no logits at all; otherwise every chunk asks for its last row. Returns
/// the K/V after each step and the logits the last step gave each prompt.
fn run(skip: bool) -> (Vec<Vec<Vec<u8>>>, Vec<HostMatrix>) {
    let prompts: [Vec<u32>; 2] = [
        (0..13).map(|t| (t * 37 + 5) % 390).collect(),
        (0..10).map(|t| (t * 53 + 11) % 390).collect(),
    ];
    let tables: [Vec<u32>; 2] = [(0..4).collect(), (8..11).collect()];
    let chunks: [[(usize, usize); 2]; 3] = [[(0, 5), (0, 3)], [(5, 9), (3, 8)], [(9, 13), (8, 10)]];
    let mut exec = executor();
    let mut kv = Vec::new();
    let mut last = Vec::new();
    for (step, chunk) in chunks.iter().enumerate() {
        let finishing = step + 1 == chunks.len();
        let items: Vec<ExecItem<'_>> = (0..2)
            .map(|i| ExecItem {
                tokens: &prompts[i][chunk[i].0..chunk[i].1],
                start: chunk[i].0,
                block_table: &tables[i],
                all_logits: false,
            })
            .collect();
        let wants: Vec<ItemWants<'_>> = (0..2)
            .map(|_| ItemWants {
                prompt: None,
                next: if skip && !finishing {
                    NextToken::None
                } else {
                    NextToken::Host
                },
            })
            .collect();
        let outputs = exec.execute_sampling(&items, &wants, 390);
        for out in &outputs {
            assert!(out.prompt_logprobs.is_empty());
            if skip && !finishing {
                assert_eq!(out.next, None, "a chunk that asks for nothing gets nothing");
            }
        }
        if finishing {
            last = outputs
                .into_iter()
                .map(|o| match o.next {
                    Some(StepOutput::Logits(m)) => m,
                    other => panic!("host logits expected, got {other:?}"),
                })
                .collect();
        }
        kv.push(kv_bytes(&exec));
    }
    (kv, last)
}

#[test]
fn chunks_that_want_no_logits_write_the_same_kv_and_lead_to_the_same_logits() {
    let (kv_only, logits_skipped) = run(true);
    let (full, logits_full) = run(false);
    for (step, (a, b)) in kv_only.iter().zip(&full).enumerate() {
        for (block, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(x == y, "step {step}: block {block}'s K/V differ");
        }
    }
    // Some block holds K/V at all (the comparison above is not over empty caches).
    assert!(full[0].iter().any(|b| b.iter().any(|&x| x != 0)));
    assert_eq!(logits_skipped, logits_full);
    assert!(
        logits_full
            .iter()
            .all(|m| m.rows == 1 && m.data.iter().all(|x| x.is_finite()))
    );
}
