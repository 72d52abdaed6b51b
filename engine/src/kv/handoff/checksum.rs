//! The integrity checksum of one KV block as it travels between nodes: XXH3-64 of the
//! block's bytes in the transfer layout ([`crate::backend::Backend::read_block`], each
//! value as the KV cache stores it, little-endian), seeded with the block's index within its
//! lease, so a block delivered in the wrong place fails too.
//!
//! Computed once, when a prefill lease is made ([`super::lease_store`]); both
//! transports send it with the block and the receiver recomputes it over what arrived. Only
//! the function and its seed live here; framing belongs to the transport.

use std::hash::Hasher;

use twox_hash::XxHash3_64;

/// Base seed (`pd-kv-r1`); block `i` of a lease uses `BLOCK_SEED + i` (wrapping).
pub const BLOCK_SEED: u64 = 0x7064_2d6b_762d_7231;

/// The seed of block `index` of a lease.
pub fn block_seed(index: u64) -> u64 {
    BLOCK_SEED.wrapping_add(index)
}

/// The checksum of block `index` of a lease holding `bytes`.
pub fn block_checksum(index: u64, bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot_with_seed(block_seed(index), bytes)
}

/// The same checksum, computed over bytes that arrive in pieces.
#[derive(Clone)]
pub struct BlockChecksummer(XxHash3_64);

impl BlockChecksummer {
    pub fn new(index: u64) -> Self {
        Self(XxHash3_64::with_seed(block_seed(index)))
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

impl std::fmt::Debug for BlockChecksummer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockChecksummer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_equal_one_shot_and_the_reference_xxh3() {
        // Past 240 bytes XXH3 takes its long-input (SIMD) path; cover both.
        for n in [100usize, 10_000, 300_000] {
            let data: Vec<u8> = (0..n as u32).map(|i| (i * 31 % 251) as u8).collect();
            let mut h = BlockChecksummer::new(3);
            for part in data.chunks(777) {
                h.update(part);
            }
            assert_eq!(h.digest(), block_checksum(3, &data));
            // Standard XXH3-64: equal to the reference implementation's (xxhash-rust, a
            // separate code base), whatever SIMD path this CPU takes.
            assert_eq!(
                block_checksum(3, &data),
                xxhash_rust::xxh3::xxh3_64_with_seed(&data, BLOCK_SEED + 3)
            );
        }
    }

    #[test]
    fn the_index_changes_the_checksum() {
        let data = [7u8; 4096];
        assert_ne!(block_checksum(0, &data), block_checksum(1, &data));
        assert_eq!(block_seed(u64::MAX), BLOCK_SEED.wrapping_sub(1));
    }
}
