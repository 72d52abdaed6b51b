//! The serving engine on the tiny transformers-golden checkpoint: exact prefix-cache
//! accounting, equivalence of every scheduling path with plain generation, leases, abort,
//! preemption, and no block left behind.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_engine::ErrorKind;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::executor::Executor;
use pd_engine::kv::host_buffer::{HostBuffer, heap_buffer};
use pd_engine::kv::placement::{KvReservation, ReleaseFn, ReservationId};
use pd_engine::kv::reservation::ImportReservation;
use pd_engine::model::Qwen3;
use pd_engine::sampling::{FinishReason, SamplingParams};
use pd_engine::serve::{
    Engine, EngineConfig, EngineCounters, EngineRequest, EngineThread, Finished, ImportedBlocks,
    RequestEvent, RequestId, Role,
};
use pd_engine::weights::{Checkpoint, DType};

const BS: usize = 4;

fn config() -> EngineConfig {
    EngineConfig {
        role: Role::Mixed,
        enable_prefix_caching: true,
        host_cache_blocks: 0,
        max_num_batched_tokens: 256,
        max_num_seqs: 16,
        max_model_len: 512,
        lease_timeout: Duration::from_secs(30),
        seed: 0,
    }
}

fn engine(num_blocks: usize, cfg: EngineConfig) -> Engine<CpuBackend> {
    engine_on(CpuBackend::new(), num_blocks, cfg)
}

fn engine_on(backend: CpuBackend, num_blocks: usize, cfg: EngineConfig) -> Engine<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny-gqa");
    let mc = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Qwen3::load(&backend, &ckpt, &mc, &mut |_, _| {}).unwrap();
    let exec = Executor::new(backend, model, BS, num_blocks).unwrap();
    Engine::new(exec, cfg, vec![399], 400).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed * 101 + 7) % 390)
        .collect()
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId::from(id),
        prompt,
        params: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        cache_salt: None,
        imported: None,
        lease_kv: true,
    }
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    tokens: Vec<u32>,
    finished: Option<Finished>,
}

/// Step until idle, collecting every request's tokens and its single terminal event.
fn drain(engine: &mut Engine<CpuBackend>) -> HashMap<String, Outcome> {
    let mut out: HashMap<String, Outcome> = HashMap::new();
    let mut steps = 0;
    while engine.has_work() {
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
        for (id, event) in engine.step() {
            let o = out.entry(id.0).or_default();
            assert!(o.finished.is_none(), "an event after the terminal one");
            match event {
                RequestEvent::Token(t) => o.tokens.push(t.token_id),
                RequestEvent::Finished(f) => o.finished = Some(*f),
                RequestEvent::Failed(e) => panic!("request failed: {e}"),
            }
        }
    }
    out
}

fn run_one(engine: &mut Engine<CpuBackend>, r: EngineRequest) -> Outcome {
    let id = r.id.0.clone();
    engine.submit(r).unwrap();
    drain(engine).remove(&id).unwrap()
}

/// Hit rates stay in [0, 1] and the books balance.
fn check_counters(c: &EngineCounters) {
    assert!(c.prefix_cache_hits <= c.prefix_cache_queries);
    assert!(c.external_prefix_cache_hits <= c.external_prefix_cache_queries);
    assert!(c.external_prefix_cache_queries <= c.prefix_cache_queries);
}

fn all_free(engine: &Engine<CpuBackend>) {
    assert_eq!(
        engine.num_free_blocks(),
        engine.num_blocks(),
        "every block came back"
    );
    assert_eq!(engine.num_open(), 0);
}

#[test]
fn cold_miss_then_local_hits_of_whole_blocks_below_the_last_token() {
    let mut e = engine(64, config());
    let p = prompt(1, 18); // 4 full blocks + 2
    let a = run_one(&mut e, req("a", p.clone(), 6));
    let c = e.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (18, 0));
    assert_eq!(
        (
            c.external_prefix_cache_queries,
            c.external_prefix_cache_hits
        ),
        (18, 0)
    );
    let b = run_one(&mut e, req("b", p.clone(), 6));
    assert_eq!(a.tokens, b.tokens, "cached KV gives the same tokens");
    let c = e.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (36, 16));
    // External queries are what the local lookups left: 18 + 2; no host tier, no hits.
    assert_eq!(
        (
            c.external_prefix_cache_queries,
            c.external_prefix_cache_hits
        ),
        (20, 0)
    );
    let usage = b.finished.unwrap().usage;
    assert_eq!(
        (usage.local_cached_tokens, usage.external_cached_tokens),
        (16, 0)
    );
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (18, 6));

    // A prompt of exactly 4 blocks: the last block holds the last token, so only 3 hit.
    let p16 = prompt(1, 16);
    let r = run_one(&mut e, req("c", p16, 2));
    assert_eq!(r.finished.unwrap().usage.local_cached_tokens, 12);
    // Sharing a prefix: the first 2 blocks of `p` then something else.
    let mut shared = p[..8].to_vec();
    shared.extend(prompt(9, 10));
    let r = run_one(&mut e, req("d", shared, 2));
    assert_eq!(r.finished.unwrap().usage.local_cached_tokens, 8);
    check_counters(&e.counters());
    all_free(&e);
}

