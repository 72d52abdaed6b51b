//! Where the bytes of an RDMA READ land when they land in place, in the decode node's KV
//! memory: each planned READ ([`super::plan_reads`]) fills a range of the transfer's byte
//! stream (`count × block_bytes` bytes, block after block in the transfer layout), and that
//! range lies in pieces across the reserved blocks' segments (one per layer's K and V). This
//! module maps every READ onto a scatter list of local entries (address, length, key of the
//! registered region that holds it), splitting READs that would need more entries than the
//! device takes per RDMA READ.
//!
//! Pure and compiled in every build (tested here without a device). It does not register
//! memory or post anything (`verbs`), and it does not decide where blocks lie (the engine's
//! [`pd_engine::kv::handoff::placement`]).

use super::plan::ReadOp;

/// A registered local memory region: READs may write `len` bytes at `addr` under `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRegion {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
}

/// The registered regions a node's READs may land in, sorted by address so a segment's
/// region is found by binary search (a reservation has a segment per block and layer).
#[derive(Debug, Clone, Default)]
pub struct RegionTable {
    regions: Vec<LocalRegion>,
}

impl RegionTable {
    pub fn new(mut regions: Vec<LocalRegion>) -> Self {
        regions.sort_by_key(|r| r.addr);
        Self { regions }
    }

    /// The regions, by address.
    pub fn regions(&self) -> &[LocalRegion] {
        &self.regions
    }

    /// Total registered bytes.
    pub fn bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.len).sum()
    }

    /// `len` bytes at `addr` as a span under the key of the one region that holds them all.
    pub fn span(&self, addr: u64, len: u64) -> Result<LocalSpan, ScatterError> {
        let unregistered = ScatterError::Unregistered { addr, len };
        let end = addr.checked_add(len).ok_or(unregistered.clone())?;
        // The last region starting at or before `addr`.
        let i = self.regions.partition_point(|r| r.addr <= addr);
        let region = i.checked_sub(1).map(|i| self.regions[i]);
        match region {
            Some(r) if r.addr.checked_add(r.len).is_some_and(|r_end| end <= r_end) => {
                Ok(LocalSpan {
                    addr,
                    len,
                    lkey: r.lkey,
                })
            }
            _ => Err(unregistered),
        }
    }
}

/// A piece of the local byte stream a transfer fills: `len` bytes at `addr`, under `lkey`.
/// A transfer's spans, in order, make up its whole stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSpan {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
}

/// One scatter/gather entry: `length` bytes at `addr` of the registered region `lkey`
/// (the verbs layer turns a list of them into rdma-core's `ibv_sge`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// One RDMA READ: `len()` bytes at `remote_addr` under `rkey`, landing in `sges` in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterRead {
    pub remote_addr: u64,
    pub rkey: u32,
    pub sges: Vec<Sge>,
}

impl ScatterRead {
    /// Bytes read.
    pub fn len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.length)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.sges.is_empty()
    }
}

/// A READ that cannot be mapped onto the local memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScatterError {
    #[error("{len} bytes of KV memory at {addr:#x} lie in no region registered for RDMA")]
    Unregistered { addr: u64, len: u64 },
    #[error("a READ of {len} bytes at offset {offset} runs past the {total} bytes reserved")]
    OutOfRange { offset: u64, len: u64, total: u64 },
}

