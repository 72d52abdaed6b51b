//! Cost of the prefix cache's hot paths (`cargo bench -p pd-engine --bench prefix_lookup`),
//! in ns per block (16 tokens), for 32k-token prompts on a pool of 100k blocks whose blocks
//! are all cached and evictable (the worst case for `acquire_cached`, which must take each
//! block off the LRU list):
//! - `block_hashes` of a whole prompt, and `BlockHasher::push` one token at a time (decode);
//! - `cached_prefix` (lookup only) and `acquire_cached` of a fully cached prompt;
//! - `free` of a prompt's blocks (tail first, back onto the LRU);
//! - `allocate` that has to evict (LRU pop + map removal) and `register` of the new blocks;
//! - a host-tier `lookup` + `fetch` of a 2k-block prompt with tiny blocks (bookkeeping only).
//!
//! Each case runs in rounds of at least 200 ms; the minimum and the median over the rounds
//! are printed (the machines are shared: read the minimum).

use std::hint::black_box;
use std::time::{Duration, Instant};

use pd_engine::kv::pool::BlockPool;
use pd_engine::kv::prefix::hash::{BlockHash, BlockHasher, block_hashes};
use pd_engine::kv::prefix::host_tier::HostTier;
use pd_engine::kv::prefix::tier::ExternalTier;

const BLOCK_SIZE: usize = 16;
const PROMPT_TOKENS: usize = 32 * 1024;
const PROMPT_BLOCKS: usize = PROMPT_TOKENS / BLOCK_SIZE;
const POOL_BLOCKS: usize = 100_000;
const ROUNDS: usize = 7;
const ROUND_TIME: Duration = Duration::from_millis(200);

/// A deterministic pseudo-random prompt (xorshift64*), token ids below 151 936.
fn prompt(seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..PROMPT_TOKENS)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as u32 % 151_936
        })
        .collect()
}

/// Run `f` (which does `units` blocks of work and returns the time to count) in rounds and
/// print ns per block.
fn report(name: &str, units: usize, f: impl FnMut() -> Duration) {
    report_per(name, units, "block", f);
}

fn report_per(name: &str, units: usize, unit: &str, mut f: impl FnMut() -> Duration) {
    f(); // warm-up
    let mut per_unit = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let (mut spent, mut iters) = (Duration::ZERO, 0u32);
        let start = Instant::now();
        while start.elapsed() < ROUND_TIME {
            spent += f();
            iters += 1;
        }
        per_unit.push(spent.as_nanos() as f64 / (f64::from(iters) * units as f64));
    }
    per_unit.sort_by(f64::total_cmp);
    println!(
        "{name:<46} min {:>7.1} ns/{unit:<5}  median {:>7.1} ns/{unit}",
        per_unit[0],
        per_unit[ROUNDS / 2]
    );
}

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

fn main() {
    println!(
        "prompt {PROMPT_TOKENS} tokens = {PROMPT_BLOCKS} blocks of {BLOCK_SIZE}; pool {POOL_BLOCKS} blocks"
    );
    let tokens = prompt(1);

    report("block_hashes (whole prompt)", PROMPT_BLOCKS, || {
        timed(|| {
            black_box(block_hashes(black_box(&tokens), BLOCK_SIZE, None));
        })
    });
    report("block_hashes with cache salt", PROMPT_BLOCKS, || {
        timed(|| {
            black_box(block_hashes(black_box(&tokens), BLOCK_SIZE, Some("tenant")));
        })
    });
    report("BlockHasher::push (token by token)", PROMPT_BLOCKS, || {
        timed(|| {
            let mut h = BlockHasher::new(BLOCK_SIZE, None);
            for &t in black_box(&tokens) {
                black_box(h.push(t));
            }
        })
    });

    // Fill the pool with cached, evictable prompts (as many as fit), the measured one last.
    let mut pool = BlockPool::new(POOL_BLOCKS);
    let prompts = POOL_BLOCKS / PROMPT_BLOCKS;
    let mut hashes = Vec::new();
    for p in 0..prompts {
        hashes = block_hashes(&prompt(p as u64 + 1), BLOCK_SIZE, None);
        let a = pool.allocate(hashes.len()).expect("fits");
        for (&b, &h) in a.blocks.iter().zip(&hashes) {
            pool.register(b, h).expect("fresh block");
        }
        pool.free(&a.blocks).expect("held");
    }
    // The rest of the pool: cached blocks of other content, evicted first.
    let rest = pool
        .allocate(pool.num_free() - pool.num_evictable())
        .expect("free");
    for (i, &b) in rest.blocks.iter().enumerate() {
        pool.register(b, BlockHash(u128::MAX - i as u128))
            .expect("fresh block");
    }
    pool.free(&rest.blocks).expect("held");
    assert_eq!(pool.num_cached(), POOL_BLOCKS);
    assert_eq!(pool.cached_prefix(&hashes), PROMPT_BLOCKS);
    println!(
        "pool: {} cached blocks ({} prompts), {} free",
        pool.num_cached(),
        prompts,
        pool.num_free()
    );

    report("cached_prefix (all hit)", PROMPT_BLOCKS, || {
        timed(|| {
            black_box(pool.cached_prefix(black_box(&hashes)));
        })
    });
    let misses: Vec<BlockHash> = (0..PROMPT_BLOCKS as u128).map(BlockHash).collect();
    report_per("cached_prefix, first block misses", 1, "call", || {
        timed(|| {
            black_box(pool.cached_prefix(black_box(&misses)));
        })
    });
    let mut held = Vec::new();
    report("acquire_cached (evictable -> held)", PROMPT_BLOCKS, || {
        let t = timed(|| held = pool.acquire_cached(black_box(&hashes)).expect("cached"));
        pool.free(&held).expect("held");
        t
    });
    report(
        "free (held -> evictable, tail first)",
        PROMPT_BLOCKS,
        || {
            held = pool.acquire_cached(&hashes).expect("cached");
            timed(|| pool.free(black_box(&held)).expect("held"))
        },
    );
    report(
        "cached_prefix + acquire_cached + free",
        PROMPT_BLOCKS,
        || {
            timed(|| {
                let n = pool.cached_prefix(black_box(&hashes));
                let blocks = pool.acquire_cached(&hashes[..n]).expect("cached");
                pool.free(&blocks).expect("held");
            })
        },
    );

    // Allocation under pressure: every block handed out evicts a cached one. Each round
    // re-registers what it evicted, so the pool stays full of cached blocks.
    report(
        "allocate with eviction + register + free",
        PROMPT_BLOCKS,
        || {
            let mut t = Duration::ZERO;
            let a = {
                let start = Instant::now();
                let a = pool.allocate(PROMPT_BLOCKS).expect("all free");
                t += start.elapsed();
                a
            };
            assert_eq!(a.evicted.len(), PROMPT_BLOCKS);
            t += timed(|| {
                for &(b, h) in &a.evicted {
                    pool.register(b, h).expect("evicted hash is gone");
                }
                pool.free(&a.blocks).expect("held");
            });
            t
        },
    );

    let mut host = HostTier::new(PROMPT_BLOCKS, 16);
    for &h in &hashes {
        host.offer(h, &[1; 16]);
    }
    let mut dst = [0u8; 16];
    report(
        "host tier lookup + fetch (16-byte blocks)",
        PROMPT_BLOCKS,
        || {
            timed(|| {
                let n = host.lookup(black_box(&hashes));
                for &h in &hashes[..n] {
                    host.fetch(h, &mut dst).expect("held");
                }
                black_box(&dst);
            })
        },
    );
}
