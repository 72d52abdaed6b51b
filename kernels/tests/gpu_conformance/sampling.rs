//! Token choice on the device (`sample_rows`) against the CPU backend's sampler.

use pd_engine::backend::Backend;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::executor::ExecItem;
use pd_kernels::CudaBackend;

use super::{enabled, executor, files, unit};

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

#[test]
fn sampling_on_the_device_chooses_the_cpu_backends_tokens() {
    use pd_engine::backend::cpu::CpuTensor;
    use pd_engine::sampling::{DeviceSampleRow, DeviceSampling};
    use pd_kernels::cuda::CudaTensor;

    if !enabled("sampling_on_the_device_chooses_the_cpu_backends_tokens") {
        return;
    }
    let vocab = 151_936;
    let rows = sampling_rows(vocab);
    let data: Vec<f32> = rows.concat();
    let cpu_logits = CpuTensor::from_vec(rows.len(), vocab, data.clone());
    let gpu = CudaBackend::open(0, 0.5).expect("cuda:0");
    let gpu_logits = CudaTensor::new(
        rows.len(),
        vocab,
        gpu.device().stream.clone_htod(&data).expect("upload"),
    );
    let mut s = 7u64;
    let mut requests = Vec::new();
    for row in 0..rows.len() {
        requests.push(DeviceSampleRow {
            row,
            method: DeviceSampling::Greedy,
        });
        for k in [1u32, 2, 20, 64] {
            for (t, top_p) in [(0.7f32, 1.0f32), (1.5, 0.9), (0.05, 0.3), (1.0, 1e-6)] {
                requests.push(DeviceSampleRow {
                    row,
                    method: DeviceSampling::TopK {
                        k,
                        inv_temperature: 1.0 / t,
                        top_p,
                        uniform: unit(&mut s),
                    },
                });
            }
        }
    }
    let cpu = CpuBackend::new();
    for limit in [vocab, 151_669] {
        let c = cpu.sample(&cpu_logits, &requests, limit);
        let g = gpu.sample(&gpu_logits, &requests, limit);
        for ((req, c), g) in requests.iter().zip(&c).zip(&g) {
            assert_eq!(
                (c.token_id, c.used_draw),
                (g.token_id, g.used_draw),
                "{req:?} limit {limit}"
            );
            let same = c.logprob == g.logprob
                || (c.logprob.is_nan() && g.logprob.is_nan())
                || (c.logprob - g.logprob).abs() <= 1e-4;
            assert!(same, "{req:?}: logprob {} vs {}", c.logprob, g.logprob);
        }
    }
}

#[test]
fn executor_sampling_on_the_device_equals_host_sampling_of_the_same_logits() {
    use pd_engine::executor::StepOutput;
    use pd_engine::sampling::{Sampler, SamplingParams};

    if !enabled("executor_sampling_on_the_device_equals_host_sampling_of_the_same_logits") {
        return;
    }
    let files = files("synthetic:tiny");
    let params = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            ..Default::default()
        },
    ];
    let steps = 12;
    let run = |on_device: bool| -> Vec<Vec<u32>> {
        let blocks = 2 * 4 + 1;
        let mut gpu = executor(CudaBackend::open(0, 0.5).expect("cuda:0"), &files, blocks);
        let tables: Vec<Vec<u32>> = (0..2u32).map(|s| (s * 4..s * 4 + 4).collect()).collect();
        let mut tokens: Vec<Vec<u32>> = (0..2u32)
            .map(|s| (0..10).map(|i| (i * 97 + s * 13 + 1) % 150_000).collect())
            .collect();
        let mut samplers: Vec<Sampler> = params.iter().map(|p| Sampler::new(p, 5, &[])).collect();
        let mut computed = [0usize; 2];
        for _ in 0..steps {
            let items: Vec<ExecItem<'_>> = (0..2)
                .map(|i| ExecItem {
                    tokens: &tokens[i][computed[i]..],
                    start: computed[i],
                    block_table: &tables[i],
                    all_logits: false,
                })
                .collect();
            let outs: Vec<StepOutput> = if on_device {
                let plans: Vec<_> = samplers
                    .iter()
                    .zip(&tokens)
                    .map(|(s, t)| s.device_plan(t.len() - 10))
                    .collect();
                gpu.execute_sampling(&items, &plans, usize::MAX)
            } else {
                gpu.execute(&items)
                    .into_iter()
                    .map(StepOutput::Logits)
                    .collect()
            };
            for (i, out) in outs.into_iter().enumerate() {
                computed[i] = tokens[i].len();
                let t = match out {
                    StepOutput::Sampled(s) => samplers[i].accept(s),
                    StepOutput::Logits(m) => {
                        assert!(!on_device, "both requests qualify for the device");
                        samplers[i].sample(m.row(0), &[], &[])
                    }
                };
                tokens[i].push(t.token_id);
            }
        }
        tokens
    };
    assert_eq!(run(false), run(true));
}
