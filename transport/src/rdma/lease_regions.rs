//! Which memory an in-place RDMA offer exposes: exactly one lease's blocks.
//!
//! A lease held in place in a prefill node's host KV memory is read where it lies. The KV memory is
//! a few segments (one per layer's K and V), and a block's piece in segment `j` is the
//! `stride` bytes at `place * stride` of it. Registering whole segments would give every
//! holder of one offer's rkeys read access to all of the node's KV (other tenants' prompts
//! included), so an offer registers, per lease, one range per (segment, run of adjacent
//! places the lease holds) and nothing else ([`LeaseRegions`]); the exporter deregisters
//! them when the lease is released or expires.
//!
//! This module is pure (no verbs): it computes the ranges, and builds the offer from the
//! rkeys the exporter's registrations returned. Registering is the exporter's
//! (`verbs/export.rs`); reading the offer is [`super::plan_reads`]'s.

use pd_engine::serve::LeasedKv;

use super::descriptor::{BlockRun, MAX_OFFER_REGIONS, OfferLayout, RdmaOffer, RemoteRegion};
use super::endpoint::Fabric;

/// A lease's places as sorted runs of adjacent places (duplicates counted once).
pub fn block_runs(places: &[u32]) -> Vec<BlockRun> {
    let mut sorted = places.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<BlockRun> = Vec::new();
    for p in sorted {
        match runs.last_mut() {
            Some(r) if u64::from(r.first) + u64::from(r.len) == u64::from(p) => r.len += 1,
            _ => runs.push(BlockRun { first: p, len: 1 }),
        }
    }
    runs
}

/// The memory one in-place lease's in-place offer registers: for each segment `j` and run
/// `r`, `ranges[j * runs.len() + r]` = (address, length) of the run's pieces in that
/// segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRegions {
    pub stride: u64,
    /// The lease's places in lease order (block `i` lies at `places[i]`).
    pub places: Vec<u32>,
    pub runs: Vec<BlockRun>,
    /// Segment-major, one per (segment, run).
    pub ranges: Vec<(u64, u64)>,
}

impl LeaseRegions {
    /// The ranges of `kv`'s blocks in the host KV memory it lies in; `None` for a
    /// copied lease, a lease whose places lie outside the memory, or one so scattered that
    /// its offer would name more than [`MAX_OFFER_REGIONS`] regions (it is staged then).
    pub fn of(kv: &LeasedKv) -> Option<Self> {
        let (memory, places) = kv.in_place_blocks()?;
        let segments: Vec<(u64, u64)> = memory
            .regions()
            .iter()
            .map(|s| (s.addr(), s.len() as u64))
            .collect();
        Self::new(&segments, memory.stride() as u64, places)
    }

    /// The ranges of the blocks at `places` in memory made of `segments` (address, length),
    /// each holding one `stride`-byte piece per place.
    pub fn new(segments: &[(u64, u64)], stride: u64, places: &[u32]) -> Option<Self> {
        if stride == 0 {
            return None;
        }
        let runs = block_runs(places);
        let count = segments.len().checked_mul(runs.len())?;
        if count > MAX_OFFER_REGIONS as usize {
            return None;
        }
        let mut ranges = Vec::with_capacity(count);
        for &(base, seg_len) in segments {
            for r in &runs {
                let start = u64::from(r.first).checked_mul(stride)?;
                let len = u64::from(r.len).checked_mul(stride)?;
                // The run must lie inside its segment.
                if start.checked_add(len)? > seg_len {
                    return None;
                }
                ranges.push((base.checked_add(start)?, len));
            }
        }
        Some(Self {
            stride,
            places: places.to_vec(),
            runs,
            ranges,
        })
    }