#[test]
fn disabled_cache_and_prompt_logprobs_count_no_queries() {
    let mut cfg = config();
    cfg.enable_prefix_caching = false;
    let mut e = engine(64, cfg);
    let p = prompt(2, 13);
    run_one(&mut e, req("a", p.clone(), 3));
    let r = run_one(&mut e, req("b", p.clone(), 3));
    let c = e.counters();
    assert_eq!(c.prefix_cache_queries, 0);
    assert_eq!(c.prompt_tokens_computed, 26);
    assert_eq!(r.finished.unwrap().usage.cached_tokens(), 0);

    let mut e = engine(64, config());
    run_one(&mut e, req("a", p.clone(), 3));
    let mut with_lp = req("b", p.clone(), 3);
    with_lp.params.prompt_logprobs = Some(2);
    let r = run_one(&mut e, with_lp);
    let c = e.counters();
    assert_eq!(
        c.prefix_cache_queries, 13,
        "only the first request looked up"
    );
    let f = r.finished.unwrap();
    assert_eq!(f.usage.cached_tokens(), 0);
    assert_eq!(
        f.prompt_logprobs.unwrap().len(),
        12,
        "every prompt position after the first"
    );
    all_free(&e);
}

#[test]
fn cache_salt_isolates_tenants() {
    let mut e = engine(64, config());
    let p = prompt(3, 20);
    let mut a = req("a", p.clone(), 2);
    a.cache_salt = Some("tenant-a".into());
    run_one(&mut e, a);
    let mut b = req("b", p.clone(), 2);
    b.cache_salt = Some("tenant-b".into());
    assert_eq!(
        run_one(&mut e, b).finished.unwrap().usage.cached_tokens(),
        0
    );
    let mut a2 = req("a2", p.clone(), 2);
    a2.cache_salt = Some("tenant-a".into());
    assert_eq!(
        run_one(&mut e, a2)
            .finished
            .unwrap()
            .usage
            .local_cached_tokens,
        16
    );
    let unsalted = run_one(&mut e, req("c", p, 2));
    assert_eq!(unsalted.finished.unwrap().usage.cached_tokens(), 0);
}

/// With the KV cache in f32, f16 and bf16: the host tier keeps blocks as they travel (as
/// stored), which the cache gets back exactly.
#[test]
fn evicted_blocks_come_back_from_the_host_tier_as_external_hits() {
    for kv_dtype in [DType::F32, DType::F16, DType::BF16] {
        evicted_blocks_come_back(kv_dtype);
    }
}

fn evicted_blocks_come_back(kv_dtype: DType) {
    let mut cfg = config();
    cfg.host_cache_blocks = 64;
    // 12 blocks: a 20-token request with 4 new tokens needs 6; the second request evicts.
    let mut e = engine_on(CpuBackend::with_kv_dtype(kv_dtype), 12, cfg);
    let p = prompt(4, 20);
    let first = run_one(&mut e, req("a", p.clone(), 4));
    // Fill the pool with other content, evicting a's cached blocks into the host tier.
    run_one(&mut e, req("x", prompt(5, 40), 4));
    let again = run_one(&mut e, req("b", p.clone(), 4));
    assert_eq!(
        first.tokens, again.tokens,
        "{kv_dtype:?}: restored KV gives the same tokens"
    );
    let usage = again.finished.unwrap().usage;
    assert_eq!(usage.local_cached_tokens + usage.external_cached_tokens, 16);
    assert!(usage.external_cached_tokens > 0, "{kv_dtype:?}: {usage:?}");
    let c = e.counters();
    assert_eq!(
        c.external_prefix_cache_hits as usize,
        usage.external_cached_tokens
    );
    // External queries: every prompt token the local lookups left.
    assert_eq!(
        c.external_prefix_cache_queries,
        20 + 40 + (20 - usage.local_cached_tokens as u64)
    );
    check_counters(&c);
    all_free(&e);
}

