//! Prefill/decode disaggregation: prefill-node leases (release, expiry, readers), KV moved
//! from a prefill engine to a decode engine (as buffers or pulled in place), and import
//! reservations that are never admitted giving every block back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_engine::ErrorKind;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::kv::handoff::host_buffer::{HostBuffer, heap_buffer};
use pd_engine::kv::handoff::placement::{KvReservation, ReleaseFn, ReservationId};
use pd_engine::kv::handoff::reservation::{ImportReservation, Landing};
use pd_engine::serve::{
    Engine, EngineConfig, EngineThread, ImportedBlocks, ImportedKv, RequestEvent, Role, TierKind,
};

use crate::{all_free, config, engine, prompt, req, run_one, usage_split};

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
    let wrong = pd_engine::serve::LeaseSecret::random();
    assert!(
        !e.release_lease(lease.lease_id, &wrong),
        "a wrong secret releases nothing"
    );
    assert_eq!(e.num_free_blocks(), 61, "the blocks stay leased");
    assert!(
        e.lease_store().get(lease.lease_id, &wrong).is_none(),
        "a wrong secret reads nothing"
    );
    assert!(e.release_lease(lease.lease_id, &lease.secret));
    assert!(!e.release_lease(lease.lease_id, &lease.secret));
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
        .get(lease.lease_id, &lease.secret)
        .expect("lent to the exporter");
    let before: Vec<Vec<u8>> = (0..3).map(|i| reader.block_data(i)).collect();
    assert!(e.release_lease(lease.lease_id, &lease.secret));
    assert!(
        e.lease_store().get(lease.lease_id, &lease.secret).is_none(),
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
                .read_lease(
                    lease.lease_id,
                    &lease.secret,
                    have,
                    lease.blocks.len() - have,
                )
                .unwrap();
            assert!(prefill.release_lease(lease.lease_id, &lease.secret));
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
    // All of it received from the prefill node: a peer, none from the host tier.
    assert_eq!(usage_split(&usage), (0, 0, 23));
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
    assert_eq!(usage_split(&usage), (20, 0, 3));
    assert_eq!(usage.prompt_tokens, 23, "local + peer is the whole prompt");
    let c = decode.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (46, 20));
    assert_eq!(
        (
            c.external_prefix_cache_queries,
            c.external_prefix_cache_hits
        ),
        (26, 26)
    );
    let by = c.external_prefix_cache_hits_by_source;
    assert_eq!((by[TierKind::Host], by[TierKind::Peer]), (0, 26));
    assert_eq!(
        (
            c.prompt_tokens_computed,
            c.prompt_tokens_local_cache,
            c.prompt_tokens_from(TierKind::Peer)
        ),
        (0, 20, 26)
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

/// KV pulled into buffers because the pool had no room when the pull began: placed in blocks
/// reserved after the pull once the pool has room (from a later block where more of the
/// prompt is cached by then), left in the buffers while it has none or where the cached
/// prefix the pull relied on is gone. Either way the request decodes as one mixed engine
/// does, and its prompt counts as found where it was.
#[test]
fn kv_pulled_into_buffers_is_placed_once_the_pool_has_room() {
    let p = prompt(21, 23); // 5 full blocks + 3 tokens
    let want = run_one(&mut engine(64, config()), req("m", p.clone(), 8)).tokens;
    let mut prefill = engine(
        64,
        EngineConfig {
            role: Role::Prefill,
            ..config()
        },
    );
    // Prefill `id` and read its blocks from `from` on, as a pull into buffers does.
    let mut pull = |id: &str, p: &[u32], from: usize| {
        let first = run_one(&mut prefill, req(id, p.to_vec(), 8));
        let lease = first.finished.unwrap().lease.unwrap();
        let blocks = prefill
            .read_lease(
                lease.lease_id,
                &lease.secret,
                from,
                lease.blocks.len() - from,
            )
            .unwrap();
        assert!(prefill.release_lease(lease.lease_id, &lease.secret));
        let buffers: Vec<HostBuffer> = blocks
            .into_iter()
            .map(|b| Box::new(b) as HostBuffer)
            .collect();
        (first.tokens[0], buffers)
    };
    let thread = EngineThread::spawn(engine(
        16,
        EngineConfig {
            role: Role::Decode,
            ..config()
        },
    ));
    let h = thread.handle();
    let decode = |id: &str, first_block: usize, blocks: ImportedBlocks, first_token: u32| {
        let mut r = req(id, p.clone(), 8);
        r.imported = Some(ImportedKv {
            first_block,
            blocks,
            first_token,
        });
        let mut tokens = vec![first_token];
        for event in h.submit(r) {
            match event {
                RequestEvent::Token(t) => tokens.push(t.token_id),
                RequestEvent::PromptLogprobs(_) => panic!("not asked for"),
                RequestEvent::Finished(f) => {
                    let u = f.usage;
                    return (tokens, (u.local_cached_tokens, u.external_cached_tokens));
                }
                RequestEvent::Failed(e) => panic!("request {id} failed: {e}"),
            }
        }
        panic!("request {id}: no terminal event")
    };
    let placed = |blocks: &ImportedBlocks| match blocks {
        ImportedBlocks::Placed(r) => Some((r.len(), r.landing())),
        ImportedBlocks::Buffers(_) => None,
    };

    // Another import holds 15 of the 16 blocks: no room for the prompt's 6, before the pull
    // or after it, so its KV stays in the buffers.
    let other = h.reserve_import(prompt(7, 60), None).expect("room");
    assert!(h.reserve_import(p.clone(), None).is_none());
    let (first_token, buffers) = pull("a", &p, 0);
    let (first, blocks) = h.place_pulled(p.clone(), None, 0, buffers);
    let ImportedBlocks::Buffers(buffers) = blocks else {
        panic!("placed with no room in the pool");
    };
    assert_eq!((first, buffers.len()), (0, 6));
    // The other import went (its request ended): now the pulled KV is placed here.
    drop(other);
    let (first, blocks) = h.place_pulled(p.clone(), None, 0, buffers);
    assert_eq!(first, 0);
    assert_eq!(placed(&blocks), Some((6, Landing::HostCopy)));
    assert_eq!(
        decode("a", first, blocks, first_token),
        (want.clone(), (0, 23))
    );
    let c = h.counters();
    let imports = |c: &pd_engine::serve::EngineCounters| {
        (
            c.kv_imports_in_place,
            c.kv_imports_host_copy,
            c.kv_imports_buffered,
        )
    };
    assert_eq!(imports(&c), (0, 1, 0));

    // Pulled whole, but the prompt's 5 full blocks are cached here by the time the pull
    // ends: only the last pulled block is placed, and the prompt counts 20 tokens local.
    let (first_token, buffers) = pull("b", &p, 0);
    let (first, blocks) = h.place_pulled(p.clone(), None, 0, buffers);
    assert_eq!(first, 5);
    assert_eq!(placed(&blocks), Some((1, Landing::HostCopy)));
    assert_eq!(decode("b", first, blocks, first_token), (want, (20, 3)));

    // Pulled from block 5 of a prompt whose first 5 blocks are not cached here (evicted
    // since the puller looked): nothing to place them after; the reservation is given back.
    let q = prompt(22, 23);
    let (_, buffers) = pull("c", &q, 5);
    let (first, blocks) = h.place_pulled(q, None, 5, buffers);
    assert_eq!((first, placed(&blocks)), (5, None));
    let c = h.counters();
    assert_eq!(imports(&c), (0, 2, 0));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.counters().kv_cache_usage > 0.0 {
        assert!(std::time::Instant::now() < deadline, "blocks kept");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A reservation the pull fills in place: what the CPU backend's host KV memory gives.
fn in_host_memory(r: Option<ImportReservation>) -> KvReservation {
    match r {
        Some(ImportReservation::Host(r)) => r,
        Some(ImportReservation::Device(_)) => panic!("CPU KV is host memory, not a device's"),
        None => panic!("host KV memory and room in the pool"),
    }
}
