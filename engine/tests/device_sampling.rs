//! Sampling on the backend, routed by the executor: a batch of requests with mixed sampling
//! parameters generates the same tokens (and log-probabilities) whether each step's tokens
//! are chosen by the backend ([`Executor::execute_sampling`] + [`Sampler::accept`]) or from
//! host logits ([`Executor::execute`] + [`Sampler::sample`]), for the same seeds, and the
//! prompt is scored alike by the backend and from host logits.

use std::path::Path;

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::{ExecItem, Executor, ItemWants, NextToken, PromptScoring, StepOutput};
use pd_engine::model::Qwen3;
use pd_engine::sampling::{
    PromptLogprob, SampledToken, Sampler, SamplingParams, prompt_logprobs_within,
};
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
    let (prompt, output) = seq.tokens.split_at(seq.prompt_len);
    seq.sampler
        .sample_within(logits, VOCAB_LIMIT, prompt, output)
}

/// Alternatives listed per scored prompt position.
const PROMPT_TOP: u32 = 3;

/// What one request got: its tokens, and its prompt's scores if it asked for them.
type Generated = (Vec<SampledToken>, Vec<PromptLogprob>);

/// Generates `steps` tokens for every sequence, batched; `on_backend` picks the path.
fn generate(params: &[SamplingParams], steps: usize, on_backend: bool) -> Vec<Generated> {
    let mut exec = executor();
    let mut seqs = seqs(params);
    let mut out: Vec<Generated> = vec![Default::default(); seqs.len()];
    let mut device_rows = 0;
    for _ in 0..steps {
        let plans: Vec<_> = seqs
            .iter_mut()
            .map(|s| {
                let (prompt, output) = s.tokens.split_at(s.prompt_len);
                s.sampler.device_plan(prompt, output, VOCAB_LIMIT)
            })
            .collect();
        let scoring = |s: &Seq| s.prompt_logprobs && s.computed == 0;
        let items: Vec<ExecItem<'_>> = seqs
            .iter()
            .map(|s| ExecItem {
                tokens: &s.tokens[s.computed..],
                start: s.computed,
                block_table: &s.blocks,
                all_logits: !on_backend && scoring(s),
            })
            .collect();
        let results: Vec<StepOutput> = if on_backend {
            let wants: Vec<ItemWants<'_>> = seqs
                .iter()
                .zip(plans)
                .map(|(s, plan)| ItemWants {
                    prompt: scoring(s).then(|| PromptScoring {
                        first: 0,
                        next_tokens: &s.tokens[1..s.prompt_len],
                        top: PROMPT_TOP,
                    }),
                    next: NextToken::sample(plan),
                })
                .collect();
            let outputs = exec.execute_sampling(&items, &wants, VOCAB_LIMIT);
            outputs
                .into_iter()
                .zip(&mut out)
                .map(|(o, out)| {
                    out.1.extend(o.prompt_logprobs);
                    o.next.expect("every item samples")
                })
                .collect()
        } else {
            let rows = exec.execute(&items);
            for ((s, m), out) in seqs.iter().zip(&rows).zip(&mut out) {
                if scoring(s) {
                    out.1.extend((0..s.prompt_len - 1).map(|r| {
                        prompt_logprobs_within(m.row(r), VOCAB_LIMIT, s.tokens[r + 1], PROMPT_TOP)
                    }));
                }
            }
            rows.into_iter().map(StepOutput::Logits).collect()
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
            out.0.push(token);
        }
    }
    if on_backend {
        // Every row, the scored prompt's first token included: the backend chose them.
        assert_eq!(
            device_rows,
            seqs.len() * steps,
            "rows chosen on the backend"
        );
    }
    out
}

#[test]
fn backend_sampling_gives_the_host_samplers_tokens_for_the_same_seeds() {
    let params = [
        // Greedy, with its prompt scored on its first step.
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
    // The whole prompt was scored, with its alternatives.
    assert_eq!(host[0].1.len(), 8);
    assert!(host[0].1.iter().all(|p| p.top.len() == PROMPT_TOP as usize));
    assert!(host[1..].iter().all(|(_, prompt)| prompt.is_empty()));
    // The sampling requests really sampled (not a constant stream).
    for (seq, _) in &host[1..4] {
        let first = seq[0].token_id;
        assert!(seq.iter().any(|t| t.token_id != first));
    }
}
