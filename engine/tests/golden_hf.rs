//! The CPU forward equals Hugging Face transformers' `Qwen3ForCausalLM` and
//! `Qwen3MoeForCausalLM` on tiny random checkpoints (fixtures made by
//! `tools/golden/make_golden.py`): logits at every prompt position and along 32 greedy steps,
//! through the real loader and the paged KV cache, with whole-prompt, chunked and batched
//! prefill.
//!
//! The same checks run once per instruction set of the CPU kernels (`isa_*` tests: AMX,
//! AVX-512, AVX2, portable), each also against the portable kernels' own logits. A path this host
//! cannot run is reported by the test harness as *ignored* with the reason (the build script
//! tells the tests which paths the host has), never as passed.

use std::path::{Path, PathBuf};

use pd_engine::backend::cpu::{CpuBackend, Isa};
use pd_engine::config::ModelConfig;
use pd_engine::generate::{Runner, Sequence, StepItem};
use pd_engine::model::Qwen3;
use pd_engine::weights::Checkpoint;

struct Golden {
    prompts: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
    /// Per prompt: logits at every prompt position, then the logits of each greedy step.
    logits: Vec<(Vec<f32>, Vec<f32>)>,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

fn load_golden(dir: &Path) -> Golden {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<Vec<u32>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p.as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect()
    };
    let prompts = ids(&meta["prompts"]);
    let greedy = ids(&meta["greedy"]);
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let logits = (0..prompts.len())
        .map(|i| {
            (
                f32s(&format!("prompt{i}.logits")),
                f32s(&format!("prompt{i}.greedy_logits")),
            )
        })
        .collect();
    Golden {
        prompts,
        greedy,
        logits,
    }
}

fn runner_on(backend: CpuBackend, dir: &Path, block_size: usize) -> Runner<CpuBackend> {
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = Qwen3::load(&backend, &ckpt, &config, &mut |_, _| {}).unwrap();
    Runner::new(backend, model, block_size, 256).unwrap()
}

/// `max |a - b|`, and `max |a - b| / max |b|`.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let abs = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f32::max);
    (abs, abs / scale)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Check one fixture; `check(abs, rel)` decides whether a difference is acceptable.
fn check_fixture(
    name: &str,
    block_size: usize,
    prefill_chunk: usize,
    ok: &dyn Fn(f32, f32) -> bool,
) {
    check_fixture_on(CpuBackend::new(), name, block_size, prefill_chunk, ok);
}

/// [`check_fixture`] on `backend`; returns every logit it computed (each prompt's positions,
/// then each greedy step's), for comparisons between backends.
fn check_fixture_on(
    backend: CpuBackend,
    name: &str,
    block_size: usize,
    prefill_chunk: usize,
    ok: &dyn Fn(f32, f32) -> bool,
) -> Vec<f32> {
    let dir = fixture(name);
    let golden = load_golden(&dir);
    let isa = backend.isa();
    let mut runner = runner_on(backend, &dir, block_size);
    let mut all = Vec::new();
    let vocab = runner.model().config().vocab_size;
    let mut worst = (0.0f32, 0.0f32);
    for (i, prompt) in golden.prompts.iter().enumerate() {
        let (want_prompt, want_greedy) = &golden.logits[i];
        let mut seq = Sequence::new(prompt.clone());
        let mut got = Vec::new();
        while seq.computed < prompt.len() {
            let count = prefill_chunk.min(prompt.len() - seq.computed);
            let l = runner
                .step(&mut [StepItem {
                    seq: &mut seq,
                    count,
                    all_logits: true,
                }])
                .unwrap()
                .remove(0);
            got.extend(l.data);
        }
        let d = diff(&got, want_prompt);
        assert!(
            ok(d.0, d.1),
            "{name} prompt {i}: prompt logits differ by {d:?}"
        );
        worst = (worst.0.max(d.0), worst.1.max(d.1));
        all.extend_from_slice(&got);

        let mut last = got[(prompt.len() - 1) * vocab..].to_vec();
        for (step, &want_token) in golden.greedy[i].iter().enumerate() {
            let d = diff(&last, &want_greedy[step * vocab..(step + 1) * vocab]);
            assert!(
                ok(d.0, d.1),
                "{name} prompt {i} greedy step {step}: logits differ by {d:?}"
            );
            worst = (worst.0.max(d.0), worst.1.max(d.1));
            all.extend_from_slice(&last);
            let token = argmax(&last);
            assert_eq!(token, want_token, "{name} prompt {i}: greedy token {step}");
            seq.tokens.push(token);
            last = runner
                .step(&mut [StepItem {
                    seq: &mut seq,
                    count: 1,
                    all_logits: false,
                }])
                .unwrap()
                .remove(0)
                .data;
        }
        runner.release(&mut seq);
    }
    assert_eq!(
        runner.free_blocks(),
        runner.total_blocks(),
        "every block returned"
    );
    eprintln!(
        "{name} on {}: worst |Δlogit| {:.2e}, relative {:.2e}",
        isa, worst.0, worst.1
    );
    all
}

