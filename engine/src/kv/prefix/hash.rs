//! Block hashes for the prefix cache, identical in every process and on every platform.
//!
//! The router computes the same hashes as the engines to route a request to the node that
//! already holds its prefix, so the encoding below is a wire format: changing any byte of it
//! is a breaking change (bump the domain string's version), and the test
//! `hashes_are_pinned` fails on any change.
//!
//! # Encoding (version 1)
//!
//! Every hash is XXH3-128 with a seed: `XXH3_128bits_withSeed(bytes, SEED)` in the reference
//! C library, [`xxhash_rust::xxh3::xxh3_128_with_seed`] here, `xxhash.xxh3_128_intdigest(bytes,
//! seed=SEED)` in Python. The 128-bit value is `high64 << 64 | low64` of the C library's
//! `XXH128_hash_t` (which is what the Rust and Python functions return).
//!
//! - `SEED` = [`SEED`] = `0x7064_2d6b_762d_6831` (the ASCII bytes `pd-kv-h1` read big-endian).
//! - **Root** (the parent of block 0): `root = XXH3_128(DOMAIN || salt_bytes, SEED)` where
//!   `DOMAIN` is the 26 ASCII bytes `pd-engine/kv-block-hash/v1` ([`DOMAIN`]; no NUL,
//!   no newline) and `salt_bytes` is
//!   - without a cache salt: the single byte `0x00`;
//!   - with cache salt `s` (any UTF-8 string, the empty one included): the byte `0x01`, then
//!     `len(s)` in bytes as a u64 little-endian (8 bytes), then the UTF-8 bytes of `s`.
//!
//!   So a prompt with a salt never shares any block hash with the same prompt without one, or
//!   with another salt, and `Some("")` differs from `None`.
//! - **Block `i`** (tokens `i*B .. (i+1)*B` for block size `B`), only for *full* blocks:
//!   `h_i = XXH3_128(parent_i || tok_0 || … || tok_{B-1}, SEED)` where `parent_0 = root`,
//!   `parent_i = h_{i-1}`, `parent_i` is written as 16 bytes little-endian (low byte of the
//!   u128 first) and each token id as 4 bytes little-endian (u32). The input is therefore
//!   exactly `16 + 4*B` bytes.
//!
//! A trailing partial block is never hashed (its content is not final, and a partial block is
//! never shared). The block size is not mixed in: every party must use the node's block size
//! (16 by default). The model is not mixed in either: hashes are only compared within the
//! caches of one model (one cluster).
//!
//! Test vectors (hex as printed by [`BlockHash`]'s `Display`, most significant digit first):
//! - `root(None)` = `f0a8b16515230896e0f725b5bc616760`,
//!   `root(Some(""))` = `55ab7b118c8ef6250199a7c4f74bee73`;
//! - tokens `0..10`, `B = 4`, no salt: `39f70764387b67e72cec1c284afe1b30`,
//!   `5660108ab1e34cfaa1fec27070fd5fab` (tokens 8 and 9 are a partial block: not hashed);
//! - tokens `[151643, 0, 4294967295, 42]`, `B = 2`, salt `tenant-7`:
//!   `fccbc95982a0985835a6213e58d2da19`, `88e7eb7d49d5257812f90e5302d8706b`.
//!
//! # SHA-256 (`--prefix-caching-hash-algo sha256`)
//!
//! For operators who fear crafted collisions (XXH3 is fast, not collision-resistant: a client
//! who can find two prompts with equal block hashes could be served the other's KV),
//! [`HashAlgo::Sha256`] replaces every `XXH3_128(bytes, SEED)` above by the first 16 bytes of
//! `SHA-256(bytes)`, read as a u128 **little-endian** (so the 16 bytes chained into the next
//! block are exactly those digest bytes, and [`BlockHash`]'s `Display` shows them in reverse
//! order). The bytes hashed are the same as above, byte for byte (no seed: SHA-256 has none).
//! 128 bits keep collisions out of reach (2^64 work for a birthday attack on one cache).
//! Test vectors (`Display`), the inputs of the XXH3 vectors above:
//! - `root(None)` = `f9d11a2e73f3ceaffbb9e32144a10439`,
//!   `root(Some(""))` = `d8c78d4a456dd51f880a5102d2bf1369`;
//! - tokens `0..10`, `B = 4`, no salt: `ad67d43d598b8ef4347107e7e48f6136`,
//!   `a4b8db875722531fe9c86aef69aa986b`;
//! - tokens `[151643, 0, 4294967295, 42]`, `B = 2`, salt `tenant-7`:
//!   `cd5bca70f7a3741e8969500ac5e1ac76`, `d8fe52bd64dcdbccc506995d8f9da83b`.
//!
//! Every process that shares hashes (the router and every node of a cluster) must use the
//! same algorithm: nodes report theirs in `NodeInfo.prefix_caching_hash_algo`, and the router
//! does not route to a node whose algorithm differs from its own.
//!
//! [`block_hashes`] hashes a whole prompt; [`BlockHasher`] does the same incrementally, as a
//! sequence grows token by token during decode, with the same results. Both use XXH3;
//! [`block_hashes_with`] and [`BlockHasher::with_algo`] take the algorithm.
//!
//! Only the hash lives here: which tier holds a hash is the tiers' ([`super::device`],
//! [`super::host_tier`]), and the router's index of every node's hashes is the router's.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The block hash function (vLLM's `--prefix-caching-hash-algo`; see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgo {
    /// XXH3-128 with [`SEED`]: fast, not collision-resistant. The default.
    #[default]
    Xxhash,
    /// SHA-256, first 16 bytes: collision-resistant, slower.
    Sha256,
}

