//! What makes a KV lease a capability: an unguessable lease id and a 128-bit secret, both
//! drawn from the operating system's randomness when the lease is made. Whoever presents a
//! lease (a pull, a release, an RDMA read setup) must present both; a lease id with the
//! wrong secret is treated exactly like an id that does not exist.
//!
//! This module owns the secret's type, its generation and its constant-time comparison;
//! where leases live and who checks them is [`super::lease_store`]'s and the engine's.

use rand::TryRng;
use rand::rngs::SysRng;
use subtle::ConstantTimeEq;

/// Bytes of a lease secret (128 bits).
pub const LEASE_SECRET_LEN: usize = 16;

/// A lease's secret. Compared in constant time (`==` too); never printed (its `Debug` is
/// redacted).
#[derive(Clone, Copy)]
pub struct LeaseSecret([u8; LEASE_SECRET_LEN]);

impl LeaseSecret {
    /// A fresh secret from the operating system's randomness.
    ///
    /// # Panics
    /// If the operating system cannot provide randomness (no lease can be sealed then; the
    /// same condition fails every TLS handshake).
    pub fn random() -> Self {
        let mut b = [0u8; LEASE_SECRET_LEN];
        SysRng
            .try_fill_bytes(&mut b)
            .expect("the operating system's randomness is unavailable");
        Self(b)
    }

    pub const fn from_bytes(bytes: [u8; LEASE_SECRET_LEN]) -> Self {
        Self(bytes)
    }

    /// The secret from a wire field; `None` unless exactly [`LEASE_SECRET_LEN`] bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    pub fn as_bytes(&self) -> &[u8; LEASE_SECRET_LEN] {
        &self.0
    }

    /// Equal secrets, in time independent of where they differ.
    pub fn matches(&self, other: &LeaseSecret) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl PartialEq for LeaseSecret {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other)
    }
}

impl Eq for LeaseSecret {}

impl std::fmt::Debug for LeaseSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseSecret(..)")
    }
}

/// A fresh lease id: random, nonzero, and not `taken` (ids are never sequential, so holding
/// one lease says nothing about the ids of others).
pub fn random_lease_id(taken: impl Fn(u64) -> bool) -> u64 {
    loop {
        let id = SysRng
            .try_next_u64()
            .expect("the operating system's randomness is unavailable");
        if id != 0 && !taken(id) {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_random_compared_whole_and_never_printed() {
        let a = LeaseSecret::random();
        let b = LeaseSecret::random();
        assert_ne!(a, b, "two draws of 128 random bits differ");
        assert!(a.matches(&a));
        assert!(!a.matches(&b));
        let mut one_bit = *a.as_bytes();
        one_bit[15] ^= 1;
        assert!(!a.matches(&LeaseSecret::from_bytes(one_bit)));
        assert_eq!(LeaseSecret::from_slice(a.as_bytes()), Some(a));
        assert_eq!(LeaseSecret::from_slice(&[0; 15]), None);
        assert_eq!(LeaseSecret::from_slice(&[0; 17]), None);
        assert_eq!(format!("{a:?}"), "LeaseSecret(..)");
    }

    #[test]
    fn lease_ids_are_nonzero_unused_and_not_sequential() {
        let ids: Vec<u64> = (0..64).map(|_| random_lease_id(|_| false)).collect();
        assert!(ids.iter().all(|&id| id != 0));
        let steps = ids.windows(2).filter(|w| w[1].wrapping_sub(w[0]) < 1 << 20);
        assert!(steps.count() < 2, "ids do not count up: {ids:?}");
        let first = ids[0];
        let next = random_lease_id(|id| id == first || id % 2 == 0);
        assert!(next != first && next % 2 == 1, "a taken id is never reused");
    }
}
