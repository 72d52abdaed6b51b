//! RDMA in place at both ends, without a device: a lease held in place in a prefill node's host KV
//! memory is offered where it lies (a strided offer of regions registered for this lease
//! alone, through its wire encoding); the READs
//! a decode node plans and scatters for it are executed here byte by byte, as a NIC would,
//! from the leased blocks' memory into the decode node's reserved blocks. Every block must
//! land exactly (its checksum and its bytes), no READ may touch a block the lease does not
//! hold, and blocks kept side by side on both nodes must take one READ per region.

use std::sync::Arc;

use pd_engine::kv::handoff::placement::{HostKvMemory, KvReservation, ReservationId};
use pd_engine::serve::LeasedKv;
use pd_transport::rdma::scatter::{LocalSpan, ScatterRead, scatter_reads};
use pd_transport::rdma::{Fabric, LeaseRegions, LinkLayer, OfferLayout, RdmaOffer, plan_reads};
use proptest::prelude::*;

/// Bytes of one block in one region (one layer's K or V, say).
const STRIDE: usize = 64;
/// Regions per block.
const PIECES: usize = 3;
const BLOCK_BYTES: usize = STRIDE * PIECES;

fn fabric() -> Fabric {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[15] = 1;
    Fabric {
        link_layer: LinkLayer::InfiniBand,
        lid: 5,
        gid,
    }
}

/// Lease block `i`'s bytes.
fn pattern(i: usize) -> Vec<u8> {
    (0..BLOCK_BYTES)
        .map(|k| ((i * 131 + k * 7) % 251) as u8)
        .collect()
}

/// A prefill node's KV memory of `capacity` blocks holding the lease's blocks at `places`,
/// the lease held in place there, and its offer as a decode node decodes it.
fn exporter(capacity: usize, places: &[u32]) -> (Arc<LeasedKv>, RdmaOffer) {
    let memory = HostKvMemory::allocate(capacity, BLOCK_BYTES, PIECES).expect("layout");
    // The node's KV gets its bytes the way an import writes them.
    let mut fill = KvReservation::new(
        ReservationId(1),
        0,
        places,
        memory.clone(),
        Arc::new(|_| {}),
    );
    for i in 0..places.len() {
        fill.write_block(i, &pattern(i));
    }
    drop(fill);
    // SAFETY: nothing writes this memory any more while the lease lives.
    let kv = Arc::new(unsafe { LeasedKv::in_place(memory.clone(), places.to_vec()) });
    // What the exporter registers: the lease's blocks alone (here, made-up rkeys).
    let regions = LeaseRegions::of(&kv).expect("a lease held in place");
    let rkeys: Vec<u32> = (0..regions.ranges.len() as u32).map(|k| 500 + k).collect();
    let offer = regions
        .offer(fabric(), "10.0.0.1:50051".into(), &kv, &rkeys)
        .expect("one rkey per range");
    // Nothing registered lies outside the lease's blocks.
    let stride = memory.stride() as u64;
    for &(addr, len) in &regions.ranges {
        let segment = (memory.regions().iter())
            .find(|s| s.addr() <= addr && addr + len <= s.addr() + s.len() as u64)
            .expect("a range inside one segment");
        for place in (addr - segment.addr()) / stride..(addr - segment.addr() + len) / stride {
            assert!(
                places.contains(&(place as u32)),
                "place {place} is not leased"
            );
        }
    }
    let offer = RdmaOffer::decode(&offer.encode()).expect("a valid offer");
    (kv, offer)
}

/// The decode node's registered spans of `into`, block after block.
fn spans(into: &KvReservation) -> Vec<LocalSpan> {
    (0..into.len())
        .flat_map(|i| into.block_segments(i).to_vec())
        .map(|s| LocalSpan {
            addr: s.addr(),
            len: s.len() as u64,
            lkey: 1,
        })
        .collect()
}

/// The remote bytes `read` fetches, taken from the leased blocks' memory; panics on a READ
/// outside its region or over a block the lease does not hold.
fn remote_bytes(read: &ScatterRead, offer: &RdmaOffer, kv: &LeasedKv) -> Vec<u8> {
    let OfferLayout::Strided {
        stride,
        blocks,
        runs,
    } = &offer.layout
    else {
        panic!("an in-place offer is strided");
    };
    let k = (offer.regions.iter())
        .position(|g| g.rkey == read.rkey)
        .expect("a READ under an offered rkey");
    // Region k: segment k / runs, run k % runs.
    let (j, run) = (k / runs.len(), runs[k % runs.len()]);
    let region = offer.regions[k];
    assert!(read.remote_addr >= region.addr);
    assert!(read.remote_addr + read.len() <= region.addr + region.len);
    let mut out = Vec::new();
    let mut at = read.remote_addr - region.addr;
    while (out.len() as u64) < read.len() {
        let place = u64::from(run.first) + at / stride;
        let within = (at % stride) as usize;
        let i = (blocks.iter())
            .position(|&b| u64::from(b) == place)
            .unwrap_or_else(|| panic!("a READ of place {place}, which the lease does not hold"));
        let piece = kv.block_pieces(i)[j];
        let n = (piece.len() - within).min((read.len() - out.len() as u64) as usize);
        out.extend_from_slice(&piece[within..within + n]);
        at += n as u64;
    }
    out
}

