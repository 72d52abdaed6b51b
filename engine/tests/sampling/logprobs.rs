//! Logprobs: raw log-softmax values, the ordered top-K list, and prompt logprobs.

use pd_engine::sampling::{MAX_LOGPROBS, Sampler, SamplingParams, prompt_logprobs};

use crate::{VOCAB, argmax, log_softmax, params, spread_logits};

#[test]
fn logprobs_are_raw_log_softmax_and_top_is_ordered() {
    let l = spread_logits(VOCAB, 3);
    let expect = log_softmax(&l);
    let total: f64 = (0..VOCAB as u32)
        .map(|t| (prompt_logprobs(&l, t, 0).logprob as f64).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-4, "sum of probabilities {total}");
    for t in [0u32, 17, 999] {
        let lp = prompt_logprobs(&l, t, 0).logprob as f64;
        assert!((lp - expect[t as usize]).abs() < 1e-4);
    }

    // Temperature, top-k and the penalty do not change the reported values.
    let p = SamplingParams {
        temperature: 0.3,
        top_k: 5,
        repetition_penalty: 1.3,
        logprobs: Some(MAX_LOGPROBS),
        ..params()
    };
    let mut s = Sampler::new(&p, 5, &[]);
    for _ in 0..20 {
        let t = s.sample(&l, &[1, 2], &[3]);
        assert!((t.logprob as f64 - expect[t.token_id as usize]).abs() < 1e-4);
        assert_eq!(t.top.len(), MAX_LOGPROBS as usize);
        let mut order: Vec<u32> = (0..VOCAB as u32).collect();
        order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        let ids: Vec<u32> = t.top.iter().map(|x| x.token_id).collect();
        assert_eq!(ids, order[..MAX_LOGPROBS as usize]);
        assert!(t.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        for x in &t.top {
            assert!((x.logprob as f64 - expect[x.token_id as usize]).abs() < 1e-4);
        }
    }
    // Ties in `top` go to the lower id; K larger than the vocabulary is clamped.
    let p = SamplingParams {
        logprobs: Some(3),
        ..params()
    };
    let t = Sampler::new(&p, 0, &[]).sample(&[1.0, 2.0, 2.0, 0.0, 2.0], &[], &[]);
    let ids: Vec<u32> = t.top.iter().map(|x| x.token_id).collect();
    assert_eq!(ids, vec![1, 2, 4]);
    let t = Sampler::new(
        &SamplingParams {
            logprobs: Some(20),
            ..params()
        },
        0,
        &[],
    )
    .sample(&[1.0, 2.0], &[], &[]);
    assert_eq!(t.top.len(), 2);
    // No logprobs requested: no top list.
    assert!(
        Sampler::new(&params(), 0, &[])
            .sample(&l, &[], &[])
            .top
            .is_empty()
    );
    let t = Sampler::new(
        &SamplingParams {
            logprobs: Some(0),
            ..params()
        },
        0,
        &[],
    )
    .sample(&l, &[], &[]);
    assert!(t.top.is_empty());
    assert!((t.logprob as f64 - expect[argmax(&l) as usize]).abs() < 1e-4);
}

#[test]
fn prompt_logprobs_reports_next_token_and_top() {
    let l = [0.0f32, 1.0, 2.0, 3.0];
    let expect = log_softmax(&l);
    let p = prompt_logprobs(&l, 1, 2);
    assert_eq!(p.token_id, 1);
    assert!((p.logprob as f64 - expect[1]).abs() < 1e-6);
    let ids: Vec<u32> = p.top.iter().map(|x| x.token_id).collect();
    assert_eq!(ids, vec![3, 2]);
    assert_eq!(prompt_logprobs(&l, 9, 0).logprob, f32::NEG_INFINITY);
}
