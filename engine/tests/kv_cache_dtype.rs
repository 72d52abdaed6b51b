//! A 16-bit KV cache on the CPU (`--kv-cache-dtype f16|bf16`) against the f32 one, on the
//! golden tiny checkpoint. Teacher-forced (every executor sees the f32 run's greedy tokens,
//! so one divergence cannot cascade), held to the backends' conformance rule
//! ([`pd_engine::backend::conformance`]) at 1e-2: each logits row within 1e-2 of f32's,
//! relative to the row's norm (what rounding K and V to 16 bits costs), and the same greedy
//! token wherever f32's top-2 margin is clear. Blocks move between caches of different types as f32 (the
//! transfer format), exact from 16 bits to f32 and rounded the other way.

use std::path::{Path, PathBuf};

use pd_engine::backend::conformance::{argmax, compare_logits};
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::{ExecItem, Executor};
use pd_engine::model::Qwen3;
use pd_engine::weights::{Checkpoint, DType};

const BS: usize = 4;
const BLOCKS: usize = 32;
/// What rounding K and V to bf16 may cost, relative to a logits row's norm (the bf16
/// tolerance of the CUDA conformance suite).
const TOLERANCE: f64 = 1e-2;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa")
}

fn executor(kv_dtype: DType) -> Executor<CpuBackend> {
    let dir = fixture();
    let mc = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let backend = CpuBackend::with_kv_dtype(kv_dtype);
    let model = Qwen3::load(&backend, &ckpt, &mc, &mut |_, _| {}).unwrap();
    Executor::new(backend, model, BS, BLOCKS).unwrap()
}

#[test]
fn a_16_bit_kv_cache_follows_the_f32_one_within_bf16_tolerance() {
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7919 + 17) % 390).collect();
    let table: Vec<u32> = (0..BLOCKS as u32).rev().collect();
    let mut reference = executor(DType::F32);
    let mut others = [
        (DType::F16, executor(DType::F16)),
        (DType::BF16, executor(DType::BF16)),
    ];
    let prefill = [ExecItem {
        tokens: &prompt,
        start: 0,
        block_table: &table,
        all_logits: true,
    }];
    let want = reference.execute(&prefill).remove(0);
    let mut worst = vec![0.0f64; others.len()];
    for ((dtype, exec), worst) in others.iter_mut().zip(&mut worst) {
        let got = exec.execute(&prefill).remove(0);
        *worst = compare_logits(&format!("{dtype:?} prefill"), &want, &got, TOLERANCE);
    }
    let mut next = argmax(want.row(want.rows - 1)).0 as u32;
    for step in 0..24 {
        let tokens = [next];
        let decode = [ExecItem {
            tokens: &tokens,
            start: prompt.len() + step,
            block_table: &table,
            all_logits: false,
        }];
        let want = reference.execute(&decode).remove(0);
        for ((dtype, exec), worst) in others.iter_mut().zip(&mut worst) {
            let got = exec.execute(&decode).remove(0);
            let e = compare_logits(
                &format!("{dtype:?} decode step {step}"),
                &want,
                &got,
                TOLERANCE,
            );
            *worst = worst.max(e);
        }
        next = argmax(want.row(0)).0 as u32;
    }
    for ((dtype, _), worst) in others.iter().zip(&worst) {
        eprintln!("{dtype:?} KV: worst relative logits error {worst:.2e}");
        // Not a copy of f32 either: the cache really rounds.
        assert!(*worst > 0.0, "{dtype:?} KV: identical to f32");
    }
}

#[test]
fn blocks_travel_as_stored_at_half_the_bytes_in_16_bits() {
    let prompt: Vec<u32> = (0..2 * BS as u32).map(|i| (i * 31 + 5) % 390).collect();
    let table = [0, 1];
    let item = [ExecItem {
        tokens: &prompt,
        start: 0,
        block_table: &table,
        all_logits: false,
    }];
    let mut wide = executor(DType::F32);
    let mut half = executor(DType::F16);
    wide.execute(&item);
    half.execute(&item);
    let n = wide.block_bytes();
    assert_eq!(
        half.block_bytes(),
        n / 2,
        "a 16-bit block moves half the bytes"
    );
    assert_eq!(half.layout().dtype, DType::F16);
    let (mut w, mut h) = (vec![0u8; n], vec![0u8; n / 2]);
    wide.read_block(1, &mut w);
    half.read_block(1, &mut h);
    let w: Vec<f32> = bytemuck::pod_collect_to_vec(&w);
    let h16: Vec<half::f16> = bytemuck::pod_collect_to_vec(&h);
    // Layer 0's K and V (the block's first part) are computed from the embeddings alone, so
    // the f16 cache holds f32's values rounded; later layers differ by more, since their
    // inputs went through attention over rounded values.
    let layer0 = w.len()
        / ModelConfig::from_file(&fixture().join("config.json"))
            .unwrap()
            .num_hidden_layers;
    for (a, b) in w[..layer0].iter().zip(&h16[..layer0]) {
        assert_eq!(half::f16::from_f32(*a), *b);
    }
    let widened: Vec<f32> = h16.iter().map(|x| x.to_f32()).collect();
    assert_ne!(w[layer0..], widened[layer0..]);
    // A block written is read back byte for byte, wherever it goes.
    half.write_block(3, &h);
    let mut back = vec![0u8; n / 2];
    half.read_block(3, &mut back);
    assert_eq!(back, h);
    // A block of the wrong size is a caller's bug, refused loudly rather than half-written.
    let wrong = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        half.write_block(3, &vec![0u8; n]);
    }));
    assert!(wrong.is_err(), "a block of the f32 size into an f16 cache");
}