impl HashAlgo {
    pub const ALL: [HashAlgo; 2] = [HashAlgo::Xxhash, HashAlgo::Sha256];

    /// The name vLLM gives it (`xxhash`, `sha256`), as flags and `NodeInfo` write it.
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::Sha256 => "sha256",
        }
    }

    /// The algorithm a node reports in `NodeInfo` (empty: a node from before the field,
    /// which hashes with XXH3).
    pub fn from_reported(name: &str) -> Result<Self, String> {
        if name.is_empty() {
            Ok(HashAlgo::Xxhash)
        } else {
            name.parse()
        }
    }

    fn hash(self, bytes: &[u8]) -> BlockHash {
        match self {
            HashAlgo::Xxhash => BlockHash(xxh3_128_with_seed(bytes, SEED)),
            HashAlgo::Sha256 => {
                let digest = Sha256::digest(bytes);
                let mut first = [0u8; 16];
                first.copy_from_slice(&digest[..16]);
                BlockHash::from_le_bytes(first)
            }
        }
    }
}

/// `xxhash` (also `xxh3`) or `sha256`.
impl FromStr for HashAlgo {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "xxhash" | "xxh3" => Ok(HashAlgo::Xxhash),
            "sha256" => Ok(HashAlgo::Sha256),
            other => Err(format!(
                "unknown prefix caching hash algorithm `{other}`: expected xxhash (xxh3) or sha256"
            )),
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Seed of every XXH3-128 call (see the module doc).
pub const SEED: u64 = 0x7064_2d6b_762d_6831;

/// Domain-separation prefix of the root hash (see the module doc).
pub const DOMAIN: &[u8] = b"pd-engine/kv-block-hash/v1";

/// The chained hash of one full block of tokens (and of every block before it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The 16 bytes little-endian, as they are chained into the next block's hash and as they
    /// should cross process boundaries.
    pub fn to_le_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    pub fn from_le_bytes(bytes: [u8; 16]) -> Self {
        BlockHash(u128::from_le_bytes(bytes))
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

/// 32 lowercase hex digits, most significant first.
impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The parent of block 0 for a cache salt (see the module doc), with XXH3.
pub fn root_hash(salt: Option<&str>) -> BlockHash {
    root_hash_with(salt, HashAlgo::Xxhash)
}

/// The parent of block 0 for a cache salt with `algo`.
pub fn root_hash_with(salt: Option<&str>, algo: HashAlgo) -> BlockHash {
    let mut bytes = Vec::with_capacity(DOMAIN.len() + 9 + salt.map_or(0, str::len));
    bytes.extend_from_slice(DOMAIN);
    match salt {
        None => bytes.push(0x00),
        Some(s) => {
            bytes.push(0x01);
            bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
            bytes.extend_from_slice(s.as_bytes());
        }
    }
    algo.hash(&bytes)
}

/// The hashes of every full block of `tokens`, in order (`tokens.len() / block_size` of them),
/// with XXH3.
///
/// The hashes of a prefix of a prompt are a prefix of the prompt's hashes.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: Option<&str>) -> Vec<BlockHash> {
    block_hashes_with(tokens, block_size, salt, HashAlgo::Xxhash)
}

/// [`block_hashes`] with `algo`.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes_with(
    tokens: &[u32],
    block_size: usize,
    salt: Option<&str>,
    algo: HashAlgo,
) -> Vec<BlockHash> {
    let mut hasher = BlockHasher::with_algo(block_size, salt, algo);
    hasher.reserve(tokens.len());
    hasher.extend(tokens);
    hasher.into_hashes()
}

