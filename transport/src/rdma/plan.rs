//! Turning "blocks `first .. first + count` of an offer" into RDMA READ work requests.
//!
//! Each [`ReadOp`] is a contiguous remote range and a contiguous range of the transfer's
//! stream (`count × block_bytes` bytes, block after block in transfer layout).
//! - **Packed** offers: the byte range of the blocks is cut where a region ends and wherever
//!   an operation would pass `max_op_bytes`; pieces of regions that are contiguous in the
//!   exporter's address space under the same rkey are coalesced first, so a lease staged in
//!   one region is read in `ceil(bytes / max_op_bytes)` operations, each landing right after
//!   the previous one in the reader's buffer.
//! - **Strided** offers (the prefill node's KV memory, in place, registered per lease): one
//!   operation per block piece (cut at `max_op_bytes`), ordered segment by segment and,
//!   within a segment, block by block, each under the rkey of the region of its run. Pieces
//!   of blocks the prefill node keeps side by side are then remote-contiguous, consecutive
//!   and under one rkey, so [`super::scatter_reads`] joins them into one READ with one
//!   scatter entry per piece.
//!
//! Per-operation cost dominates below ~256 KiB, so the default operation is 4 MiB
//! (docs/transport.md, throughput model).

use super::descriptor::{BlockRun, OfferLayout, RdmaOffer, RemoteRegion};

/// Default largest RDMA READ: well past where per-operation cost stops mattering, well below
/// the 2 GiB a work request can carry.
pub const DEFAULT_MAX_OP_BYTES: u32 = 4 << 20;

/// One RDMA READ: `len` bytes at `remote_addr` (under `rkey`) into the reader's buffer at
/// `local_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOp {
    pub remote_addr: u64,
    pub rkey: u32,
    pub local_offset: u64,
    pub len: u32,
}

/// A block range the offer does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("blocks {first}..{end} are outside the {held} blocks the prefill node registered")]
pub struct PlanError {
    pub first: u64,
    pub end: u64,
    pub held: u64,
}

/// Regions merged where one continues the other (same rkey, adjacent addresses).
fn coalesce(regions: &[RemoteRegion]) -> Vec<RemoteRegion> {
    let mut out: Vec<RemoteRegion> = Vec::with_capacity(regions.len());
    for r in regions {
        match out.last_mut() {
            Some(last)
                if last.rkey == r.rkey && last.addr.checked_add(last.len) == Some(r.addr) =>
            {
                last.len += r.len;
            }
            _ => out.push(*r),
        }
    }
    out
}

/// The READs that bring blocks `first .. first + count` of `offer` into a buffer of
/// `count * block_bytes` bytes (the stream), none longer than `max_op_bytes`. Packed offers
/// fill the stream front to back; strided offers piece by piece (see the module docs).
pub fn plan_reads(
    offer: &RdmaOffer,
    first: u64,
    count: u64,
    max_op_bytes: u32,
) -> Result<Vec<ReadOp>, PlanError> {
    let held = offer.num_blocks();
    let end = first.checked_add(count).filter(|&e| e <= held);
    let Some(end) = end else {
        return Err(PlanError {
            first,
            end: first.saturating_add(count),
            held,
        });
    };
    let max = u64::from(max_op_bytes.max(1));
    if let OfferLayout::Strided {
        stride,
        blocks,
        runs,
    } = &offer.layout
    {
        // Validated offers have a place per block, in a run; an unvalidated one is refused,
        // not indexed.
        let refused = PlanError {
            first,
            end,
            held: blocks.len() as u64,
        };
        let places = blocks
            .get(first as usize..end as usize)
            .ok_or(refused.clone())?;
        return plan_strided(offer, *stride, places, runs, max).ok_or(refused);
    }
    // In bytes of the regions' concatenation (validated: it is num_blocks * block_bytes).
    let (mut want, want_end) = (first * offer.block_bytes, end * offer.block_bytes);
    let mut ops = Vec::new();
    let mut region_start = 0u64;
    for r in coalesce(&offer.regions) {
        let region_end = region_start + r.len;
        while want < want_end && want < region_end {
            let len = (want_end.min(region_end) - want).min(max);
            ops.push(ReadOp {
                remote_addr: r.addr + (want - region_start),
                rkey: r.rkey,
                local_offset: want - first * offer.block_bytes,
                len: len as u32,
            });
            want += len;
        }
        region_start = region_end;
    }
    Ok(ops)
}

