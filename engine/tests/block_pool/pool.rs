//! `BlockPool` edge cases: eviction order, sharing cached blocks, duplicate registration,
//! double free, all-or-nothing allocation and `touch`.

use pd_engine::kv::pool::{BlockPool, PoolError, Registration};
use pd_engine::kv::prefix::hash::{BlockHash, block_hashes};

use crate::{cached_blocks, h};

#[test]
fn eviction_is_least_recently_freed_first() {
    let mut pool = BlockPool::new(4);
    let a = cached_blocks(&mut pool, &[h(10), h(11)]);
    let b = cached_blocks(&mut pool, &[h(20), h(21)]);
    pool.free(&b).unwrap();
    pool.free(&a).unwrap();
    // Tail first within each request, requests in the order they ended.
    assert_eq!(pool.eviction_order(), [b[1], b[0], a[1], a[0]]);
    assert_eq!(pool.num_cached(), 4);
    let x = pool.allocate(1).unwrap();
    assert_eq!(x.blocks, [b[1]]);
    assert_eq!(x.evicted, [(b[1], h(21))]);
    let y = pool.allocate(2).unwrap();
    assert_eq!(y.evicted, [(b[0], h(20)), (a[1], h(11))]);
    assert_eq!(pool.lookup(h(21)), None);
    assert_eq!(pool.lookup(h(11)), None);
    assert_eq!(pool.lookup(h(10)), Some(a[0]));
    assert_eq!(pool.num_cached(), 1);
    pool.check_invariants().unwrap();
}

#[test]
fn uncached_free_blocks_go_before_cached_ones() {
    let mut pool = BlockPool::new(4);
    let blocks = pool.allocate(4).unwrap().blocks;
    pool.register(blocks[0], h(1)).unwrap();
    pool.register(blocks[1], h(2)).unwrap();
    pool.free(&blocks).unwrap();
    assert_eq!(pool.num_free(), 4);
    assert_eq!(pool.num_evictable(), 2);
    let a = pool.allocate(2).unwrap();
    assert_eq!(
        a.blocks,
        [blocks[3], blocks[2]],
        "uncached, least recently freed first"
    );
    assert!(a.evicted.is_empty());
    assert_eq!(pool.cached_prefix(&[h(1), h(2)]), 2);
    let b = pool.allocate(1).unwrap();
    assert_eq!(b.evicted, [(blocks[1], h(2))]);
    assert_eq!(pool.cached_prefix(&[h(1), h(2)]), 1);
    // A block freed after the cached ones is still used before them.
    pool.free(&b.blocks).unwrap();
    assert_eq!(pool.allocate(1).unwrap().blocks, b.blocks);
    assert_eq!(pool.cached_prefix(&[h(1)]), 1);
}

#[test]
fn tail_first_free_keeps_the_prefix() {
    let tokens: Vec<u32> = (0..64).collect();
    let hashes = block_hashes(&tokens, 16, None);
    let mut pool = BlockPool::new(4);
    let blocks = cached_blocks(&mut pool, &hashes);
    pool.free(&blocks).unwrap();
    let a = pool.allocate(2).unwrap();
    let evicted: Vec<BlockHash> = a.evicted.iter().map(|e| e.1).collect();
    assert_eq!(evicted, [hashes[3], hashes[2]]);
    assert_eq!(
        pool.cached_prefix(&hashes),
        2,
        "the first two blocks survive"
    );
    assert_eq!(pool.acquire_cached(&hashes[..2]).unwrap(), blocks[..2]);
}

#[test]
fn acquire_cached_shares_and_protects_blocks() {
    let mut pool = BlockPool::new(3);
    let blocks = cached_blocks(&mut pool, &[h(1), h(2)]);
    pool.free(&blocks).unwrap();
    assert_eq!(pool.num_evictable(), 2);
    assert_eq!(pool.usage(), 0.0);
    let x = pool.acquire_cached(&[h(1), h(2)]).unwrap();
    assert_eq!(x, blocks);
    assert_eq!(pool.num_evictable(), 0);
    assert_eq!(pool.num_free(), 1);
    let y = pool.acquire_cached(&[h(1)]).unwrap();
    assert_eq!(pool.refcount(y[0]), 2);
    assert!((pool.usage() - 2.0 / 3.0).abs() < 1e-12);
    // Held cached blocks are never evicted.
    assert_eq!(
        pool.allocate(2).unwrap_err(),
        PoolError::OutOfBlocks { needed: 2, free: 1 }
    );
    // A missing hash fails the whole call.
    assert_eq!(
        pool.acquire_cached(&[h(2), h(3)]).unwrap_err(),
        PoolError::NotCached {
            index: 1,
            hash: h(3)
        }
    );
    assert_eq!(pool.refcount(blocks[1]), 1);
    pool.free(&x).unwrap();
    assert_eq!(pool.refcount(y[0]), 1);
    assert_eq!(pool.eviction_order(), [blocks[1]]);
    pool.free(&y).unwrap();
    assert_eq!(pool.eviction_order(), [blocks[1], blocks[0]]);
    pool.check_invariants().unwrap();
}

