//! Prefix-cache accounting: local hits of whole blocks, a disabled cache and prompt logprobs,
//! cache salts, external hits from the host tier (per KV dtype), and abort after lookup.

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::sampling::FinishReason;
use pd_engine::serve::{RequestEvent, RequestId, TierKind};
use pd_engine::weights::DType;

use crate::{
    all_free, check_counters, config, engine, engine_on, prompt, req, run_one, usage_split,
};

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
        r.prompt_logprobs.unwrap().len(),
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
    // The external hits are all the host tier's; the prompt is computed + local + host.
    let (local, host, peer) = usage_split(&usage);
    assert_eq!((host, peer), (usage.external_cached_tokens, 0));
    assert_eq!(20 - (local + host), 4, "the last block is computed");
    let c = e.counters();
    assert_eq!(
        c.external_prefix_cache_hits as usize,
        usage.external_cached_tokens
    );
    let by = c.external_prefix_cache_hits_by_source;
    assert_eq!((by[TierKind::Host] as usize, by[TierKind::Peer]), (host, 0));
    assert_eq!(c.prompt_tokens_from(TierKind::Host) as usize, host);
    assert_eq!(
        c.prompt_tokens_computed
            + c.prompt_tokens_local_cache
            + c.prompt_tokens_from(TierKind::Host)
            + c.prompt_tokens_from(TierKind::Peer),
        c.prompt_tokens()
    );
    assert_eq!(c.prompt_tokens(), 20 + 40 + 20);
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