/// The READs of the blocks at `places` of a strided offer (validated: every place lies in
/// one of `runs`, every region holds its run), segment by segment; `None` for an offer that
/// is not.
fn plan_strided(
    offer: &RdmaOffer,
    stride: u64,
    places: &[u32],
    runs: &[BlockRun],
    max: u64,
) -> Option<Vec<ReadOp>> {
    if runs.is_empty() {
        return places.is_empty().then(Vec::new);
    }
    let segments = offer.regions.len() / runs.len();
    let mut ops = Vec::with_capacity(segments * places.len());
    for j in 0..segments {
        for (i, &place) in places.iter().enumerate() {
            let r = OfferLayout::run_of(runs, place)?;
            let region: &RemoteRegion = offer.regions.get(j * runs.len() + r)?;
            let remote = region.addr + u64::from(place - runs[r].first) * stride;
            let local = i as u64 * offer.block_bytes + j as u64 * stride;
            let mut done = 0;
            while done < stride {
                let len = (stride - done).min(max);
                ops.push(ReadOp {
                    remote_addr: remote + done,
                    rkey: region.rkey,
                    local_offset: local + done,
                    len: len as u32,
                });
                done += len;
            }
        }
    }
    Some(ops)
}

#[cfg(test)]
mod tests {
    use super::super::descriptor::tests::{offer, strided};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_region_is_read_in_max_sized_operations() {
        let o = offer(1 << 20, &[10]);
        let ops = plan_reads(&o, 2, 7, 4 << 20).unwrap();
        let lens: Vec<u32> = ops.iter().map(|op| op.len).collect();
        assert_eq!(lens, [4 << 20, 3 << 20]);
        assert_eq!(ops[0].remote_addr, o.regions[0].addr + (2 << 20));
        assert_eq!(ops[1].local_offset, 4 << 20);
    }

    #[test]
    fn adjacent_regions_with_one_rkey_coalesce() {
        let mut o = offer(4096, &[2, 2]);
        o.regions[1].addr = o.regions[0].addr + o.regions[0].len;
        o.regions[1].rkey = o.regions[0].rkey;
        assert_eq!(plan_reads(&o, 0, 4, 1 << 20).unwrap().len(), 1);
        o.regions[1].rkey += 1;
        assert_eq!(plan_reads(&o, 0, 4, 1 << 20).unwrap().len(), 2);
    }

    #[test]
    fn out_of_range_blocks_are_an_error_and_zero_blocks_no_operation() {
        let o = offer(64, &[3]);
        assert_eq!(
            plan_reads(&o, 2, 2, 1024),
            Err(PlanError {
                first: 2,
                end: 4,
                held: 3
            })
        );
        assert!(plan_reads(&o, u64::MAX, 2, 1024).is_err());
        assert_eq!(plan_reads(&o, 3, 0, 1024), Ok(vec![]));
    }

    #[test]
    fn a_strided_offer_is_read_piece_by_piece_segment_by_segment() {
        // Blocks kept at places 4, 5 and 9 by the exporter; three 64-byte pieces per block.
        let o = strided(64, 3, 10, &[4, 5, 9]);
        let ops = plan_reads(&o, 1, 2, 4096).unwrap();
        let got: Vec<(u64, u32, u64)> = ops
            .iter()
            .map(|op| (op.remote_addr, op.rkey, op.local_offset))
            .collect();
        let at = |j: u64, place: u64| 0x1000_0000 * (j + 1) + place * 64;
        assert_eq!(
            got,
            [
                // Runs 4..6 and 9..10: region j * 2 + run, rkey 200 + region.
                (at(0, 5), 200, 0),
                (at(0, 9), 201, 192),
                (at(1, 5), 202, 64),
                (at(1, 9), 203, 256),
                (at(2, 5), 204, 128),
                (at(2, 9), 205, 320),
            ]
        );
        assert!(ops.iter().all(|op| op.len == 64));
        // A piece longer than an operation is cut.
        let ops = plan_reads(&o, 0, 1, 40).unwrap();
        let lens: Vec<u32> = ops.iter().map(|op| op.len).collect();
        assert_eq!(lens, [40, 24, 40, 24, 40, 24]);
        assert_eq!(ops[1].remote_addr, at(0, 4) + 40);
        assert_eq!(ops[1].local_offset, 40);
        assert!(plan_reads(&o, 2, 2, 40).is_err());
    }