#[test]
fn duplicate_registration_keeps_the_first_block() {
    let mut pool = BlockPool::new(3);
    let a = pool.allocate(1).unwrap().blocks[0];
    let b = pool.allocate(1).unwrap().blocks[0];
    assert_eq!(pool.register(a, h(5)).unwrap(), Registration::New);
    assert_eq!(
        pool.register(b, h(5)).unwrap(),
        Registration::Duplicate { existing: a }
    );
    assert_eq!(
        pool.register(a, h(5)).unwrap(),
        Registration::AlreadyRegistered
    );
    assert_eq!(pool.lookup(h(5)), Some(a));
    assert_eq!(pool.block_hash(b), None);
    assert_eq!(pool.num_cached(), 1);
    assert_eq!(
        pool.register(a, h(6)).unwrap_err(),
        PoolError::HashConflict {
            block: a,
            registered: h(5),
            new: h(6)
        }
    );
    // The duplicate goes back uncached and is reused before the cached block.
    pool.free(&[b]).unwrap();
    pool.free(&[a]).unwrap();
    assert_eq!(pool.num_evictable(), 1);
    let next = pool.allocate(2).unwrap();
    assert_eq!(next.blocks[..2], [2, b]);
    assert!(next.evicted.is_empty());
    assert_eq!(pool.lookup(h(5)), Some(a));
    // Only a held block can be registered.
    assert_eq!(
        pool.register(a, h(7)).unwrap_err(),
        PoolError::NotInUse { block: a }
    );
    let c = pool.allocate(1).unwrap();
    assert_eq!(c.evicted, [(a, h(5))]);
    pool.free(&c.blocks).unwrap();
    assert_eq!(
        pool.register(a, h(8)).unwrap_err(),
        PoolError::NotInUse { block: a }
    );
    assert_eq!(
        pool.register(9, h(8)).unwrap_err(),
        PoolError::InvalidBlock {
            block: 9,
            num_blocks: 3
        }
    );
    pool.check_invariants().unwrap();
}

#[test]
fn double_free_is_an_error_and_changes_nothing() {
    let mut pool = BlockPool::new(3);
    let blocks = pool.allocate(2).unwrap().blocks;
    pool.register(blocks[0], h(1)).unwrap();
    pool.free(&blocks[1..]).unwrap();
    let err = pool.free(&blocks).unwrap_err();
    assert_eq!(err, PoolError::DoubleFree { block: blocks[1] });
    assert!(err.to_string().contains("double free"), "{err}");
    assert_eq!(
        pool.refcount(blocks[0]),
        1,
        "the first block was not released"
    );
    assert_eq!(pool.num_free(), 2);
    // Listing a block twice needs two references.
    assert_eq!(
        pool.free(&[blocks[0], blocks[0]]).unwrap_err(),
        PoolError::DoubleFree { block: blocks[0] }
    );
    assert_eq!(pool.refcount(blocks[0]), 1);
    assert_eq!(
        pool.free(&[7]).unwrap_err(),
        PoolError::InvalidBlock {
            block: 7,
            num_blocks: 3
        }
    );
    pool.free(&blocks[..1]).unwrap();
    assert_eq!(pool.num_free(), 3);
    pool.check_invariants().unwrap();
}

#[test]
fn allocate_is_all_or_nothing() {
    let mut pool = BlockPool::new(3);
    pool.allocate(2).unwrap();
    let err = pool.allocate(2).unwrap_err();
    assert_eq!(err, PoolError::OutOfBlocks { needed: 2, free: 1 });
    assert!(err.to_string().contains("2 needed, 1 free"), "{err}");
    assert_eq!(pool.num_free(), 1);
    assert_eq!(pool.allocate(0).unwrap().blocks, Vec::<u32>::new());
    assert_eq!(pool.allocate(1).unwrap().blocks, [2]);
}

#[test]
fn touch_refreshes_recency_of_evictable_blocks() {
    let mut pool = BlockPool::new(4);
    let a = cached_blocks(&mut pool, &[h(1), h(2)]);
    let b = cached_blocks(&mut pool, &[h(3), h(4)]);
    pool.free(&a).unwrap();
    pool.free(&b).unwrap();
    assert_eq!(pool.touch(&[h(1), h(2), h(99)]), 2);
    assert_eq!(pool.eviction_order(), [b[1], b[0], a[1], a[0]]);
    assert_eq!(pool.touch(&[h(99)]), 0);
    let held = pool.acquire_cached(&[h(3)]).unwrap();
    assert_eq!(
        pool.touch(&[h(3), h(4)]),
        2,
        "held blocks are counted but not listed"
    );
    assert_eq!(pool.eviction_order(), [a[1], a[0], b[1]]);
    pool.free(&held).unwrap();
    pool.check_invariants().unwrap();
}