/// Writes `bytes` at local address `addr`, which must lie in `into`'s blocks.
fn write_local(into: &mut KvReservation, mut addr: u64, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        let (i, k, offset) = (0..into.len())
            .find_map(|i| {
                into.block_segments(i)
                    .iter()
                    .enumerate()
                    .find(|(_, s)| s.addr() <= addr && addr < s.addr() + s.len() as u64)
                    .map(|(k, s)| (i, k, (addr - s.addr()) as usize))
            })
            .expect("a scatter entry inside the reserved blocks");
        let mut block = into.block_mut(i);
        let segment = &mut block[k];
        let n = (segment.len() - offset).min(bytes.len());
        segment[offset..offset + n].copy_from_slice(&bytes[..n]);
        addr += n as u64;
        bytes = &bytes[n..];
    }
}

/// Pulls lease blocks `first..` into `into` as the RDMA reader would; the READs posted.
fn pull(
    kv: &LeasedKv,
    offer: &RdmaOffer,
    into: &mut KvReservation,
    max_sge: usize,
    max_op: u32,
) -> Vec<ScatterRead> {
    let (first, count) = (into.first_block() as u64, into.len() as u64);
    let ops = plan_reads(offer, first, count, max_op).expect("blocks the lease holds");
    let reads = scatter_reads(&ops, &spans(into), max_sge, max_op).expect("in the reservation");
    for read in &reads {
        let bytes = remote_bytes(read, offer, kv);
        let mut from = 0;
        for sge in &read.sges {
            let n = sge.length as usize;
            write_local(into, sge.addr, &bytes[from..from + n]);
            from += n;
        }
    }
    reads
}

fn assert_landed(into: &mut KvReservation, offer: &RdmaOffer) {
    for i in 0..into.len() {
        let index = into.first_block() + i;
        assert_eq!(into.block_checksum(i, index as u64), offer.checksums[index]);
        assert_eq!(into.block_mut(i).concat(), pattern(index), "block {index}");
    }
}

#[test]
fn blocks_side_by_side_on_both_nodes_take_one_read_per_region() {
    // Lease blocks 1..4 lie at places 3, 4, 5 on the prefill node, block 4 at place 12.
    let (kv, offer) = exporter(16, &[9, 3, 4, 5, 12]);
    // The decode node holds block 0 and reserves places 6, 7, 8 and 0 for the rest.
    let memory = HostKvMemory::allocate(10, BLOCK_BYTES, PIECES).unwrap();
    let mut into = KvReservation::new(ReservationId(2), 1, &[6, 7, 8, 0], memory, Arc::new(|_| {}));
    let reads = pull(&kv, &offer, &mut into, 30, 1 << 20);
    assert_landed(&mut into, &offer);
    // Per region: one READ of three pieces into three adjacent segments (one entry), and
    // one for block 4.
    assert_eq!(reads.len(), 2 * PIECES);
    assert!(reads.iter().all(|r| r.sges.len() == 1));
    let lens: Vec<u64> = reads.iter().map(ScatterRead::len).collect();
    assert_eq!(lens[..2], [3 * STRIDE as u64, STRIDE as u64]);
}

proptest! {
    /// Any lease placement on either node, any scatter/gather cap and READ size: every block
    /// lands exactly, every READ within the device's limits.
    #[test]
    fn any_placement_lands_every_block_exactly(
        remote in Just((0..24u32).collect::<Vec<_>>()).prop_shuffle(),
        local in Just((0..24u32).collect::<Vec<_>>()).prop_shuffle(),
        blocks in 1usize..12,
        first_frac in 0.0f64..1.0,
        max_sge in 1usize..5,
        max_op in 1u32..400,
    ) {
        let (kv, offer) = exporter(24, &remote[..blocks]);
        let first = ((blocks as f64) * first_frac) as usize;
        let memory = HostKvMemory::allocate(24, BLOCK_BYTES, PIECES).unwrap();
        let mut into = KvReservation::new(
            ReservationId(3),
            first,
            &local[..blocks - first],
            memory,
            Arc::new(|_| {}),
        );
        let reads = pull(&kv, &offer, &mut into, max_sge, max_op);
        for r in &reads {
            prop_assert!(!r.sges.is_empty() && r.sges.len() <= max_sge);
            prop_assert!(r.len() <= u64::from(max_op));
        }
        assert_landed(&mut into, &offer);
    }
}