    proptest! {
        /// A strided plan, executed against the exporter's KV memory, yields exactly the
        /// requested blocks in transfer layout, each byte once.
        #[test]
        fn a_strided_plan_reads_exactly_the_requested_blocks(
            stride in 1u64..200,
            pieces in 1usize..6,
            places in proptest::collection::vec(0u32..12, 1..8),
            max_op in 1u32..500,
            first_frac in 0.0f64..1.0,
        ) {
            let o = strided(stride, pieces, 12, &places);
            let n = places.len() as u64;
            let first = ((n as f64) * first_frac) as u64;
            let count = n - first;
            // Byte k of region j's memory.
            let f = |j: u64, k: u64| ((j * 7919 + k).wrapping_mul(2_654_435_761) >> 7) as u8;
            let ops = plan_reads(&o, first, count, max_op).unwrap();
            let bb = o.block_bytes;
            let mut local = vec![None; (count * bb) as usize];
            for op in &ops {
                prop_assert!(op.len >= 1 && op.len <= max_op);
                // Region k is segment k / runs' run k % runs (rkey 200 + k).
                let k = (op.rkey - 200) as usize;
                let runs = o.regions.len() / pieces;
                let j = (k / runs) as u64;
                let base = 0x1000_0000 * (j + 1);
                let region = o.regions[k];
                prop_assert!(
                    op.remote_addr >= region.addr
                        && op.remote_addr + u64::from(op.len) <= region.addr + region.len,
                    "a READ inside its region"
                );
                for i in 0..u64::from(op.len) {
                    let slot = &mut local[(op.local_offset + i) as usize];
                    prop_assert!(slot.is_none(), "a byte written twice");
                    *slot = Some(f(j, op.remote_addr + i - base));
                }
            }
            let want: Vec<Option<u8>> = (first..first + count)
                .flat_map(|i| {
                    let place = u64::from(places[i as usize]);
                    (0..pieces as u64).flat_map(move |j| {
                        (0..stride).map(move |b| Some(f(j, place * stride + b)))
                    })
                })
                .collect();
            prop_assert_eq!(local, want);
        }

        /// Executing the plan against the exporter's memory yields exactly the requested
        /// blocks' bytes, with no operation over the limit.
        #[test]
        fn the_plan_reads_exactly_the_requested_bytes(
            block_bytes in 1u64..5000,
            regions in proptest::collection::vec(1u64..6, 1..5),
            max_op in 1u32..20_000,
            first_frac in 0.0f64..1.0,
            count_frac in 0.0f64..1.0,
        ) {
            let o = offer(block_bytes, &regions);
            let n = o.num_blocks();
            let first = ((n as f64) * first_frac) as u64;
            let count = (((n - first) as f64) * count_frac).round() as u64;
            // The exporter's memory: byte k of the concatenation is f(k), placed per region.
            let f = |k: u64| (k.wrapping_mul(2_654_435_761) >> 5) as u8;
            let mut remote = std::collections::HashMap::new();
            let mut k = 0u64;
            for r in &o.regions {
                for i in 0..r.len {
                    remote.insert((r.rkey, r.addr + i), f(k));
                    k += 1;
                }
            }
            let ops = plan_reads(&o, first, count, max_op).unwrap();
            let mut local = vec![None; (count * block_bytes) as usize];
            for op in &ops {
                prop_assert!(op.len >= 1 && op.len <= max_op);
                for i in 0..u64::from(op.len) {
                    let slot = &mut local[(op.local_offset + i) as usize];
                    prop_assert!(slot.is_none(), "a byte written twice");
                    *slot = Some(remote[&(op.rkey, op.remote_addr + i)]);
                }
            }
            let want: Vec<Option<u8>> =
                (first * block_bytes..(first + count) * block_bytes).map(|k| Some(f(k))).collect();
            prop_assert_eq!(local, want);
            // Local offsets only grow: the buffer fills front to back.
            prop_assert!(ops.windows(2).all(|w| w[0].local_offset + u64::from(w[0].len) == w[1].local_offset));
        }
    }
}