const F32_TOLERANCE: f32 = 1e-3;
const BF16_RELATIVE_TOLERANCE: f32 = 1e-2;

#[test]
fn f32_kv1_matches_transformers() {
    check_fixture("tiny-kv1", 16, usize::MAX, &|abs, _| abs <= F32_TOLERANCE);
}

#[test]
fn f32_gqa_matches_transformers() {
    check_fixture("tiny-gqa", 16, usize::MAX, &|abs, _| abs <= F32_TOLERANCE);
}

#[test]
fn bf16_weights_match_transformers() {
    check_fixture("tiny-gqa-bf16", 16, usize::MAX, &|_, rel| {
        rel <= BF16_RELATIVE_TOLERANCE
    });
}

/// Qwen3-MoE, renormalised top-2 of 8 experts, a dense layer between two sparse ones.
#[test]
fn moe_matches_transformers() {
    check_fixture("tiny-moe", 16, usize::MAX, &|abs, _| abs <= F32_TOLERANCE);
}

/// Qwen3-MoE without renormalisation, every second layer sparse (`decoder_sparse_step` 2).
#[test]
fn moe_unnormalised_every_second_layer_matches_transformers() {
    check_fixture("tiny-moe-step2", 16, usize::MAX, &|abs, _| {
        abs <= F32_TOLERANCE
    });
}

#[test]
fn chunked_prefill_and_small_blocks_change_nothing() {
    check_fixture("tiny-gqa", 4, 5, &|abs, _| abs <= F32_TOLERANCE);
    check_fixture("tiny-kv1", 1, 3, &|abs, _| abs <= F32_TOLERANCE);
    check_fixture("tiny-moe", 4, 5, &|abs, _| abs <= F32_TOLERANCE);
}

/// The five prompts in one step equal their goldens: rows of different sequences share the
/// batch's GEMMs (and, for Qwen3-MoE, each expert's rows come from several sequences).
#[test]
fn batched_prefill_equals_one_by_one() {
    batched_prefill("tiny-gqa");
    batched_prefill("tiny-moe");
}

fn batched_prefill(name: &str) {
    batched_prefill_on(CpuBackend::new(), name, &|abs, _| abs <= F32_TOLERANCE);
}

/// [`batched_prefill`] on `backend` (102 rows in one step: the large-batch matrix kernels).
fn batched_prefill_on(backend: CpuBackend, name: &str, ok: &dyn Fn(f32, f32) -> bool) {
    let dir = fixture(name);
    let golden = load_golden(&dir);
    let mut runner = runner_on(backend, &dir, 16);
    let vocab = runner.model().config().vocab_size;
    let mut seqs: Vec<Sequence> = golden.prompts.iter().cloned().map(Sequence::new).collect();
    let mut items: Vec<StepItem<'_>> = seqs
        .iter_mut()
        .map(|seq| {
            let count = seq.tokens.len();
            StepItem {
                seq,
                count,
                all_logits: false,
            }
        })
        .collect();
    let out = runner.step(&mut items).unwrap();
    for (i, logits) in out.iter().enumerate() {
        let len = golden.prompts[i].len();
        let want = &golden.logits[i].0[(len - 1) * vocab..len * vocab];
        let d = diff(&logits.data, want);
        assert!(ok(d.0, d.1), "{name}: batched prompt {i}: {d:?}");
    }
    for seq in seqs.iter_mut() {
        runner.release(seq);
    }
    assert_eq!(runner.free_blocks(), runner.total_blocks());
}

