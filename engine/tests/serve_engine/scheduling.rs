//! Scheduling: batching, chunked prefill, one sequence at a time and preemption all give the
//! same tokens; requests the engine must refuse; the engine thread streaming events and
//! aborting requests whose receiver is gone.

use std::time::Duration;

use pd_engine::ErrorKind;
use pd_engine::executor::ExecItem;
use pd_engine::sampling::{FinishReason, PromptLogprob, prompt_logprobs_within};
use pd_engine::serve::{Engine, EngineConfig, EngineThread, RequestEvent};

use crate::{all_free, check_counters, config, drain, engine, executor, prompt, req, run_one};

/// (name, KV blocks, config) of the ways five requests of 9 to 37 tokens are scheduled:
/// batched, chunked, and preempted (14 blocks cannot hold all five at once: preemption by
/// recompute).
fn scheduling_variants() -> Vec<(&'static str, usize, EngineConfig)> {
    vec![
        ("batched", 256, config()),
        (
            "chunked",
            256,
            EngineConfig {
                max_num_batched_tokens: 5,
                ..config()
            },
        ),
        ("preempting", 14, config()),
    ]
}

#[test]
fn batching_chunking_caching_and_preemption_never_change_tokens() {
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(10 + i, 9 + 7 * i as usize)).collect();
    // Reference: one at a time, no cache, big pool.
    let mut cfg = config();
    cfg.enable_prefix_caching = false;
    let mut e = engine(256, cfg);
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| run_one(&mut e, req(&format!("r{i}"), p.clone(), 12)).tokens)
        .collect();

    let mut variants = scheduling_variants();
    variants.push((
        "one-seq",
        256,
        EngineConfig {
            max_num_seqs: 1,
            ..config()
        },
    ));
    for (name, blocks, cfg) in variants {
        let mut e = engine(blocks, cfg);
        for (i, p) in prompts.iter().enumerate() {
            e.submit(req(&format!("r{i}"), p.clone(), 12)).unwrap();
        }
        let out = drain(&mut e);
        for (i, want) in solo.iter().enumerate() {
            assert_eq!(&out[&format!("r{i}")].tokens, want, "{name}: request {i}");
        }
        let c = e.counters();
        let prompt_total: u64 = prompts.iter().map(|p| p.len() as u64).sum();
        assert_eq!(
            c.prefix_cache_queries, prompt_total,
            "{name}: each request looked up once"
        );
        assert_eq!(c.prompt_tokens(), prompt_total, "{name}");
        assert_eq!(c.generation_tokens, 60, "{name}");
        if name == "preempting" {
            assert!(c.preemptions > 0, "the small pool must preempt");
        }
        check_counters(&c);
        all_free(&e);
    }
}

#[test]
fn prompt_logprobs_are_each_positions_once_batched_chunked_and_preempted() {
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(20 + i, 9 + 7 * i as usize)).collect();
    // Scores are over the ids a tokenizer of 380 knows (the model has 400 columns; prompt
    // ids past 380 score -inf).
    const KNOWN: usize = 380;
    // Reference: every prompt row's logits on the host, scored over the tokenizer's ids.
    let mut exec = executor(64);
    let reference: Vec<Vec<PromptLogprob>> = prompts
        .iter()
        .map(|p| {
            let table: Vec<u32> = (0..p.len().div_ceil(4) as u32).collect();
            let item = ExecItem {
                tokens: p,
                start: 0,
                block_table: &table,
                all_logits: true,
            };
            let m = exec.execute(&[item]).remove(0);
            (0..p.len() - 1)
                .map(|r| prompt_logprobs_within(m.row(r), KNOWN, p[r + 1], 2))
                .collect()
        })
        .collect();
    let mut variants = scheduling_variants();
    // Preempted part-way through a chunked prompt: recomputed, scored from where it was.
    variants.push((
        "chunked-preempting",
        14,
        EngineConfig {
            max_num_batched_tokens: 7,
            ..config()
        },
    ));
    for (name, blocks, cfg) in variants {
        let mut e = Engine::new(executor(blocks), cfg, vec![399], KNOWN).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let mut r = req(&format!("r{i}"), p.clone(), 12);
            r.params.prompt_logprobs = Some(2);
            e.submit(r).unwrap();
        }
        let out = drain(&mut e);
        for (i, want) in reference.iter().enumerate() {
            let got = out[&format!("r{i}")]
                .prompt_logprobs
                .as_ref()
                .expect("prompt logprobs");
            assert_same_scores(got, want, &format!("{name}: request {i}"));
        }
        if name.ends_with("preempting") {
            assert!(
                e.counters().preemptions > 0,
                "{name}: the small pool must preempt"
            );
        }
        all_free(&e);
    }
}

/// The same positions, ids and alternatives; log-probabilities equal up to the rounding of
/// a differently batched forward pass.
fn assert_same_scores(got: &[PromptLogprob], want: &[PromptLogprob], what: &str) {
    let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-3 * b.abs().max(1.0);
    assert_eq!(got.len(), want.len(), "{what}: positions");
    for (p, (g, w)) in got.iter().zip(want).enumerate() {
        let ids = |l: &PromptLogprob| l.top.iter().map(|t| t.token_id).collect::<Vec<_>>();
        assert_eq!(
            (g.token_id, ids(g)),
            (w.token_id, ids(w)),
            "{what}: position {p}"
        );
        assert!(
            close(g.logprob, w.logprob),
            "{what}: position {p}: {g:?} vs {w:?}"
        );
        for (a, b) in g.top.iter().zip(&w.top) {
            assert!(
                close(a.logprob, b.logprob),
                "{what}: position {p}: {g:?} vs {w:?}"
            );
        }
    }
}

#[test]
fn a_request_larger_than_the_pool_is_refused_not_hung() {
    let mut e = engine(8, config());
    let err = e.submit(req("big", prompt(7, 30), 10)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(err.message.contains("pool"), "{}", err.message);
    let err = e.submit(req("bad", vec![1, 2, 400], 1)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    e.submit(req("dup", prompt(1, 3), 1)).unwrap();
    assert_eq!(
        e.submit(req("dup", prompt(1, 3), 1)).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    drain(&mut e);
    all_free(&e);
}

#[test]
fn driver_streams_events_and_aborts_when_the_receiver_is_dropped() {
    let thread = EngineThread::spawn(engine(64, config()));
    let h = thread.handle();
    let rx = h.submit(req("a", prompt(9, 12), 5));
    let mut tokens = 0;
    let finished = loop {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("events arrive")
        {
            RequestEvent::Token(_) => tokens += 1,
            RequestEvent::PromptLogprobs(_) => panic!("not asked for"),
            RequestEvent::Finished(f) => break f,
            RequestEvent::Failed(e) => panic!("{e}"),
        }
    };
    assert_eq!((tokens, finished.reason), (5, FinishReason::Length));
    let bad = h.submit(req("b", vec![], 5));
    assert!(
        matches!(bad.recv().unwrap(), RequestEvent::Failed(e) if e.kind == ErrorKind::InvalidArgument)
    );
    // A client that goes away: its request is aborted and its blocks return.
    drop(h.submit(req("gone", prompt(9, 12), 200)));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while h.counters().requests_finished_abort == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the dropped request was not aborted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(h.counters().num_running, 0);
    assert!(h.is_healthy());
    assert_eq!(h.counters().kv_cache_usage, 0.0);
}
