//! Token choice on the device (`sample_rows`, `sample_dense`) and prompt scoring
//! (`prompt_logprobs`) against the CPU backend.

use pd_engine::backend::Backend;
use pd_engine::backend::cpu::{CpuBackend, CpuTensor};
use pd_engine::executor::ExecItem;
use pd_kernels::CudaBackend;
use pd_kernels::cuda::CudaTensor;

use super::{executor, files, unit};

/// Logits rows that exercise the sampler's edge cases: spread, peaked, heavily tied (ties at
/// the k-th place), NaN / -inf holes, ±0 ties, all -inf, and a +inf.
fn sampling_rows(vocab: usize) -> Vec<Vec<f32>> {
    let mut s = 42u64;
    let mut rows = Vec::new();
    for kind in 0..9 {
        let mut row: Vec<f32> = (0..vocab)
            .map(|_| (unit(&mut s) * 16.0 - 8.0) as f32)
            .collect();
        match kind {
            1 => row[vocab / 3] = 30.0,
            2 => row.iter_mut().for_each(|x| *x = (*x * 0.5).round()),
            3 => row.iter_mut().for_each(|x| *x = (*x * 2.0).round() / 2.0),
            4 => {
                for i in (0..vocab).step_by(17) {
                    row[i] = if i % 2 == 0 {
                        f32::NAN
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
            5 => {
                row.iter_mut().for_each(|x| *x = x.min(-1.0));
                row[7] = -0.0;
                row[3] = 0.0;
                row[vocab - 1] = -0.0;
            }
            6 => row.fill(f32::NEG_INFINITY),
            7 => row[11] = f32::INFINITY,
            _ => {}
        }
        rows.push(row);
    }
    rows
}

/// Qwen3's logits columns.
const VOCAB: usize = 151_936;

/// The edge-case rows of [`sampling_rows`] as logits on both backends: (rows, CPU logits,
/// the GPU backend, GPU logits).
fn edge_case_logits() -> (Vec<Vec<f32>>, CpuTensor, CudaBackend, CudaTensor) {
    let rows = sampling_rows(VOCAB);
    let data: Vec<f32> = rows.concat();
    let cpu_logits = CpuTensor::from_vec(rows.len(), VOCAB, data.clone());
    let gpu = CudaBackend::open(0, 0.5).expect("cuda:0");
    let gpu_logits = CudaTensor::new(
        rows.len(),
        VOCAB,
        gpu.device().stream.clone_htod(&data).expect("upload"),
    );
    (rows, cpu_logits, gpu, gpu_logits)
}

/// Log-probabilities equal up to the device's summation order (NaN equal to NaN).
fn close(a: f32, b: f32) -> bool {
    a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-4
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn sampling_on_the_device_chooses_the_cpu_backends_tokens() {
    use pd_engine::sampling::device::edit;
    use pd_engine::sampling::{DeviceSampleRow, DeviceSampling, Reshape, TokenEdit};

    let vocab = VOCAB;
    let (rows, cpu_logits, gpu, gpu_logits) = edge_case_logits();
    let mut s = 7u64;
    // Logits processors as edits: penalties on ids around the hot spots of the rows above
    // (3, 7, 11, vocab / 3), a bias lifting an id to the top, masks on the best ids, and an
    // allowed list (with one id past the tokenizer's 151,669).
    let hot = [3u32, 7, 11, 12, 40, (vocab / 3) as u32, 151_700];
    let reshape = |allowed_only: bool, repetition: f32, presence: f32, salt: u32| Reshape {
        allowed_only,
        repetition_penalty: repetition,
        presence_penalty: presence,
        edits: hot
            .iter()
            .enumerate()
            .map(|(j, &id)| TokenEdit {
                id,
                ops: [
                    edit::REPEAT | edit::OUTPUT,
                    edit::ALLOWED | edit::BIAS,
                    edit::MASK,
                    edit::ALLOWED | edit::REPEAT,
                    edit::BIAS | edit::REPEAT | edit::OUTPUT,
                ][(j + salt as usize) % 5],
                bias: [31.0, -7.25, 0.1][(j + salt as usize) % 3],
                frequency: 0.75 * (j as f32 + 1.0),
            })
            .collect(),
    };
    let reshapes = [
        reshape(false, 1.3, 0.5, 0),
        reshape(false, 0.7, -1.25, 1),
        reshape(true, 1.1, 2.0, 2),
        reshape(true, 1.0, 0.0, 3),
        reshape(false, 2.0, 0.0, 4),
    ];
    // Top log-probabilities on some requests: none, one, a few, the most allowed.
    let top_n = |i: usize| [0u32, 0, 1, 5, 20][i % 5];
    let mut requests = Vec::new();
    for row in 0..rows.len() {
        for (s_i, shape) in std::iter::once(None)
            .chain(reshapes.iter().map(Some))
            .enumerate()
        {
            // The dense path (no top-k, or above 64): the raw rows and one allowed list.
            if s_i == 0 || s_i == 3 {
                for top_k in [0u32, 100, 1000] {
                    for (t, top_p, min_p) in [
                        (1.0f32, 1.0f32, 0.0f32),
                        (0.7, 0.9, 0.0),
                        (0.05, 0.95, 0.0),
                        (1.5, 0.5, 0.05),
                        (2.0, 1.0, 0.1),
                    ] {
                        requests.push(DeviceSampleRow {
                            row,
                            method: DeviceSampling::Dense {
                                top_k,
                                inv_temperature: 1.0 / t,
                                top_p,
                                min_p_margin: if min_p > 0.0 {
                                    t * min_p.ln()
                                } else {
                                    f32::NEG_INFINITY
                                },
                                uniform: unit(&mut s),
                            },
                            reshape: shape,
                            top_logprobs: top_n(requests.len()),
                        });
                    }
                }
            }
            requests.push(DeviceSampleRow {
                row,
                method: DeviceSampling::Greedy,
                reshape: shape,
                top_logprobs: top_n(requests.len()),
            });
            for k in [1u32, 2, 20, 64] {
                for (t, top_p, min_p) in [
                    (0.7f32, 1.0f32, 0.0f32),
                    (1.5, 0.9, 0.0),
                    (0.05, 0.3, 0.0),
                    (1.0, 1e-6, 0.0),
                    (1.0, 1.0, 0.05),
                    (2.0, 0.8, 0.5),
                ] {
                    requests.push(DeviceSampleRow {
                        row,
                        method: DeviceSampling::TopK {
                            k,
                            inv_temperature: 1.0 / t,
                            top_p,
                            min_p_margin: if min_p > 0.0 {
                                t * min_p.ln()
                            } else {
                                f32::NEG_INFINITY
                            },
                            uniform: unit(&mut s),
                        },
                        reshape: shape,
                        top_logprobs: top_n(requests.len()),
                    });
                }
            }
        }
    }
    let cpu = CpuBackend::new();
    let mut handed_back = 0;
    for limit in [vocab, 151_669] {
        let c = cpu.sample(&cpu_logits, &requests, limit);
        let g = gpu.sample(&gpu_logits, &requests, limit);
        for ((req, c), g) in requests.iter().zip(&c).zip(&g) {
            assert_eq!(
                (c.token_id, c.used_draw, c.needs_host),
                (g.token_id, g.used_draw, g.needs_host),
                "{req:?} limit {limit}"
            );
            // A row handed back carries no log-probability.
            let same = c.needs_host || close(c.logprob, g.logprob);
            assert!(same, "{req:?}: logprob {} vs {}", c.logprob, g.logprob);
            if !c.needs_host {
                let ids = |s: &pd_engine::sampling::DeviceSample| {
                    s.top.iter().map(|t| t.token_id).collect::<Vec<_>>()
                };
                assert_eq!(ids(c), ids(g), "{req:?}: top log-probabilities");
                for (a, b) in c.top.iter().zip(&g.top) {
                    assert!(close(a.logprob, b.logprob), "{req:?}: {a:?} vs {b:?}");
                }
            }
            handed_back += usize::from(c.needs_host);
        }
    }
    let dense = requests
        .iter()
        .filter(|r| matches!(r.method, DeviceSampling::Dense { .. }))
        .count();
    // Both outcomes of a dense top-p occur: the flat rows come back, peaked ones do not.
    assert!(
        handed_back > 0 && handed_back < dense,
        "{handed_back} of {dense}"
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn prompt_logprobs_on_the_device_equal_the_cpu_backends() {
    use pd_engine::sampling::{PromptLogprob, PromptLogprobRow};

    let vocab = VOCAB;
    let (rows, cpu_logits, gpu, gpu_logits) = edge_case_logits();
    // Next tokens: ordinary ids, the hot spots of the rows (the peak, a NaN and a -inf hole,
    // ±0, +inf), the last column, and ids past the tokenizer's 151,669 and past the row.
    let next = [
        5u32,
        11,
        17,
        34,
        3,
        7,
        (vocab / 3) as u32,
        151_700,
        151_935,
        160_000,
    ];
    let mut scored = Vec::new();
    for row in 0..rows.len() {
        for (j, &next_token) in next.iter().enumerate() {
            scored.push(PromptLogprobRow {
                row,
                next_token,
                top: [0u32, 1, 5, 20][(row + j) % 4],
            });
        }
    }
    let cpu = CpuBackend::new();
    for limit in [vocab, 151_669] {
        let c = cpu.prompt_logprobs(&cpu_logits, &scored, limit);
        let g = gpu.prompt_logprobs(&gpu_logits, &scored, limit);
        assert_eq!(c.len(), g.len());
        for ((r, c), g) in scored.iter().zip(&c).zip(&g) {
            let ids = |p: &PromptLogprob| p.top.iter().map(|t| t.token_id).collect::<Vec<_>>();
            assert_eq!(
                (c.token_id, ids(c)),
                (g.token_id, ids(g)),
                "{r:?} limit {limit}"
            );
            assert!(
                close(c.logprob, g.logprob),
                "{r:?} limit {limit}: {c:?} vs {g:?}"
            );
            for (a, b) in c.top.iter().zip(&g.top) {
                assert!(
                    close(a.logprob, b.logprob),
                    "{r:?} limit {limit}: {c:?} vs {g:?}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn executor_sampling_on_the_device_equals_host_sampling_of_the_same_logits() {
    use pd_engine::executor::{ItemWants, NextToken, PromptScoring, StepOutput};
    use pd_engine::sampling::{PromptLogprob, Sampler, SamplingParams, prompt_logprobs};

    let files = files("synthetic:tiny");
    let params = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            logprobs: Some(4),
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 40,
            min_p: 0.02,
            repetition_penalty: 1.4,
            presence_penalty: 1.5,
            frequency_penalty: 0.5,
            logit_bias: vec![(77, 3.0)],
            bad_words_token_ids: vec![vec![5]],
            ..Default::default()
        },
        // The dense path: top-p without a top-k, and a top-k above 64.
        SamplingParams {
            temperature: 0.6,
            top_p: 0.9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 200,
            min_p: 0.05,
            ..Default::default()
        },
    ];
    let n = params.len();
    let steps = 12;
    // Request 1 also has its prompt scored, on the first step.
    let scored = 1;
    let run = |on_device: bool| -> (Vec<Vec<u32>>, Vec<PromptLogprob>) {
        let blocks = n * 4 + 1;
        let mut gpu = executor(CudaBackend::open(0, 0.5).expect("cuda:0"), &files, blocks);
        let tables: Vec<Vec<u32>> = (0..n as u32)
            .map(|s| (s * 4..s * 4 + 4).collect())
            .collect();
        let mut tokens: Vec<Vec<u32>> = (0..n as u32)
            .map(|s| (0..10).map(|i| (i * 97 + s * 13 + 1) % 150_000).collect())
            .collect();
        let mut samplers: Vec<Sampler> = params.iter().map(|p| Sampler::new(p, 5, &[])).collect();
        let mut computed = vec![0usize; n];
        let mut scores = Vec::new();
        for _ in 0..steps {
            let plans: Vec<_> = samplers
                .iter_mut()
                .zip(&tokens)
                .map(|(s, t)| s.device_plan(&t[..10], &t[10..], 151_936))
                .collect();
            let items: Vec<ExecItem<'_>> = (0..n)
                .map(|i| ExecItem {
                    tokens: &tokens[i][computed[i]..],
                    start: computed[i],
                    block_table: &tables[i],
                    all_logits: !on_device && i == scored && computed[i] == 0,
                })
                .collect();
            let outs: Vec<StepOutput> = if on_device {
                let wants: Vec<ItemWants<'_>> = plans
                    .into_iter()
                    .enumerate()
                    .map(|(i, plan)| ItemWants {
                        prompt: (i == scored && computed[i] == 0).then(|| PromptScoring {
                            first: 0,
                            next_tokens: &tokens[i][1..10],
                            top: 5,
                        }),
                        next: NextToken::sample(plan),
                    })
                    .collect();
                let outs = gpu.execute_sampling(&items, &wants, usize::MAX);
                outs.into_iter()
                    .map(|o| {
                        scores.extend(o.prompt_logprobs);
                        o.next.expect("every item samples")
                    })
                    .collect()
            } else {
                let rows = gpu.execute(&items);
                if computed[scored] == 0 {
                    let m = &rows[scored];
                    let t = &tokens[scored];
                    scores.extend((0..9).map(|r| prompt_logprobs(m.row(r), t[r + 1], 5)));
                }
                rows.into_iter().map(StepOutput::Logits).collect()
            };
            for (i, out) in outs.into_iter().enumerate() {
                computed[i] = tokens[i].len();
                let t = match out {
                    StepOutput::Sampled(s) => samplers[i].accept(s),
                    StepOutput::Logits(m) => {
                        // Only a dense top-p over more than 8,192 tokens comes back.
                        assert!(!on_device || i == 3, "request {i} qualifies for the device");
                        let (prompt, output) = tokens[i].split_at(10);
                        samplers[i].sample(m.row(m.rows - 1), prompt, output)
                    }
                };
                tokens[i].push(t.token_id);
            }
        }
        (tokens, scores)
    };
    let (host_tokens, host_prompt) = run(false);
    let (device_tokens, device_prompt) = run(true);
    assert_eq!(host_tokens, device_tokens);
    assert_eq!(
        host_prompt.len(),
        9,
        "every prompt position after the first"
    );
    let ids = |p: &[PromptLogprob]| {
        p.iter()
            .map(|l| {
                (
                    l.token_id,
                    l.top.iter().map(|t| t.token_id).collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&host_prompt), ids(&device_prompt));
    for (h, d) in host_prompt.iter().zip(&device_prompt) {
        assert!((h.logprob - d.logprob).abs() <= 1e-4, "{h:?} vs {d:?}");
    }
}