/// Every fixture on the CPU kernels of `isa`: against transformers within the tolerances
/// above, and against the portable kernels' logits within [`F32_TOLERANCE`] (the same
/// weights, so only the kernels' rounding differs); with a 16-bit KV cache (where a last-bit
/// difference in K or V can round to a neighbouring 16-bit value) within
/// [`BF16_RELATIVE_TOLERANCE`] of the largest logit. AMX multiplies bf16 weights by
/// activations rounded to bf16, so on the bf16 checkpoint it is held to that checkpoint's
/// own tolerance against the portable kernels too ([`BF16_RELATIVE_TOLERANCE`]); its f32
/// checkpoints run on AVX-512 and keep [`F32_TOLERANCE`].
fn isa_conformance(isa: Isa) {
    // The build script saw this path on the host; a binary moved to another host may not.
    let Some(backend) = CpuBackend::new().on_isa(isa) else {
        eprintln!("{isa}: NOT RUN: this CPU cannot run it (the test binary was built elsewhere)");
        return;
    };
    let portable = CpuBackend::new().on_isa(Isa::Portable).unwrap();
    let f32_ok = |abs: f32, _: f32| abs <= F32_TOLERANCE;
    let bf16_ok = |_: f32, rel: f32| rel <= BF16_RELATIVE_TOLERANCE;
    type Ok<'a> = &'a dyn Fn(f32, f32) -> bool;
    let cases: [(&str, Ok<'_>); 4] = [
        ("tiny-gqa", &f32_ok),
        ("tiny-kv1", &f32_ok),
        ("tiny-gqa-bf16", &bf16_ok),
        ("tiny-moe", &f32_ok),
    ];
    for (name, ok) in cases {
        let bf16_activations = isa == Isa::Amx && name.ends_with("-bf16");
        // Whole prompts and chunked prefill with small blocks: both attention task shapes.
        for (block_size, chunk) in [(16, usize::MAX), (4, 5)] {
            let got = check_fixture_on(backend, name, block_size, chunk, ok);
            let want = check_fixture_on(portable, name, block_size, chunk, ok);
            let d = diff(&got, &want);
            assert!(
                if bf16_activations {
                    d.1 <= BF16_RELATIVE_TOLERANCE
                } else {
                    d.0 <= F32_TOLERANCE
                },
                "{name} block {block_size} chunk {chunk}: {isa} vs portable differ by {d:?}"
            );
            eprintln!(
                "{name} block {block_size}: {isa} vs portable |Δlogit| {:.2e}, relative {:.2e}",
                d.0, d.1
            );
        }
    }
    // All prompts in one step: the large-batch (prefill) matrix kernels.
    batched_prefill_on(backend, "tiny-gqa", &f32_ok);
    batched_prefill_on(backend, "tiny-moe", &f32_ok);
    batched_prefill_on(backend, "tiny-gqa-bf16", &bf16_ok);
    // A 16-bit KV cache: the widening loads of each path against the portable ones.
    let dir = fixture("tiny-gqa");
    let golden = load_golden(&dir);
    for kv in [
        pd_engine::weights::DType::F16,
        pd_engine::weights::DType::BF16,
    ] {
        let logits = |backend: CpuBackend| -> Vec<f32> {
            let mut runner = runner_on(backend, &dir, 16);
            let mut out = Vec::new();
            for prompt in &golden.prompts {
                let mut seq = Sequence::new(prompt.clone());
                let n = prompt.len();
                out.extend(
                    runner
                        .step(&mut [StepItem {
                            seq: &mut seq,
                            count: n,
                            all_logits: true,
                        }])
                        .unwrap()
                        .remove(0)
                        .data,
                );
                for t in 0..8u32 {
                    seq.tokens.push(t * 7 % 50);
                    out.extend(
                        runner
                            .step(&mut [StepItem {
                                seq: &mut seq,
                                count: 1,
                                all_logits: false,
                            }])
                            .unwrap()
                            .remove(0)
                            .data,
                    );
                }
                runner.release(&mut seq);
            }
            out
        };
        let on = |isa: Isa| CpuBackend::with_kv_dtype(kv).on_isa(isa).unwrap();
        let d = diff(&logits(on(isa)), &logits(on(Isa::Portable)));
        assert!(
            d.1 <= BF16_RELATIVE_TOLERANCE,
            "KV cache {kv}: {isa} vs portable differ by {d:?}"
        );
        eprintln!(
            "tiny-gqa, KV cache {kv}: {isa} vs portable |Δlogit| {:.2e}, relative {:.2e}",
            d.0, d.1
        );
    }
}

#[test]
#[cfg_attr(
    not(pd_host_avx512),
    ignore = "this host has no AVX-512 (avx512f, avx512bw, avx512vl): the avx512 path cannot run here"
)]
fn isa_avx512_matches_portable_and_transformers() {
    isa_conformance(Isa::Avx512);
}

#[test]
#[cfg_attr(
    not(pd_host_avx2),
    ignore = "this host has no AVX2 + FMA + F16C: the avx2 path cannot run here"
)]
fn isa_avx2_matches_portable_and_transformers() {
    isa_conformance(Isa::Avx2);
}

/// The portable kernels against transformers (the reference the other paths are held to).
#[test]
fn isa_portable_matches_transformers() {
    let portable = CpuBackend::new().on_isa(Isa::Portable).unwrap();
    check_fixture_on(portable, "tiny-gqa", 16, usize::MAX, &|abs, _| {
        abs <= F32_TOLERANCE
    });
    check_fixture_on(portable, "tiny-gqa-bf16", 16, usize::MAX, &|_, rel| {
        rel <= BF16_RELATIVE_TOLERANCE
    });
}

#[test]
#[cfg_attr(
    not(pd_host_amx),
    ignore = "this host has no AMX (amx_bf16, amx_tile) with AVX-512: the amx path cannot run here"
)]
fn isa_amx_matches_portable_and_transformers() {
    isa_conformance(Isa::Amx);
}
