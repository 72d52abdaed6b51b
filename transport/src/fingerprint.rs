//! The layout fingerprint two nodes compare before moving KV.
//!
//! KV computed by one node is usable on another only if both agree on the model, the weight
//! dtype, the cache shape and the type the cache stores (blocks travel as stored). The
//! fingerprint condenses all of it into 64 bits that travel in the control plane
//! (`KvHandle`) and in every transfer request; a mismatch is refused before any KV byte
//! moves.
//!
//! Encoding (version 2, every integer a little-endian `u64`):
//!
//! ```text
//! "pd-kv-layout/v2\0"            16 bytes, the domain
//! num_layers | num_kv_heads | head_dim | block_size
//! KV element type                1 = f32, 2 = f16, 3 = bf16
//! len(model_identity)            then the identity's UTF-8 bytes
//! ```
//!
//! Version 1 (KV always sent as f32) put the element's size, 4, where the type is now.
//!
//! hashed with `XXH3_64bits_withSeed(bytes, SEED)` (`twox_hash::XxHash3_64::oneshot_with_seed`;
//! `xxhash.xxh3_64_intdigest(bytes, seed=SEED)` in Python) where `SEED` =
//! [`LayoutFingerprint::SEED`] = `0x7064_2d6b_762d_6c31` (the ASCII bytes `pd-kv-l1` read
//! big-endian). The value is the same in every process and on every platform.

use std::fmt;
use std::str::FromStr;

use pd_engine::kv::KvLayout;
use pd_engine::weights::DType;
use twox_hash::XxHash3_64;

/// 64-bit identity of a KV layout plus the model that fills it. `Display` writes 16 lowercase
/// hex digits; `FromStr` reads them back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayoutFingerprint(pub u64);

/// The encoding's code of a KV element type (never renumbered).
fn element_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
    }
}

impl LayoutFingerprint {
    /// The fixed seed of the hash (`pd-kv-l1`).
    pub const SEED: u64 = 0x7064_2d6b_762d_6c31;
    /// The encoding's domain prefix; bumping its version changes every fingerprint.
    pub const DOMAIN: &'static [u8; 16] = b"pd-kv-layout/v2\0";

    /// Fingerprint of `layout` filled by `model_identity`: a string naming the model and its
    /// weight dtype, built the same way on every node (for instance
    /// `"<served model name>|<dtype>"`); any difference in it counts as a mismatch.
    pub fn new(layout: &KvLayout, model_identity: &str) -> Self {
        let mut bytes = Vec::with_capacity(16 + 6 * 8 + model_identity.len());
        bytes.extend_from_slice(Self::DOMAIN);
        for v in [
            layout.num_layers as u64,
            layout.num_kv_heads as u64,
            layout.head_dim as u64,
            layout.block_size as u64,
            element_code(layout.dtype),
            model_identity.len() as u64,
        ] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes.extend_from_slice(model_identity.as_bytes());
        Self(XxHash3_64::oneshot_with_seed(Self::SEED, &bytes))
    }
}

impl fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A string that is not 16 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a layout fingerprint is 16 hex digits, got {0:?}")]
pub struct ParseFingerprintError(pub String);

impl FromStr for LayoutFingerprint {
    type Err = ParseFingerprintError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ParseFingerprintError(s.to_string()));
        }
        u64::from_str_radix(s, 16)
            .map(Self)
            .map_err(|_| ParseFingerprintError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_06b() -> KvLayout {
        KvLayout {
            num_layers: 28,
            num_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            dtype: DType::BF16,
        }
    }

    #[test]
    fn fingerprint_is_pinned_across_versions_and_platforms() {
        // Recomputed from the documented encoding; changing it breaks mixed-version clusters.
        let fp = LayoutFingerprint::new(&qwen3_06b(), "Qwen/Qwen3-0.6B|bf16");
        let mut bytes = b"pd-kv-layout/v2\0".to_vec();
        for v in [28u64, 8, 128, 16, 3, 20] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes.extend_from_slice(b"Qwen/Qwen3-0.6B|bf16");
        assert_eq!(
            fp.0,
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 0x7064_2d6b_762d_6c31)
        );
        assert_eq!(fp.to_string(), PINNED_QWEN3_06B);
    }

    const PINNED_QWEN3_06B: &str = "0af78b7a7aeca91e";

    #[test]
    fn every_field_and_the_model_identity_change_it() {
        let base = qwen3_06b();
        let fp = |l: &KvLayout, m: &str| LayoutFingerprint::new(l, m);
        let a = fp(&base, "m|bf16");
        let mut seen = vec![a];
        for change in [
            |l: &mut KvLayout| l.num_layers += 1,
            |l: &mut KvLayout| l.num_kv_heads += 1,
            |l: &mut KvLayout| l.head_dim *= 2,
            |l: &mut KvLayout| l.block_size *= 2,
            |l: &mut KvLayout| l.dtype = DType::F16,
            |l: &mut KvLayout| l.dtype = DType::F32,
        ] {
            let mut l = base.clone();
            change(&mut l);
            seen.push(fp(&l, "m|bf16"));
        }
        seen.push(fp(&base, "m|f32"));
        seen.push(fp(&base, "m2|bf16"));
        let mut dedup = seen.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), seen.len(), "{seen:?}");
        assert_eq!(a, fp(&base, "m|bf16"), "deterministic");
    }

    #[test]
    fn display_is_16_hex_digits_and_parses_back() {
        let fp = LayoutFingerprint(0xab);
        assert_eq!(fp.to_string(), "00000000000000ab");
        assert_eq!("00000000000000ab".parse::<LayoutFingerprint>(), Ok(fp));
        let any = LayoutFingerprint::new(&qwen3_06b(), "x");
        assert_eq!(any.to_string().parse::<LayoutFingerprint>(), Ok(any));
        assert!("ab".parse::<LayoutFingerprint>().is_err());
        assert!("+000000000000000".parse::<LayoutFingerprint>().is_err());
        assert!("00000000000000zz".parse::<LayoutFingerprint>().is_err());
    }
}