/// Incremental block hashing of one sequence: feed it the tokens as they come (the prompt at
/// once, then one token per decode step) and it extends the sequence's hashes whenever a
/// block fills up. Gives exactly the hashes of [`block_hashes`] over all tokens fed so far.
#[derive(Clone)]
pub struct BlockHasher {
    block_size: usize,
    algo: HashAlgo,
    /// The next hash's input, `16 + 4 * block_size` bytes: the parent (16 bytes LE), then
    /// the current block's tokens (4 bytes LE each), of which the first `pending` are set.
    buf: Box<[u8]>,
    pending: usize,
    hashes: Vec<BlockHash>,
}

impl BlockHasher {
    /// With XXH3.
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn new(block_size: usize, salt: Option<&str>) -> Self {
        Self::with_algo(block_size, salt, HashAlgo::Xxhash)
    }

    /// # Panics
    /// If `block_size` is 0.
    pub fn with_algo(block_size: usize, salt: Option<&str>, algo: HashAlgo) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let mut buf = vec![0u8; 16 + 4 * block_size].into_boxed_slice();
        buf[..16].copy_from_slice(&root_hash_with(salt, algo).to_le_bytes());
        Self {
            block_size,
            algo,
            buf,
            pending: 0,
            hashes: Vec::new(),
        }
    }

    /// Reserve room for the hashes of `additional_tokens` more tokens.
    pub fn reserve(&mut self, additional_tokens: usize) {
        self.hashes.reserve(additional_tokens / self.block_size + 1);
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Tokens fed so far.
    pub fn num_tokens(&self) -> usize {
        self.hashes.len() * self.block_size + self.pending_tokens()
    }

    /// Tokens of the trailing partial block (not hashed yet).
    pub fn pending_tokens(&self) -> usize {
        self.pending
    }

    /// The hashes of every full block so far.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    pub fn into_hashes(self) -> Vec<BlockHash> {
        self.hashes
    }

    /// Append one token; returns the new block's hash if this token completed a block.
    pub fn push(&mut self, token: u32) -> Option<BlockHash> {
        let at = 16 + 4 * self.pending;
        self.buf[at..at + 4].copy_from_slice(&token.to_le_bytes());
        self.pending += 1;
        if self.pending == self.block_size {
            Some(self.finish_block())
        } else {
            None
        }
    }

    /// Append tokens; returns the hashes of the blocks they completed (possibly none).
    pub fn extend(&mut self, tokens: &[u32]) -> &[BlockHash] {
        let before = self.hashes.len();
        let mut rest = tokens;
        while !rest.is_empty() {
            let room = self.block_size - self.pending;
            let (now, later) = rest.split_at(room.min(rest.len()));
            self.write(now);
            if now.len() == room {
                self.finish_block();
            }
            rest = later;
        }
        &self.hashes[before..]
    }

    /// Append tokens that fit in the current block.
    fn write(&mut self, tokens: &[u32]) {
        let start = 16 + 4 * self.pending;
        let dst = &mut self.buf[start..start + 4 * tokens.len()];
        for (d, t) in dst.chunks_exact_mut(4).zip(tokens) {
            d.copy_from_slice(&t.to_le_bytes());
        }
        self.pending += tokens.len();
    }

    fn finish_block(&mut self) -> BlockHash {
        debug_assert_eq!(self.pending, self.block_size);
        let h = self.algo.hash(&self.buf);
        self.hashes.push(h);
        self.buf[..16].copy_from_slice(&h.to_le_bytes());
        self.pending = 0;
        h
    }
}

