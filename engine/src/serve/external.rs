//! A count per tier outside the device ([`TierKind`]: the host tier, a peer): the external
//! prefix-cache hits of a request or of the engine, split by where the KV came from
//! (`docs/accounting.md`).
//!
//! Owns only the per-tier container. It does not decide what is a hit (the scheduler does,
//! at a request's first admission) nor how a tier is named on the wire or in metrics
//! (pd-proto, node-common and the router map each [`TierKind`]). A new tier is one variant
//! of [`TierKind`] and its entry in [`TierKind::ALL`]; [`PerTier`] grows with it.

use std::ops::{Index, IndexMut};

use crate::kv::prefix::tier::TierKind;

/// One value per [`TierKind`], indexed by the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerTier<T>([T; TierKind::COUNT]);

/// A kind's position in [`TierKind::ALL`] (a fieldless enum: its discriminant).
fn index(kind: TierKind) -> usize {
    kind as usize
}

impl<T: Default + Copy> Default for PerTier<T> {
    fn default() -> Self {
        Self([T::default(); TierKind::COUNT])
    }
}

impl<T: Default + Copy> PerTier<T> {
    /// `value` for `kind`, the default (zero) for every other.
    pub fn only(kind: TierKind, value: T) -> Self {
        let mut out = Self::default();
        out[kind] = value;
        out
    }
}

impl<T: Copy> PerTier<T> {
    /// Each kind with its value, in [`TierKind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (TierKind, T)> + '_ {
        TierKind::ALL.into_iter().map(|k| (k, self[k]))
    }

    pub fn map<U>(&self, f: impl Fn(T) -> U) -> PerTier<U> {
        PerTier(self.0.map(f))
    }
}

impl<T: Copy + std::iter::Sum<T>> PerTier<T> {
    /// The sum over tiers: the external total.
    pub fn total(&self) -> T {
        self.0.iter().copied().sum()
    }
}

impl<T> Index<TierKind> for PerTier<T> {
    type Output = T;
    fn index(&self, kind: TierKind) -> &T {
        &self.0[index(kind)]
    }
}

impl<T> IndexMut<TierKind> for PerTier<T> {
    fn index_mut(&mut self, kind: TierKind) -> &mut T {
        &mut self.0[index(kind)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_kind_at_its_index() {
        for (i, k) in TierKind::ALL.into_iter().enumerate() {
            assert_eq!(index(k), i);
        }
    }

    #[test]
    fn total_is_the_sum_of_the_tiers() {
        let mut p = PerTier::only(TierKind::Host, 16usize);
        p[TierKind::Peer] += 32;
        assert_eq!((p[TierKind::Host], p[TierKind::Peer]), (16, 32));
        assert_eq!(p.total(), 48);
        assert_eq!(p.map(|v| v as u64 * 2).total(), 96);
        assert_eq!(
            p.iter().collect::<Vec<_>>(),
            [(TierKind::Host, 16), (TierKind::Peer, 32)]
        );
    }
}
