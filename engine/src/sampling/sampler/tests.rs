use super::super::truncation::tests::{logits, sorted_desc};
use super::*;

#[test]
fn top_k_paths_keep_exactly_k_best() {
    let l = logits(3000, 42);
    for k in [1u32, 50, 64, 65, 500] {
        let mut s = Sampler::new(
            &SamplingParams {
                temperature: 1.0,
                top_k: k,
                ..Default::default()
            },
            1,
            &[],
        );
        let best: Vec<u32> = sorted_desc(&l)[..k as usize].to_vec();
        for _ in 0..50 {
            let t = s.sample(&l, &[], &[]).token_id;
            assert!(best.contains(&t));
        }
        if k as usize <= SMALL_TOP_K {
            assert_eq!(s.bufs.candidates, best, "k {k}");
        } else {
            let kept: Vec<u32> = (0..l.len() as u32)
                .filter(|&i| s.bufs.dense[i as usize] > 0.0)
                .collect();
            let mut sorted_best = best.clone();
            sorted_best.sort();
            assert_eq!(kept, sorted_best, "k {k}");
        }
    }
}

#[test]
fn repetition_penalty_stamp_wraps() {
    let mut seen = Vec::new();
    let mut stamp = u32::MAX;
    let mut l = vec![2.0f32, -2.0, 1.0];
    apply_repetition_penalty(&mut l, &mut seen, &mut stamp, 2.0, &[0, 0, 9], &[1, 0]);
    assert_eq!(stamp, 1);
    assert_eq!(l, vec![1.0, -4.0, 1.0]);
}

#[test]
fn no_allocation_growth_after_first_step() {
    let l = logits(10_000, 3);
    let mut s = Sampler::new(
        &SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            repetition_penalty: 1.1,
            frequency_penalty: 0.5,
            presence_penalty: -0.5,
            min_tokens: 4,
            stop_token_ids: vec![7],
            ..Default::default()
        },
        9,
        &[8],
    );
    let caps = |s: &Sampler| {
        (
            s.penalty.logits.capacity(),
            s.penalty.seen.capacity(),
            s.penalty.counts.capacity(),
            s.penalty.counted.capacity(),
            s.bufs.dense.capacity(),
            s.bufs.candidates.capacity(),
            s.bufs.hist.capacity(),
            s.bufs.boundary.capacity(),
        )
    };
    s.sample(&l, &[1, 2, 3], &[4]);
    let first = caps(&s);
    for _ in 0..20 {
        s.sample(&l, &[1, 2, 3], &[4]);
    }
    assert_eq!(first, caps(&s));
}

/// A sampler that starts at output token `k` (a decode node, or a request resumed on another
/// node after a failure) draws what one sampler that made the first `k` tokens itself draws.
#[test]
fn a_draw_depends_on_the_seed_and_the_tokens_place_only() {
    let params = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        ..Default::default()
    };
    let rows: Vec<Vec<f32>> = (0..12).map(|i| logits(2000, 100 + i)).collect();
    let mut whole = Sampler::new(&params, 7, &[]);
    let mut output = Vec::new();
    for row in &rows {
        output.push(whole.sample(row, &[5, 6], &output).token_id);
    }
    for k in [1usize, 5, 11] {
        let mut resumed = Sampler::new(&params, 7, &[]);
        let mut tail = output[..k].to_vec();
        for row in &rows[k..] {
            tail.push(resumed.sample(row, &[5, 6], &tail).token_id);
        }
        assert_eq!(tail, output, "resumed at output token {k}");
    }
    // Not a constant: another seed draws another stream.
    let mut other = Sampler::new(&params, 8, &[]);
    let mut theirs = Vec::new();
    for row in &rows {
        theirs.push(other.sample(row, &[5, 6], &theirs).token_id);
    }
    assert_ne!(theirs, output);
}

/// Past `vocab_limit` (the checkpoint's padding columns) nothing is sampled or listed, yet
/// every logprob is normalized over the whole row, host and device reference alike.
#[test]
fn padding_columns_count_in_logprobs_but_are_never_chosen_or_listed() {
    let mut row = logits(1000, 9);
    let limit = 900;
    // The padding columns hold the row's best logits: a renormalized or uncut row shows.
    row[limit..].fill(20.0);
    let lse = log_sum_exp(&row);
    for temperature in [0.0, 1.0] {
        let params = SamplingParams {
            temperature,
            logprobs: Some(5),
            ..Default::default()
        };
        let mut s = Sampler::new(&params, 3, &[]);
        for _ in 0..20 {
            let t = s.sample_within(&row, limit, &[], &[]);
            assert!((t.token_id as usize) < limit);
            let want = raw_logprob(row[t.token_id as usize], lse);
            assert!((t.logprob - want).abs() < 1e-6, "{} vs {want}", t.logprob);
            assert_eq!(t.top.len(), 5);
            assert!(t.top.iter().all(|a| (a.token_id as usize) < limit));
            assert!(t.top[0].logprob < -10.0, "listed against the whole row");
        }
    }
    let p = super::super::prompt::prompt_logprobs_within(&row, limit, 7, 3);
    assert!((p.logprob - raw_logprob(row[7], lse)).abs() < 1e-6);
    assert!(p.top.iter().all(|a| (a.token_id as usize) < limit));
    let greedy = super::super::device::DeviceSampleRow {
        row: 0,
        method: super::super::device::DeviceSampling::Greedy,
        reshape: None,
        top_logprobs: 3,
    };
    let d = super::super::device::sample_row_within(&row, limit, &greedy);
    assert!(d.top.iter().all(|a| (a.token_id as usize) < limit));
    assert!((d.token_id as usize) < limit);
    assert!((d.logprob - raw_logprob(row[d.token_id as usize], lse)).abs() < 1e-6);
}