    /// The offer of the lease, its ranges registered under `rkeys` (one per range, in
    /// order), with the lease's checksums. `None` if the rkeys do not match the ranges.
    pub fn offer(
        &self,
        fabric: Fabric,
        connect_addr: String,
        kv: &LeasedKv,
        rkeys: &[u32],
    ) -> Option<RdmaOffer> {
        if rkeys.len() != self.ranges.len() || kv.checksums.len() != self.places.len() {
            return None;
        }
        let segments = self.ranges.len().checked_div(self.runs.len()).unwrap_or(0);
        Some(RdmaOffer {
            fabric,
            connect_addr,
            block_bytes: self.stride * segments as u64,
            regions: self
                .ranges
                .iter()
                .zip(rkeys)
                .map(|(&(addr, len), &rkey)| RemoteRegion { addr, len, rkey })
                .collect(),
            layout: OfferLayout::Strided {
                stride: self.stride,
                blocks: self.places.clone(),
                runs: self.runs.clone(),
            },
            checksums: kv.checksums.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn places_become_sorted_runs() {
        assert_eq!(block_runs(&[]), []);
        assert_eq!(
            block_runs(&[7, 3, 4, 5, 9, 8, 20, 4]),
            [
                BlockRun { first: 3, len: 3 },
                BlockRun { first: 7, len: 3 },
                BlockRun { first: 20, len: 1 },
            ]
        );
        assert_eq!(
            block_runs(&[u32::MAX, u32::MAX - 1]),
            [BlockRun {
                first: u32::MAX - 1,
                len: 2
            }]
        );
    }

    #[test]
    fn each_segment_gets_one_range_per_run_and_nothing_else() {
        // Two segments of 10 places of 64 bytes.
        let segments = [(0x1000, 640), (0x9000, 640)];
        let r = LeaseRegions::new(&segments, 64, &[4, 5, 9, 0]).unwrap();
        assert_eq!(r.runs.len(), 3);
        assert_eq!(
            r.ranges,
            [
                (0x1000, 64),
                (0x1000 + 4 * 64, 128),
                (0x1000 + 9 * 64, 64),
                (0x9000, 64),
                (0x9000 + 4 * 64, 128),
                (0x9000 + 9 * 64, 64),
            ]
        );
        assert!(
            LeaseRegions::new(&segments, 64, &[10]).is_none(),
            "past the end"
        );
        assert!(LeaseRegions::new(&segments, 0, &[1]).is_none());
        // Too scattered for one offer: staged instead.
        let every_other: Vec<u32> = (0..5000).map(|i| i * 2).collect();
        assert!(LeaseRegions::new(&[(0, 64 * 10_000)], 64, &every_other).is_none());
    }

    proptest! {
        /// The property the whole design rests on: a registered byte belongs to a block the
        /// lease holds, and every piece of every leased block is registered.
        #[test]
        fn ranges_cover_exactly_the_leases_pieces(
            stride in 1u64..4096,
            segments in 1usize..6,
            places in proptest::collection::vec(0u32..64, 0..40),
        ) {
            let capacity = 64u64;
            let segs: Vec<(u64, u64)> = (0..segments)
                .map(|j| (0x10_0000 * (j as u64 + 1), capacity * stride))
                .collect();
            let r = LeaseRegions::new(&segs, stride, &places).unwrap();
            prop_assert_eq!(r.ranges.len(), segments * r.runs.len());
            let mut covered = std::collections::BTreeSet::new();
            for &(addr, len) in &r.ranges {
                let (j, &(base, seg_len)) = segs
                    .iter()
                    .enumerate()
                    .find(|(_, (b, l))| *b <= addr && addr + len <= b + l)
                    .expect("a range inside one segment");
                prop_assert!(len > 0 && len % stride == 0 && (addr - base) % stride == 0);
                prop_assert!(addr + len <= base + seg_len);
                for place in (addr - base) / stride..(addr - base + len) / stride {
                    prop_assert!(
                        places.contains(&(place as u32)),
                        "place {} is registered but not leased", place
                    );
                    prop_assert!(covered.insert((j, place)), "registered twice");
                }
            }
            let want: std::collections::BTreeSet<(usize, u64)> = (0..segments)
                .flat_map(|j| places.iter().map(move |&p| (j, u64::from(p))))
                .collect();
            prop_assert_eq!(covered, want);
        }
    }
}
