//! The host tier: spilling evicted pool blocks and fetching them back, LRU eviction,
//! capacity zero, and use through the `ExternalTier` trait.

use pd_engine::kv::pool::BlockPool;
use pd_engine::kv::prefix::hash::block_hashes;
use pd_engine::kv::prefix::host_tier::HostTier;
use pd_engine::kv::prefix::tier::{ExternalTier, TierError, TierKind};

use crate::{cached_blocks, h};

#[test]
fn evicted_blocks_spill_to_the_host_tier_and_come_back() {
    let tokens: Vec<u32> = (0..33).collect();
    let hashes = block_hashes(&tokens, 16, None);
    let mut pool = BlockPool::new(2);
    let mut host = HostTier::new(4, 2);
    let mut device = [[0u8; 2]; 2];
    let blocks = cached_blocks(&mut pool, &hashes);
    for (i, &b) in blocks.iter().enumerate() {
        device[b as usize] = [i as u8, 10 + i as u8];
    }
    pool.free(&blocks).unwrap();
    let other = pool.allocate(2).unwrap();
    for &(b, hash) in &other.evicted {
        host.offer(hash, &device[b as usize]);
    }
    assert_eq!(pool.cached_prefix(&hashes), 0);
    assert_eq!(host.lookup(&hashes), 2);
    let mut dst = [0u8; 2];
    host.fetch(hashes[1], &mut dst).unwrap();
    assert_eq!(dst, [1, 11]);
    host.fetch(hashes[0], &mut dst).unwrap();
    assert_eq!(dst, [0, 10]);
    assert_eq!(host.len(), 2, "fetched blocks stay in the host tier");
}

#[test]
fn host_tier_evicts_least_recently_used() {
    let mut host = HostTier::new(2, 3);
    assert_eq!(host.kind(), TierKind::Host);
    assert_eq!(host.block_bytes(), 3);
    host.offer(h(1), &[1; 3]);
    host.offer(h(2), &[2; 3]);
    assert_eq!(host.eviction_order(), [h(1), h(2)]);
    let mut dst = [0u8; 3];
    host.fetch(h(1), &mut dst).unwrap();
    assert_eq!(dst, [1; 3]);
    assert_eq!(host.eviction_order(), [h(2), h(1)], "fetch touches");
    host.offer(h(3), &[3; 3]);
    assert!(!host.contains(h(2)), "least recently used evicted");
    assert_eq!(host.len(), 2);
    assert_eq!(
        host.fetch(h(2), &mut dst).unwrap_err(),
        TierError::Miss {
            tier: TierKind::Host,
            hash: h(2)
        }
    );
    // Offering a held hash only refreshes it (content is immutable per hash).
    host.offer(h(1), &[9; 3]);
    assert_eq!(host.eviction_order(), [h(3), h(1)]);
    host.fetch(h(1), &mut dst).unwrap();
    assert_eq!(dst, [1; 3]);
    // Lookups count leading hashes and do not touch.
    assert_eq!(host.lookup(&[h(3), h(1), h(2), h(1)]), 2);
    assert_eq!(host.lookup(&[h(2), h(1)]), 0);
    assert_eq!(host.eviction_order(), [h(3), h(1)]);
    host.offer(h(4), &[4; 3]);
    host.fetch(h(4), &mut dst).unwrap();
    assert_eq!(dst, [4; 3]);
    host.fetch(h(1), &mut dst).unwrap();
    assert_eq!(dst, [1; 3]);
    assert!(!host.contains(h(3)));
    assert_eq!(
        host.fetch(h(1), &mut [0u8; 2]).unwrap_err(),
        TierError::LengthMismatch {
            tier: TierKind::Host,
            expected: 3,
            got: 2
        }
    );
}

#[test]
fn host_tier_of_capacity_zero_is_disabled() {
    let mut host = HostTier::new(0, 8);
    assert!(!host.is_enabled());
    host.offer(h(1), &[5; 8]);
    assert_eq!(host.lookup(&[h(1)]), 0);
    assert!(host.is_empty());
    assert!(matches!(
        host.fetch(h(1), &mut [0u8; 8]),
        Err(TierError::Miss { .. })
    ));
}

#[test]
fn tiers_are_usable_as_trait_objects() {
    fn assert_send<T: Send>(_: &T) {}
    let mut tiers: Vec<Box<dyn ExternalTier>> = vec![Box::new(HostTier::new(1, 1))];
    assert_send(&tiers);
    tiers[0].offer(h(1), &[15]);
    assert_eq!(tiers[0].lookup(&[h(1)]), 1);
    assert_eq!(tiers[0].kind().to_string(), "host");
}
