//! The prefix cache's data structures: `BlockPool` (device tier), `HostTier`, block hashes.
//!
//! A property test drives the pool and the host tier the way the scheduler does (lookup,
//! share, allocate under pressure, spill evicted blocks to the host tier, restore from it,
//! register, decode, finish, abort) against a simulated device whose blocks hold data derived
//! from their hash, and checks after every step that the pool agrees with a reference model;
//! deterministic tests pin the eviction order and the edge cases.
//!
//! One test binary: the tests are grouped by concept in the modules below; the helpers the
//! deterministic tests share live here.

mod hashes;
mod host_tier;
mod pool;
mod sim;

use pd_engine::kv::pool::{BlockPool, Registration};
use pd_engine::kv::prefix::hash::BlockHash;

fn h(i: u128) -> BlockHash {
    BlockHash(i)
}

/// Allocate `n` blocks and register them with hashes `hashes`.
fn cached_blocks(pool: &mut BlockPool, hashes: &[BlockHash]) -> Vec<u32> {
    let blocks = pool.allocate(hashes.len()).unwrap().blocks;
    for (&b, &hash) in blocks.iter().zip(hashes) {
        assert_eq!(pool.register(b, hash).unwrap(), Registration::New);
    }
    blocks
}