#[test]
fn abort_after_lookup_keeps_the_counts_and_frees_everything() {
    let mut e = engine(64, config());
    let p = prompt(6, 30);
    run_one(&mut e, req("warm", p.clone(), 1));
    let mut cfg_small = req("a", p.clone(), 50);
    cfg_small.params.max_tokens = 50;
    e.submit(cfg_small).unwrap();
    e.step(); // admitted: looked up and counted
    let event = e.abort(&RequestId::from("a")).expect("open request");
    let RequestEvent::Finished(f) = event else {
        panic!("{event:?}")
    };
    assert_eq!(f.reason, FinishReason::Abort);
    assert_eq!(f.usage.local_cached_tokens, 28);
    let c = e.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (60, 28));
    assert_eq!(c.requests_finished_abort, 1);
    assert!(
        e.abort(&RequestId::from("a")).is_none(),
        "exactly one terminal event"
    );
    // Aborted while still waiting: never looked up, nothing counted.
    e.submit(req("w", p, 3)).unwrap();
    e.abort(&RequestId::from("w")).unwrap();
    assert_eq!(e.counters().prefix_cache_queries, 60);
    all_free(&e);
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

    let variants: Vec<(&str, usize, EngineConfig)> = vec![
        ("batched", 256, config()),
        (
            "chunked",
            256,
            EngineConfig {
                max_num_batched_tokens: 5,
                ..config()
            },
        ),
        (
            "one-seq",
            256,
            EngineConfig {
                max_num_seqs: 1,
                ..config()
            },
        ),
        // 14 blocks cannot hold all five at once: preemption by recompute.
        ("preempting", 14, config()),
    ];
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
fn prefill_role_leases_the_prompt_blocks_until_released_or_expired() {
    let mut cfg = config();
    cfg.role = Role::Prefill;
    cfg.lease_timeout = Duration::from_millis(1);
    let mut e = engine(64, cfg);
    let out = run_one(&mut e, req("a", prompt(8, 10), 100));
    assert_eq!(
        out.tokens.len(),
        1,
        "a prefill node stops after the first token"
    );
    let lease = out.finished.unwrap().lease.expect("a lease");
    assert_eq!(lease.blocks.len(), 3);
    assert_eq!(lease.block_hashes.len(), 2);
    assert_eq!(e.num_free_blocks(), 61);
    assert!(e.release_lease(lease.lease_id));
    assert!(!e.release_lease(lease.lease_id));
    all_free(&e);
    // Never released: the deadline frees it.
    let out = run_one(&mut e, req("b", prompt(8, 10), 100));
    assert!(out.finished.unwrap().lease.is_some());
    std::thread::sleep(Duration::from_millis(5));
    e.expire_leases(std::time::Instant::now());
    assert_eq!(e.expired_leases(), 1);
    all_free(&e);

    // Host-memory KV: the lease pins its blocks in place. One released while a transfer
    // still reads it keeps its blocks until the reader lets go, and the reader sees the
    // lease's KV unchanged meanwhile.
    let out = run_one(&mut e, req("c", prompt(8, 10), 100));
    let lease = out.finished.unwrap().lease.unwrap();
    let reader = e
        .lease_store()
        .get(lease.lease_id)
        .expect("lent to the exporter");
    let before: Vec<Vec<u8>> = (0..3).map(|i| reader.block_data(i)).collect();
    assert!(e.release_lease(lease.lease_id));
    assert!(
        e.lease_store().get(lease.lease_id).is_none(),
        "a new reader finds nothing"
    );
    // Another request runs meanwhile (its own lease expires at once).
    run_one(&mut e, req("d", prompt(9, 40), 100));
    std::thread::sleep(Duration::from_millis(5));
    e.expire_leases(std::time::Instant::now());
    assert_eq!(e.num_free_blocks(), 61, "the 3 blocks stay held while read");
    let after: Vec<Vec<u8>> = (0..3).map(|i| reader.block_data(i)).collect();
    assert_eq!(before, after);
    drop(reader);
    e.expire_leases(std::time::Instant::now());
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

/// Prefill on one engine, KV moved block by block, decode on another: the same greedy tokens
/// as one mixed engine, and the decode node pulls only what it does not cache. With
/// `placed`, the blocks land in place in blocks the decode engine reserved; otherwise in
/// buffers it copies in at admission.
fn prefill_then_decode(placed: bool) {
    let p = prompt(21, 23); // 5 full blocks + 3 tokens
    let mut mixed = engine(64, config());
    let want = run_one(&mut mixed, req("m", p.clone(), 8)).tokens;

    let mut prefill = engine(
        64,
        EngineConfig {
            role: Role::Prefill,
            ..config()
        },
    );
    let mut decode = engine(
        64,
        EngineConfig {
            role: Role::Decode,
            ..config()
        },
    );
    let released = Arc::new(Mutex::new(Vec::new()));
    let transfer =
        |id: &str, p: &[u32], prefill: &mut Engine<CpuBackend>, decode: &mut Engine<CpuBackend>| {
            let first = run_one(prefill, req(id, p.to_vec(), 8));
            let lease = first.finished.unwrap().lease.unwrap();
            let (have, reservation) = if placed {
                let r = in_host_memory(decode.reserve_import(p, None, release_into(&released)));
                (r.first_block(), Some(r))
            } else {
                (decode.cached_prefix_blocks(p, None), None)
            };
            let blocks = prefill
                .read_lease(lease.lease_id, have, lease.blocks.len() - have)
                .unwrap();
            assert!(prefill.release_lease(lease.lease_id));
            let blocks = match reservation {
                Some(mut r) => {
                    assert_eq!(r.len(), blocks.len());
                    for (i, block) in blocks.iter().enumerate() {
                        let bytes: Vec<u8> = block.iter().flat_map(|v| v.to_le_bytes()).collect();
                        let mut at = 0;
                        for seg in r.block_mut(i) {
                            seg.copy_from_slice(&bytes[at..at + seg.len()]);
                            at += seg.len();
                        }
                        assert_eq!(at, bytes.len());
                    }
                    ImportedBlocks::Placed(r.filled())
                }
                None => ImportedBlocks::Buffers(
                    blocks
                        .into_iter()
                        .map(|b| Box::new(b) as HostBuffer)
                        .collect(),
                ),
            };
            let mut r = req(id, p.to_vec(), 8);
            r.imported = Some(pd_engine::serve::ImportedKv {
                first_block: have,
                blocks,
                first_token: first.tokens[0],
            });
            let rest = run_one(decode, r);
            let mut tokens = first.tokens.clone();
            tokens.extend(rest.tokens);
            (tokens, rest.finished.unwrap().usage, have)
        };
    let (tokens, usage, have) = transfer("a", &p, &mut prefill, &mut decode);
    assert_eq!(tokens, want, "prefill + decode equals one mixed engine");
    assert_eq!(have, 0);
    assert_eq!(
        (usage.local_cached_tokens, usage.external_cached_tokens),
        (0, 23)
    );
    let c = decode.counters();
    assert_eq!(
        (
            c.external_prefix_cache_queries,
            c.external_prefix_cache_hits
        ),
        (23, 23)
    );

    // Same prompt again: the decode node caches its 5 full blocks and pulls only the last.
    let (tokens, usage, have) = transfer("b", &p, &mut prefill, &mut decode);
    assert_eq!(tokens, want);
    assert_eq!(have, 5);
    assert_eq!(
        (usage.local_cached_tokens, usage.external_cached_tokens),
        (20, 3)
    );
    let c = decode.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (46, 20));
    assert_eq!(
        (
            c.external_prefix_cache_queries,
            c.external_prefix_cache_hits
        ),
        (26, 26)
    );
    all_free(&prefill);
    all_free(&decode);
    assert_eq!(prefill.num_leases(), 0);

    // A decode node refuses requests without KV, and KV of the wrong shape.
    let err = decode.submit(req("x", p.clone(), 4)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    let mut bad = req("y", p.clone(), 4);
    bad.imported = Some(pd_engine::serve::ImportedKv {
        first_block: 0,
        blocks: ImportedBlocks::Buffers((0..6).map(|_| heap_buffer(3)).collect()),
        first_token: 1,
    });
    assert!(decode.submit(bad).unwrap_err().message.contains("layout"));
    assert!(
        released.lock().unwrap().is_empty(),
        "admitted reservations give nothing back"
    );
    assert_eq!(decode.reservations_held(), 0);
}

#[test]
fn prefill_then_decode_equals_mixed_and_counts_the_transfer_as_external() {
    prefill_then_decode(false);
}

#[test]
fn kv_pulled_in_place_equals_mixed_and_counts_the_transfer_as_external() {
    prefill_then_decode(true);
}

/// A release function that records the ids it is called with.
fn release_into(log: &Arc<Mutex<Vec<ReservationId>>>) -> ReleaseFn {
    let log = log.clone();
    Arc::new(move |id| log.lock().unwrap().push(id))
}

/// A reservation dropped unadmitted (a failed pull, a request that ended first) gives every
/// block back, its cached prefix's references included; one left in a request that is
/// aborted before admission does too.
#[test]
fn reservations_never_admitted_give_every_block_back() {
    let p = prompt(5, 10); // 3 blocks of 4
    let mut decode = engine(
        16,
        EngineConfig {
            role: Role::Decode,
            ..config()
        },
    );
    let log = Arc::new(Mutex::new(Vec::new()));
    let r = decode.reserve_import(&p, None, release_into(&log)).unwrap();
    assert_eq!((r.first_block(), r.len()), (0, 3));
    assert!(
        decode.counters().kv_cache_usage > 0.0,
        "the blocks are held"
    );
    // The pool cannot reserve what it does not have: the caller falls back to buffers.
    assert!(
        decode
            .reserve_import(&prompt(6, 16 * 14), None, release_into(&log))
            .is_none()
    );
    assert_eq!(decode.reservations_held(), 1);
    drop(r);
    let id = log.lock().unwrap().pop().expect("released on drop");
    assert!(decode.release_reservation(id));
    assert!(!decode.release_reservation(id), "released once");
    all_free(&decode);
    // Headroom: never the pool's last free block (running sequences grow into it).
    assert!(
        decode
            .reserve_import(&prompt(7, 64), None, release_into(&log))
            .is_none()
    );
    let all_but_one = decode.reserve_import(&prompt(7, 60), None, release_into(&log));
    assert_eq!(all_but_one.map(|r| r.len()), Some(15));
    let id = log.lock().unwrap().pop().expect("released on drop");
    assert!(decode.release_reservation(id));
    all_free(&decode);

    // Reserved, then the request is aborted while it waits.
    let r = in_host_memory(decode.reserve_import(&p, None, release_into(&log)));
    let mut waiting = req("w", p.clone(), 4);
    waiting.imported = Some(pd_engine::serve::ImportedKv {
        first_block: 0,
        blocks: ImportedBlocks::Placed(r.filled()),
        first_token: 1,
    });
    decode.submit(waiting).unwrap();
    assert!(decode.abort(&"w".into()).is_some());
    let id = log
        .lock()
        .unwrap()
        .pop()
        .expect("released when the request went");
    assert!(decode.release_reservation(id));
    all_free(&decode);
    assert_eq!(decode.reservations_held(), 0);
}

/// Through the engine thread: a reservation handed out and dropped without a request gives
/// its blocks back; one carried by a request that the engine refuses does too.
#[test]
fn driver_reservations_come_back_when_dropped_or_refused() {
    let thread = EngineThread::spawn(engine(
        32,
        EngineConfig {
            role: Role::Decode,
            ..config()
        },
    ));
    let h = thread.handle();
    assert!(h.host_kv_memory().is_some(), "CPU KV is host memory");
    let usage_back_to_zero = |what: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while h.counters().kv_cache_usage > 0.0 {
            assert!(std::time::Instant::now() < deadline, "{what}: blocks kept");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let r = h
        .reserve_import(prompt(3, 10), None)
        .expect("room to reserve");
    assert_eq!(r.len(), 3);
    assert!(h.counters().kv_cache_usage > 0.0, "held while reserved");
    drop(r);
    usage_back_to_zero("dropped reservation");

    // The first token ends the request (max_tokens 1): refused, and the reservation with it.
    let r = in_host_memory(h.reserve_import(prompt(3, 10), None));
    let mut done = req("d", prompt(3, 10), 1);
    done.imported = Some(pd_engine::serve::ImportedKv {
        first_block: 0,
        blocks: ImportedBlocks::Placed(r.filled()),
        first_token: 7,
    });
    let refused = h.submit(done).recv().unwrap();
    assert!(matches!(refused, RequestEvent::Failed(e) if e.kind == ErrorKind::InvalidArgument));
    usage_back_to_zero("refused request");
}

/// A reservation the pull fills in place: what the CPU backend's host KV memory gives.
fn in_host_memory(r: Option<ImportReservation>) -> KvReservation {
    match r {
        Some(ImportReservation::Host(r)) => r,
        Some(ImportReservation::Device(_)) => panic!("CPU KV is host memory, not a device's"),
        None => panic!("host KV memory and room in the pool"),
    }
}