impl fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockHasher")
            .field("block_size", &self.block_size)
            .field("algo", &self.algo)
            .field("blocks", &self.hashes.len())
            .field("pending_tokens", &self.pending_tokens())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(hashes: &[BlockHash]) -> Vec<String> {
        hashes.iter().map(ToString::to_string).collect()
    }

    /// Pinned values: any change of the encoding, seed or domain fails here. They were
    /// cross-checked with an independent implementation of the module doc (Python's
    /// `xxhash.xxh3_128_intdigest` over the documented bytes).
    #[test]
    fn hashes_are_pinned() {
        assert_eq!(
            root_hash(None).to_string(),
            "f0a8b16515230896e0f725b5bc616760"
        );
        assert_eq!(
            root_hash(Some("")).to_string(),
            "55ab7b118c8ef6250199a7c4f74bee73"
        );
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(
            hex(&block_hashes(&tokens, 4, None)),
            [
                "39f70764387b67e72cec1c284afe1b30",
                "5660108ab1e34cfaa1fec27070fd5fab"
            ],
        );
        assert_eq!(
            hex(&block_hashes(
                &[151_643, 0, u32::MAX, 42],
                2,
                Some("tenant-7")
            )),
            [
                "fccbc95982a0985835a6213e58d2da19",
                "88e7eb7d49d5257812f90e5302d8706b"
            ],
        );
        let tokens: Vec<u32> = (1000..1016).collect();
        assert_eq!(
            hex(&block_hashes(&tokens, 16, None)),
            ["feb9daa0743745b07357bc20b6a9cc57"]
        );
    }

    /// Pinned SHA-256 values (cross-checked with Python's `hashlib.sha256` over the
    /// documented bytes, first 16 digest bytes read little-endian).
    #[test]
    fn sha256_hashes_are_pinned() {
        let algo = HashAlgo::Sha256;
        assert_eq!(
            root_hash_with(None, algo).to_string(),
            "f9d11a2e73f3ceaffbb9e32144a10439"
        );
        assert_eq!(
            root_hash_with(Some(""), algo).to_string(),
            "d8c78d4a456dd51f880a5102d2bf1369"
        );
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(
            hex(&block_hashes_with(&tokens, 4, None, algo)),
            [
                "ad67d43d598b8ef4347107e7e48f6136",
                "a4b8db875722531fe9c86aef69aa986b"
            ],
        );
        assert_eq!(
            hex(&block_hashes_with(
                &[151_643, 0, u32::MAX, 42],
                2,
                Some("tenant-7"),
                algo
            )),
            [
                "cd5bca70f7a3741e8969500ac5e1ac76",
                "d8fe52bd64dcdbccc506995d8f9da83b"
            ],
        );
        // Incremental hashing agrees, and the two algorithms never share a hash.
        let tokens: Vec<u32> = (0..77).collect();
        let mut h = BlockHasher::with_algo(8, Some("s"), algo);
        h.extend(&tokens);
        let sha = block_hashes_with(&tokens, 8, Some("s"), algo);
        assert_eq!(h.hashes(), &sha[..]);
        let xxh = block_hashes(&tokens, 8, Some("s"));
        assert!(sha.iter().all(|s| !xxh.contains(s)));
    }

    #[test]
    fn algorithm_names() {
        for algo in HashAlgo::ALL {
            assert_eq!(algo.as_str().parse::<HashAlgo>(), Ok(algo));
            assert_eq!(HashAlgo::from_reported(algo.as_str()), Ok(algo));
        }
        assert_eq!("xxh3".parse::<HashAlgo>(), Ok(HashAlgo::Xxhash));
        assert_eq!(HashAlgo::from_reported(""), Ok(HashAlgo::Xxhash));
        assert!("md5".parse::<HashAlgo>().is_err());
        assert_eq!(HashAlgo::default(), HashAlgo::Xxhash);
    }

    #[test]
    fn salt_separates_every_block() {
        let tokens: Vec<u32> = (0..64).map(|i| i * 7 + 3).collect();
        let none = block_hashes(&tokens, 16, None);
        let empty = block_hashes(&tokens, 16, Some(""));
        let a = block_hashes(&tokens, 16, Some("a"));
        let b = block_hashes(&tokens, 16, Some("b"));
        assert_eq!(none.len(), 4);
        let all: Vec<&BlockHash> = [&none, &empty, &a, &b].into_iter().flatten().collect();
        let unique: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len(), "no block hash shared across salts");
        assert_eq!(a, block_hashes(&tokens, 16, Some("a")), "deterministic");
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let tokens: Vec<u32> = (0..47).collect();
        assert_eq!(block_hashes(&tokens, 16, None).len(), 2);
        assert!(block_hashes(&tokens[..15], 16, None).is_empty());
        assert!(block_hashes(&[], 16, None).is_empty());
        assert_eq!(block_hashes(&tokens[..16], 16, None).len(), 1);
        // The partial block's content does not matter.
        let mut other = tokens.clone();
        other[40] = 999;
        assert_eq!(
            block_hashes(&tokens, 16, None),
            block_hashes(&other, 16, None)
        );
    }

    #[test]
    fn prefix_hashes_are_a_prefix_and_content_is_chained() {
        let tokens: Vec<u32> = (0..100).map(|i| i * 31 % 97).collect();
        let full = block_hashes(&tokens, 8, None);
        for n in 0..=tokens.len() {
            let part = block_hashes(&tokens[..n], 8, None);
            assert_eq!(part[..], full[..n / 8]);
        }
        // Changing a token changes its block and every later one, not the earlier ones.
        let mut other = tokens.clone();
        other[20] += 1;
        let changed = block_hashes(&other, 8, None);
        assert_eq!(changed[..2], full[..2]);
        assert!(changed[2..].iter().zip(&full[2..]).all(|(a, b)| a != b));
        // Same block content after a different prefix hashes differently.
        let x = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, None);
        let y = block_hashes(&[9, 9, 9, 9, 5, 6, 7, 8], 4, None);
        assert_ne!(x[1], y[1]);
    }

    #[test]
    fn incremental_matches_one_shot() {
        let tokens: Vec<u32> = (0..203).map(|i| i ^ 0x5a5a).collect();
        for bs in [1, 3, 16, 64] {
            let want = block_hashes(&tokens, bs, Some("s"));
            // Token by token (decode).
            let mut h = BlockHasher::new(bs, Some("s"));
            let mut completed = Vec::new();
            for &t in &tokens {
                completed.extend(h.push(t));
            }
            assert_eq!(completed, want);
            assert_eq!(h.hashes(), &want[..]);
            assert_eq!(h.num_tokens(), tokens.len());
            assert_eq!(h.pending_tokens(), tokens.len() % bs);
            // In uneven chunks (prompt, then steps of various sizes).
            let mut h = BlockHasher::new(bs, Some("s"));
            let mut completed = Vec::new();
            let mut at = 0;
            for chunk in [0, 5, 1, 17, 2, 100].iter().cycle() {
                let end = (at + chunk).min(tokens.len());
                completed.extend_from_slice(h.extend(&tokens[at..end]));
                at = end;
                if at == tokens.len() {
                    break;
                }
            }
            assert_eq!(completed, want);
            assert_eq!(h.into_hashes(), want);
        }
    }

    #[test]
    fn formatting_and_bytes() {
        let h = BlockHash(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(h.to_string(), "0123456789abcdef0011223344556677");
        assert_eq!(
            format!("{h:?}"),
            "BlockHash(0123456789abcdef0011223344556677)"
        );
        assert_eq!(
            format!("{:?}", BlockHash(1)),
            format!("BlockHash({:032x})", 1)
        );
        assert_eq!(h.to_le_bytes()[0], 0x77);
        assert_eq!(BlockHash::from_le_bytes(h.to_le_bytes()), h);
    }
}