/// The READs of `ops` (offsets into the stream that `spans` make up) as scatter lists of at
/// most `max_sge` entries each (at least 1).
/// - Consecutive ops whose remote bytes continue each other (same rkey) are joined into one
///   READ while it stays within `max_read_bytes`: a strided plan's pieces of blocks that
///   lie side by side on the exporter become one READ.
/// - A READ whose range needs more entries is split into several READs of consecutive
///   remote bytes.
/// - Pieces that continue each other in one registered local region share an entry.
///
/// The result keeps `ops`' order, and each op's pieces in stream order.
pub fn scatter_reads(
    ops: &[ReadOp],
    spans: &[LocalSpan],
    max_sge: usize,
    max_read_bytes: u32,
) -> Result<Vec<ScatterRead>, ScatterError> {
    let max_sge = max_sge.max(1);
    let max_read = u64::from(max_read_bytes);
    // Where each (non-empty) span starts in the stream.
    let spans: Vec<&LocalSpan> = spans.iter().filter(|s| s.len > 0).collect();
    let mut starts = Vec::with_capacity(spans.len());
    let mut total = 0u64;
    for s in &spans {
        starts.push(total);
        total += s.len;
    }
    let mut reads = Vec::with_capacity(ops.len());
    // The READ being built, and its length so far.
    let mut read: Option<(ScatterRead, u64)> = None;
    for op in ops {
        let len = u64::from(op.len);
        let out_of_range = ScatterError::OutOfRange {
            offset: op.local_offset,
            len,
            total,
        };
        if op
            .local_offset
            .checked_add(len)
            .is_none_or(|end| end > total)
        {
            return Err(out_of_range);
        }
        if len == 0 {
            continue;
        }
        let joins = read.as_ref().is_some_and(|(r, n)| {
            r.rkey == op.rkey
                && r.remote_addr.checked_add(*n) == Some(op.remote_addr)
                && n + len <= max_read
        });
        if !joins {
            reads.extend(read.take().map(|(r, _)| r));
            read = Some((
                ScatterRead {
                    remote_addr: op.remote_addr,
                    rkey: op.rkey,
                    sges: Vec::new(),
                },
                0,
            ));
        }
        let (current, current_len) = read.as_mut().expect("set above");
        // The span holding the op's first byte: the last one starting at or before it.
        let mut k = starts.partition_point(|&s| s <= op.local_offset) - 1;
        let (mut at, mut done) = (op.local_offset, 0u64);
        while done < len {
            let span = spans[k];
            let inner = at - starts[k];
            let n = (span.len - inner).min(len - done);
            let piece = Sge {
                addr: span.addr + inner,
                // At most the op's length, which is a u32.
                length: n as u32,
                lkey: span.lkey,
            };
            let continues = current.sges.last().is_some_and(|last| {
                last.lkey == piece.lkey
                    && last.addr + u64::from(last.length) == piece.addr
                    && u64::from(last.length) + n <= u64::from(u32::MAX)
            });
            if continues {
                current.sges.last_mut().expect("checked above").length += piece.length;
            } else {
                if current.sges.len() == max_sge {
                    let next = ScatterRead {
                        remote_addr: op.remote_addr + done,
                        rkey: op.rkey,
                        sges: Vec::new(),
                    };
                    reads.push(std::mem::replace(current, next));
                    *current_len = 0;
                }
                current.sges.push(piece);
            }
            *current_len += n;
            done += n;
            at += n;
            k += 1;
        }
    }
    reads.extend(read.map(|(r, _)| r));
    Ok(reads)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    const MAX: u32 = 4 << 20;

    fn op(remote_addr: u64, local_offset: u64, len: u32) -> ReadOp {
        ReadOp {
            remote_addr,
            rkey: 9,
            local_offset,
            len,
        }
    }

    fn span(addr: u64, len: u64, lkey: u32) -> LocalSpan {
        LocalSpan { addr, len, lkey }
    }

    fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge { addr, length, lkey }
    }

    /// Two blocks of three uneven segments (3, 5 and 2 bytes) in three regions, as a
    /// reservation of physical blocks 4 and 1 lies: nothing adjacent in stream order.
    fn two_blocks() -> Vec<LocalSpan> {
        let region = |r: u64| 0x1000 * (r + 1);
        let mut spans = Vec::new();
        for block in [4u64, 1] {
            for (r, len) in [(0u64, 3u64), (1, 5), (2, 2)] {
                spans.push(span(region(r) + block * 8, len, r as u32 + 100));
            }
        }
        spans
    }

    #[test]
    fn a_read_crossing_segments_and_blocks_scatters_onto_each_piece_in_order() {
        // Stream bytes 2..15: the end of block 0's first segment, its other two, and block 1's
        // first two segments up to their fifth byte.
        let reads = scatter_reads(&[op(0x9000, 2, 13)], &two_blocks(), 16, MAX).unwrap();
        assert_eq!(reads.len(), 1);
        assert_eq!(reads[0].remote_addr, 0x9000);
        assert_eq!(
            reads[0].sges,
            vec![
                sge(0x1000 + 32 + 2, 1, 100),
                sge(0x2000 + 32, 5, 101),
                sge(0x3000 + 32, 2, 102),
                sge(0x1000 + 8, 3, 100),
                sge(0x2000 + 8, 2, 101),
            ]
        );
        assert_eq!(reads[0].len(), 13);
    }

    #[test]
    fn a_read_needing_more_entries_than_the_device_takes_is_split_at_entry_bounds() {
        let reads = scatter_reads(&[op(0x9000, 0, 20)], &two_blocks(), 4, MAX).unwrap();
        let lens: Vec<(u64, usize, u64)> = reads
            .iter()
            .map(|r| (r.remote_addr, r.sges.len(), r.len()))
            .collect();
        // 6 segments: 4 entries (3+5+2+3 bytes), then 2 (5+2): remote bytes continue.
        assert_eq!(lens, [(0x9000, 4, 13), (0x9000 + 13, 2, 7)]);
        assert!(reads.iter().all(|r| r.rkey == 9));
        let one = scatter_reads(&[op(0x9000, 0, 20)], &two_blocks(), 0, MAX).unwrap();
        assert_eq!(one.len(), 6, "a cap of 0 is taken as 1");
    }

    #[test]
    fn pieces_that_continue_each_other_in_one_region_share_an_entry() {
        let spans = [span(0x100, 4, 1), span(0x104, 4, 1), span(0x108, 4, 2)];
        let reads = scatter_reads(&[op(0, 0, 12)], &spans, 8, MAX).unwrap();
        assert_eq!(reads[0].sges, vec![sge(0x100, 8, 1), sge(0x108, 4, 2)]);
        // Merging happens before the cap is checked: one entry still fits two spans.
        let reads = scatter_reads(&[op(0, 0, 8)], &spans, 1, MAX).unwrap();
        assert_eq!(
            reads,
            vec![ScatterRead {
                remote_addr: 0,
                rkey: 9,
                sges: vec![sge(0x100, 8, 1)]
            }]
        );
    }

    #[test]
    fn ops_whose_remote_bytes_continue_each_other_join_one_read_up_to_the_limit() {
        // Two blocks kept side by side on the exporter: piece 0 of each (3 bytes) is
        // remote-contiguous, landing at stream offsets 0 and 10 (segments of blocks 4 and 1).
        let ops = [op(0x9000, 0, 3), op(0x9003, 10, 3), op(0x8000, 3, 5)];
        let reads = scatter_reads(&ops, &two_blocks(), 16, MAX).unwrap();
        assert_eq!(
            reads,
            vec![
                ScatterRead {
                    remote_addr: 0x9000,
                    rkey: 9,
                    sges: vec![sge(0x1000 + 32, 3, 100), sge(0x1000 + 8, 3, 100)],
                },
                ScatterRead {
                    remote_addr: 0x8000,
                    rkey: 9,
                    sges: vec![sge(0x2000 + 32, 5, 101)],
                },
            ]
        );
        // Not past the READ limit, nor across rkeys.
        assert_eq!(scatter_reads(&ops, &two_blocks(), 16, 5).unwrap().len(), 3);
        let mut other_key = ops;
        other_key[1].rkey = 10;
        assert_eq!(
            scatter_reads(&other_key, &two_blocks(), 16, MAX)
                .unwrap()
                .len(),
            3
        );
        // The entry cap still splits a joined READ.
        let reads = scatter_reads(&ops[..2], &two_blocks(), 1, MAX).unwrap();
        assert_eq!(
            reads.iter().map(|r| r.remote_addr).collect::<Vec<_>>(),
            [0x9000, 0x9003]
        );
    }

    #[test]
    fn a_read_past_the_reservation_is_refused_and_an_empty_one_skipped() {
        let spans = two_blocks();
        assert_eq!(
            scatter_reads(&[op(0, 15, 6)], &spans, 4, MAX),
            Err(ScatterError::OutOfRange {
                offset: 15,
                len: 6,
                total: 20
            })
        );
        assert!(scatter_reads(&[op(0, u64::MAX, 1)], &spans, 4, MAX).is_err());
        assert_eq!(scatter_reads(&[op(0, 20, 0)], &spans, 4, MAX), Ok(vec![]));
        assert!(scatter_reads(&[op(0, 0, 1)], &[], 4, MAX).is_err());
    }

    #[test]
    fn a_segment_is_keyed_by_the_region_that_holds_it_whole() {
        let table = RegionTable::new(vec![
            LocalRegion {
                addr: 0x3000,
                len: 0x100,
                lkey: 3,
            },
            LocalRegion {
                addr: 0x1000,
                len: 0x100,
                lkey: 1,
            },
        ]);
        assert_eq!(table.bytes(), 0x200);
        assert_eq!(table.span(0x1000, 0x100).unwrap().lkey, 1);
        assert_eq!(table.span(0x30f0, 0x10).unwrap().lkey, 3);
        for (addr, len) in [(0x10f0, 0x20), (0xfff, 1), (0x2000, 1), (0x3100, 1)] {
            assert_eq!(
                table.span(addr, len),
                Err(ScatterError::Unregistered { addr, len })
            );
        }
        assert!(table.span(u64::MAX, 2).is_err());
    }

    proptest! {
        /// Executing the scatter lists moves every remote byte of every op to the stream
        /// position the op names, exactly once, with no list over the cap; remote bytes and
        /// order are kept.
        #[test]
        fn the_scatter_lists_deliver_each_op_to_its_stream_bytes(
            span_lens in proptest::collection::vec(1u64..40, 1..30),
            op_lens in proptest::collection::vec(1u32..90, 1..12),
            max_sge in 1usize..6,
            gaps in proptest::collection::vec(0u64..3, 30),
            remote_next in proptest::collection::vec(any::<bool>(), 12),
            max_read in 90u32..300,
        ) {
            // Spans scattered over two regions, some adjacent (gap 0: they may merge).
            let mut spans = Vec::new();
            let mut next = [0x10_000u64, 0x90_000u64];
            for (i, &len) in span_lens.iter().enumerate() {
                let r = i % 2;
                next[r] += gaps[i % gaps.len()];
                spans.push(span(next[r], len, r as u32 + 1));
                next[r] += len;
            }
            let total: u64 = span_lens.iter().sum();
            // Consecutive ops covering a prefix of the stream, at scattered remote addresses
            // or continuing the previous op's (those may join one READ).
            let mut ops: Vec<ReadOp> = Vec::new();
            let mut offset = 0u64;
            for (i, &len) in op_lens.iter().enumerate() {
                let len = u64::from(len).min(total - offset);
                if len == 0 {
                    break;
                }
                let remote = match ops.last() {
                    Some(last) if remote_next[i] => last.remote_addr + u64::from(last.len),
                    _ => 0x7_000_000 * (i as u64 + 1),
                };
                ops.push(op(remote, offset, len as u32));
                offset += len;
            }
            let reads = scatter_reads(&ops, &spans, max_sge, max_read).unwrap();
            // Local address -> stream offset, to check each landing place.
            let mut stream_of = HashMap::new();
            let mut k = 0u64;
            for s in &spans {
                for i in 0..s.len {
                    stream_of.insert((s.lkey, s.addr + i), k);
                    k += 1;
                }
            }
            // Remote byte -> the stream offset it must land at.
            let mut want = HashMap::new();
            for o in &ops {
                for i in 0..u64::from(o.len) {
                    want.insert(o.remote_addr + i, o.local_offset + i);
                }
            }
            let mut written = vec![false; total as usize];
            let mut last_remote = 0u64;
            for r in &reads {
                prop_assert!(!r.sges.is_empty() && r.sges.len() <= max_sge);
                prop_assert!(r.len() <= u64::from(max_read));
                prop_assert!(r.remote_addr >= last_remote, "order kept");
                last_remote = r.remote_addr;
                let mut remote = r.remote_addr;
                for e in &r.sges {
                    prop_assert!(e.length > 0);
                    for i in 0..u64::from(e.length) {
                        let at = stream_of[&(e.lkey, e.addr + i)];
                        prop_assert_eq!(Some(&at), want.get(&remote));
                        prop_assert!(!written[at as usize], "a byte written twice");
                        written[at as usize] = true;
                        remote += 1;
                    }
                }
            }
            // Every byte the ops cover, and nothing else.
            let covered = written.iter().filter(|&&w| w).count() as u64;
            prop_assert_eq!(covered, offset);
            prop_assert_eq!(reads.iter().map(ScatterRead::len).sum::<u64>(), offset);
        }
    }
}
