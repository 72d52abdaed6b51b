//! Sampling on the backend, routed by the executor: a batch of requests with mixed sampling
//! parameters generates the same tokens (and log-probabilities) whether each step's tokens
//! are chosen by the backend ([`Executor::execute_sampling`] + [`Sampler::accept`]) or from
//! host logits ([`Executor::execute`] + [`Sampler::sample`]), for the same seeds.

use std::path::Path;

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::{ExecItem, Executor, StepOutput};
use pd_engine::model::Qwen3;
use pd_engine::sampling::{SampledToken, Sampler, SamplingParams};
use pd_engine::weights::Checkpoint;

const BS: usize = 4;
/// The fixture's tokenizer knows fewer ids than the model's vocabulary: the engine masks
/// the rest, the backend path cuts them off.
const VOCAB_LIMIT: usize = 380;

fn executor() -> Executor<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa");
    let mc = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Qwen3::load(&CpuBackend::new(), &ckpt, &mc, &mut |_, _| {}).unwrap();
    Executor::new(CpuBackend::new(), model, BS, 64).unwrap()
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    blocks: Vec<u32>,
    sampler: Sampler,
    prompt_logprobs: bool,
}

fn seqs(params: &[SamplingParams]) -> Vec<Seq> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| Seq {
            tokens: (0..9 + i as u32)
                .map(|t| (t * 37 + i as u32 * 11) % 390)
                .collect(),
            prompt_len: 9 + i,
            computed: 0,
            blocks: (i as u32 * 8..i as u32 * 8 + 8).collect(),
            sampler: Sampler::new(p, 1000 + i as u64, &[]),
            prompt_logprobs: i == 0,
        })
        .collect()
}

fn host_sample(seq: &mut Seq, logits: &[f32]) -> SampledToken {
    let mut row = logits.to_vec();
    row[VOCAB_LIMIT..].fill(f32::NEG_INFINITY);
    let (prompt, output) = seq.tokens.split_at(seq.prompt_len);
    seq.sampler.sample(&row, prompt, output)
}

/// Generates `steps` tokens for every sequence, batched; `on_backend` picks the path.
fn generate(params: &[SamplingParams], steps: usize, on_backend: bool) -> Vec<Vec<SampledToken>> {
    let mut exec = executor();
    let mut seqs = seqs(params);
    let mut out = vec![Vec::new(); seqs.len()];
    let mut device_rows = 0;
    for _ in 0..steps {
        let plans: Vec<_> = seqs
            .iter_mut()
            .map(|s| {
                let (prompt, output) = s.tokens.split_at(s.prompt_len);
                s.sampler.device_plan(prompt, output, VOCAB_LIMIT)
            })
            .collect();
        let items: Vec<ExecItem<'_>> = seqs
            .iter()
            .map(|s| ExecItem {
                tokens: &s.tokens[s.computed..],
                start: s.computed,
                block_table: &s.blocks,
                all_logits: s.prompt_logprobs && s.computed == 0,
            })
            .collect();
        let results: Vec<StepOutput> = if on_backend {
            exec.execute_sampling(&items, &plans, VOCAB_LIMIT)
        } else {
            exec.execute(&items)
                .into_iter()
                .map(StepOutput::Logits)
                .collect()
        };
        for ((seq, result), out) in seqs.iter_mut().zip(results).zip(&mut out) {
            seq.computed = seq.tokens.len();
            let token = match result {
                StepOutput::Sampled(s) => {
                    device_rows += 1;
                    seq.sampler.accept(s)
                }
                StepOutput::Logits(m) => host_sample(seq, m.row(m.rows - 1)),
            };
            seq.tokens.push(token.token_id);
            out.push(token);
        }
    }
    if on_backend {
        // Greedy, top-k and penalised requests after their first step: the backend chose
        // them.
        assert!(
            device_rows >= 4 * (steps - 1),
            "{device_rows} rows on the backend"
        );
    }
    out
}

#[test]
fn backend_sampling_gives_the_host_samplers_tokens_for_the_same_seeds() {
    let params = [
        // Prompt logprobs on its first step: host logits, then the backend.
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.5,
            top_k: 64,
            ..Default::default()
        },
        // Penalties, a bias and a mask as edits on the backend.
        SamplingParams {
            temperature: 1.1,
            top_k: 30,
            repetition_penalty: 1.3,
            presence_penalty: 1.5,
            frequency_penalty: 0.5,
            logit_bias: vec![(5, 4.0)],
            bad_words_token_ids: vec![vec![6]],
            ..Default::default()
        },
        // Host-only features in the same batch.
        SamplingParams {
            temperature: 1.0,
            min_p: 0.05,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.8,
            repetition_penalty: 1.2,
            top_k: 10,
            logprobs: Some(2),
            ..Default::default()
        },
    ];
    let steps = 12;
    let host = generate(&params, steps, false);
    let device = generate(&params, steps, true);
    assert_eq!(host, device);
    // The sampling requests really sampled (not a constant stream).
    for seq in &host[1..4] {
        let first = seq[0].token_id;
        assert!(seq.iter().any(|t| t.token_id != first));
    }
}
