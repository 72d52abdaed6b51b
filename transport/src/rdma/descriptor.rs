//! [`RdmaOffer`]: what a prefill node's `KvHandle.rdma` says about a lease's blocks, and its
//! binary encoding.
//!
//! The blocks lie in registered regions in one of two layouts ([`OfferLayout`]):
//! - **packed** (a staged copy, version 1): back to back in one or more regions; block `i`
//!   is bytes `i * block_bytes .. (i + 1) * block_bytes` of the regions' concatenation;
//! - **strided** (in place in the prefill node's KV memory, version 3): the lease's places
//!   (`blocks[i]` is where the prefill node keeps the lease's block `i`) form sorted runs of
//!   adjacent places; for each KV memory segment `j` in transfer-layout order (layer 0's K,
//!   layer 0's V, layer 1's K, …) and each run `r`, region `j * runs + r` is that run's
//!   pieces in that segment, registered for this lease alone. Piece `j` of block `i` is the
//!   `stride` bytes at `(blocks[i] - runs[r].first) * stride` of region `j * runs + r`, `r`
//!   the run holding `blocks[i]`. The regions hold the lease's blocks and nothing else
//!   (validated: every run place is a lease place), never the whole KV memory
//!   ([`super::lease_regions`]).
//!
//! A per-block xxh3-64 checksum lets the reader verify that the bytes it read are the bytes
//! the prefill node published (RDMA's link-level CRC covers the wire, not a staging region
//! freed and reused, nor a KV block given to another request, under a late reader).
//!
//! Encoding (integers little-endian):
//!
//! ```text
//! "PDRX"                 4 bytes, magic
//! version: u16           1 (packed) or 2 (strided)
//! link_layer: u8         as in the endpoint encoding
//! reserved: u8           0
//! lid: u16, reserved u16
//! gid: [u8; 16]
//! block_bytes: u64
//! num_blocks: u32
//! num_regions: u32
//! connect_addr_len: u32, reserved u32, then the address's UTF-8 bytes (host:port of the
//!                        prefill node's gRPC server, where RdmaConnect is called)
//! num_regions x (addr: u64, len: u64, rkey: u32, reserved: u32)
//! num_blocks x checksum: u64   xxh3-64 of block i's bytes with seed BLOCK_SEED + i
//! version 3 only:
//! stride: u64
//! num_runs: u32, reserved u32
//! num_blocks x block: u32      where block i lies (its place)
//! num_runs x (first: u32, len: u32)   the runs of places, sorted, disjoint
//! ```
//!
//! A reader of another version refuses the offer (and the pull then moves over TCP), so a
//! prefill node keeps writing version 1 for packed offers. Version 2 offers named the whole
//! KV memory's segments; they are refused.

use super::endpoint::{EndpointError, Fabric, LinkLayer};

/// The per-block checksum TCP sends too, computed when the lease is made.
pub use pd_engine::kv::handoff::checksum::{BLOCK_SEED, block_checksum};

/// Most blocks one offer may describe (a 1 M-token prompt in blocks of 16 tokens is 65,536).
pub const MAX_OFFER_BLOCKS: u32 = 1 << 20;
/// Most regions one offer may name.
pub const MAX_OFFER_REGIONS: u32 = 4096;
/// Longest connect address.
pub const MAX_CONNECT_ADDR: usize = 255;

/// One registered region as the remote side reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the region's first byte in the exporter's address space.
    pub addr: u64,
    pub len: u64,
    /// The region's remote key.
    pub rkey: u32,
}

/// Places `first .. first + len` of the prefill node's KV memory, all held by one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockRun {
    pub first: u32,
    pub len: u32,
}

impl BlockRun {
    fn end(&self) -> u64 {
        u64::from(self.first) + u64::from(self.len)
    }
}

/// How an offer's blocks lie in its regions (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OfferLayout {
    /// Back to back in the regions' concatenation.
    Packed,
    /// Piece `j` of block `i` is `stride` bytes at `(blocks[i] - runs[r].first) * stride`
    /// of region `j * runs.len() + r`, where run `r` holds `blocks[i]`.
    Strided {
        stride: u64,
        blocks: Vec<u32>,
        runs: Vec<BlockRun>,
    },
}

impl OfferLayout {
    /// The run holding `place` of a strided layout's sorted `runs`.
    pub fn run_of(runs: &[BlockRun], place: u32) -> Option<usize> {
        let r = runs.partition_point(|r| r.first <= place).checked_sub(1)?;
        (u64::from(place) < runs[r].end()).then_some(r)
    }
}

impl OfferLayout {
    /// How the prefill node exported the lease this layout describes.
    pub fn export_mode(&self) -> ExportMode {
        match self {
            Self::Packed => ExportMode::Staged,
            Self::Strided { .. } => ExportMode::InPlace,
        }
    }
}

/// How a prefill node exports a lease for RDMA reads (`pd_node_kv_rdma_offers_total`'s
/// `layout` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExportMode {
    /// Where the engine keeps the blocks, in KV memory registered once (a strided offer).
    InPlace,
    /// A copy registered for the lease alone (a packed offer).
    Staged,
}

impl ExportMode {
    pub const ALL: [Self; 2] = [Self::InPlace, Self::Staged];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InPlace => "in_place",
            Self::Staged => "staged",
        }
    }
}

/// A lease's blocks as registered RDMA memory on the prefill node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaOffer {
    /// The exporter's port.
    pub fabric: Fabric,
    /// `host:port` of the exporter's gRPC server (for `RdmaConnect`).
    pub connect_addr: String,
    pub block_bytes: u64,
    pub regions: Vec<RemoteRegion>,
    pub layout: OfferLayout,
    /// One per block.
    pub checksums: Vec<u64>,
}

const MAGIC: [u8; 4] = *b"PDRX";
/// Packed offers.
const VERSION_PACKED: u16 = 1;
/// Strided offers (per-lease regions).
const VERSION_STRIDED: u16 = 3;
const HEAD_LEN: usize = 4 + 2 + 1 + 1 + 4 + 16 + 8 + 4 + 4 + 4 + 4;
const REGION_LEN: usize = 24;

impl RdmaOffer {
    pub fn num_blocks(&self) -> u64 {
        self.checksums.len() as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let (version, tail) = match &self.layout {
            OfferLayout::Packed => (VERSION_PACKED, 0),
            OfferLayout::Strided { blocks, runs, .. } => {
                (VERSION_STRIDED, 16 + blocks.len() * 4 + runs.len() * 8)
            }
        };
        let mut b = Vec::with_capacity(
            HEAD_LEN
                + self.connect_addr.len()
                + self.regions.len() * REGION_LEN
                + self.checksums.len() * 8
                + tail,
        );
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&version.to_le_bytes());
        b.push(match self.fabric.link_layer {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        });
        b.push(0);
        b.extend_from_slice(&self.fabric.lid.to_le_bytes());
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&self.fabric.gid);
        b.extend_from_slice(&self.block_bytes.to_le_bytes());
        b.extend_from_slice(&(self.checksums.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.connect_addr.len() as u32).to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(self.connect_addr.as_bytes());
        for r in &self.regions {
            b.extend_from_slice(&r.addr.to_le_bytes());
            b.extend_from_slice(&r.len.to_le_bytes());
            b.extend_from_slice(&r.rkey.to_le_bytes());
            b.extend_from_slice(&[0; 4]);
        }
        for c in &self.checksums {
            b.extend_from_slice(&c.to_le_bytes());
        }
        if let OfferLayout::Strided {
            stride,
            blocks,
            runs,
        } = &self.layout
        {
            b.extend_from_slice(&stride.to_le_bytes());
            b.extend_from_slice(&(runs.len() as u32).to_le_bytes());
            b.extend_from_slice(&[0; 4]);
            for block in blocks {
                b.extend_from_slice(&block.to_le_bytes());
            }
            for run in runs {
                b.extend_from_slice(&run.first.to_le_bytes());
                b.extend_from_slice(&run.len.to_le_bytes());
            }
        }
        b
    }

    /// Decode and [validate](RdmaOffer::validate).
    pub fn decode(b: &[u8]) -> Result<Self, EndpointError> {
        let mut r = Reader { b, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(EndpointError::BadMagic);
        }
        let version = r.u16()?;
        if version != VERSION_PACKED && version != VERSION_STRIDED {
            return Err(EndpointError::Version(version));
        }
        let link_layer = match r.u8()? {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            c => return Err(EndpointError::Invalid(format!("link layer code {c}"))),
        };
        r.u8()?;
        let lid = r.u16()?;
        r.u16()?;
        let gid: [u8; 16] = r.take(16)?.try_into().expect("16 bytes");
        let block_bytes = r.u64()?;
        let num_blocks = r.u32()?;
        let num_regions = r.u32()?;
        let addr_len = r.u32()? as usize;
        r.u32()?;
        if num_blocks > MAX_OFFER_BLOCKS
            || num_regions > MAX_OFFER_REGIONS
            || addr_len > MAX_CONNECT_ADDR
        {
            return Err(EndpointError::Invalid(format!(
                "{num_blocks} blocks, {num_regions} regions, a {addr_len}-byte address: over \
                 the limits ({MAX_OFFER_BLOCKS}, {MAX_OFFER_REGIONS}, {MAX_CONNECT_ADDR})"
            )));
        }
        let fixed =
            HEAD_LEN + addr_len + num_regions as usize * REGION_LEN + num_blocks as usize * 8;
        // Version 3: the number of runs comes after the checksums.
        let num_runs = if version == VERSION_STRIDED {
            let at = fixed + 8;
            let runs = b
                .get(at..at + 4)
                .map(|n| u32::from_le_bytes(n.try_into().expect("4 bytes")))
                .ok_or(EndpointError::Length {
                    got: b.len(),
                    expected: at + 4,
                })?;
            if runs > num_blocks {
                return Err(EndpointError::Invalid(format!(
                    "{runs} runs for {num_blocks} blocks"
                )));
            }
            runs as usize
        } else {
            0
        };
        let tail = if version == VERSION_STRIDED {
            16 + num_blocks as usize * 4 + num_runs * 8
        } else {
            0
        };
        let expected = fixed + tail;
        if b.len() != expected {
            return Err(EndpointError::Length {
                got: b.len(),
                expected,
            });
        }
        let connect_addr = String::from_utf8(r.take(addr_len)?.to_vec())
            .map_err(|_| EndpointError::Invalid("connect address is not UTF-8".into()))?;
        let mut regions = Vec::with_capacity(num_regions as usize);
        for _ in 0..num_regions {
            let (addr, len, rkey) = (r.u64()?, r.u64()?, r.u32()?);
            r.u32()?;
            regions.push(RemoteRegion { addr, len, rkey });
        }
        let checksums = (0..num_blocks)
            .map(|_| r.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let layout = if version == VERSION_STRIDED {
            let stride = r.u64()?;
            r.u32()?; // the number of runs, read above
            r.u32()?;
            let blocks = (0..num_blocks)
                .map(|_| r.u32())
                .collect::<Result<Vec<_>, _>>()?;
            let runs = (0..num_runs)
                .map(|_| {
                    Ok(BlockRun {
                        first: r.u32()?,
                        len: r.u32()?,
                    })
                })
                .collect::<Result<Vec<_>, EndpointError>>()?;
            OfferLayout::Strided {
                stride,
                blocks,
                runs,
            }
        } else {
            OfferLayout::Packed
        };
        let offer = Self {
            fabric: Fabric {
                link_layer,
                lid,
                gid,
            },
            connect_addr,
            block_bytes,
            regions,
            layout,
            checksums,
        };
        offer.validate()?;
        Ok(offer)
    }

    /// The regions hold exactly the blocks (packed) or exactly the pieces of the lease's
    /// blocks (strided: nothing else), no region wraps the address space, the fabric is addressable and the connect address
    /// is `host:port`.
    pub fn validate(&self) -> Result<(), EndpointError> {
        self.fabric.validate()?;
        if self.block_bytes == 0 {
            return Err(EndpointError::Invalid("block size of 0 bytes".into()));
        }
        if self
            .connect_addr
            .rsplit_once(':')
            .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
        {
            return Err(EndpointError::Invalid(format!(
                "connect address {:?} is not host:port",
                self.connect_addr
            )));
        }
        let mut total = 0u64;
        for r in &self.regions {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(EndpointError::Invalid(format!(
                    "region at {:#x} of {} bytes",
                    r.addr, r.len
                )));
            }
            total = total
                .checked_add(r.len)
                .ok_or_else(|| EndpointError::Invalid("regions longer than 2^64 bytes".into()))?;
        }
        match &self.layout {
            OfferLayout::Packed => self.validate_packed(total),
            OfferLayout::Strided {
                stride,
                blocks,
                runs,
            } => self.validate_strided(*stride, blocks, runs),
        }
    }

    fn validate_packed(&self, total: u64) -> Result<(), EndpointError> {
        let blocks_bytes = self.num_blocks().checked_mul(self.block_bytes);
        if blocks_bytes != Some(total) {
            return Err(EndpointError::Invalid(format!(
                "regions hold {total} bytes, {} blocks of {} bytes need {}",
                self.num_blocks(),
                self.block_bytes,
                blocks_bytes.map_or("more than 2^64".to_string(), |b| b.to_string())
            )));
        }
        Ok(())
    }

    fn validate_strided(
        &self,
        stride: u64,
        blocks: &[u32],
        runs: &[BlockRun],
    ) -> Result<(), EndpointError> {
        let invalid = |m: String| Err(EndpointError::Invalid(m));
        if blocks.len() != self.checksums.len() {
            return invalid(format!(
                "{} block places for {} blocks",
                blocks.len(),
                self.checksums.len()
            ));
        }
        // Runs: sorted, disjoint, not empty, and each place of each run a lease place.
        let mut places = blocks.to_vec();
        places.sort_unstable();
        places.dedup();
        let mut run_places = 0u64;
        for (k, run) in runs.iter().enumerate() {
            if run.len == 0 || run.end() > 1 << 32 {
                return invalid(format!("run of {} places from {}", run.len, run.first));
            }
            if k > 0 && u64::from(run.first) < runs[k - 1].end() {
                return invalid("runs out of order or overlapping".into());
            }
            run_places += u64::from(run.len);
        }
        if run_places != places.len() as u64
            || places
                .iter()
                .any(|&p| OfferLayout::run_of(runs, p).is_none())
        {
            return invalid(format!(
                "the runs cover {run_places} places, the lease holds {} distinct ones: an \
                 offer exposes the lease's blocks and nothing else",
                places.len()
            ));
        }
        if runs.is_empty() {
            return if self.regions.is_empty() {
                Ok(())
            } else {
                invalid("regions without blocks".into())
            };
        }
        let segments = self.regions.len() / runs.len();
        if stride == 0
            || !self.regions.len().is_multiple_of(runs.len())
            || stride.checked_mul(segments as u64) != Some(self.block_bytes)
        {
            return invalid(format!(
                "{} regions of {} runs of {stride}-byte pieces do not make {}-byte blocks",
                self.regions.len(),
                runs.len(),
                self.block_bytes
            ));
        }
        for (k, region) in self.regions.iter().enumerate() {
            let run = runs[k % runs.len()];
            if u64::from(run.len).checked_mul(stride) != Some(region.len) {
                return invalid(format!(
                    "the {}-byte region at {:#x} does not hold a run of {} places of {stride} \
                     bytes",
                    region.len, region.addr, run.len
                ));
            }
        }
        Ok(())
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EndpointError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(EndpointError::Length {
                got: self.b.len(),
                expected: self.at.saturating_add(n),
            });
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, EndpointError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, EndpointError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, EndpointError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, EndpointError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn offer(block_bytes: u64, region_blocks: &[u64]) -> RdmaOffer {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[15] = 1;
        let regions = region_blocks
            .iter()
            .enumerate()
            .map(|(i, &n)| RemoteRegion {
                addr: 0x1000_0000 * (i as u64 + 1),
                len: n * block_bytes,
                rkey: 100 + i as u32,
            })
            .collect();
        let n: u64 = region_blocks.iter().sum();
        RdmaOffer {
            fabric: Fabric {
                link_layer: LinkLayer::InfiniBand,
                lid: 3,
                gid,
            },
            connect_addr: "prefill-0.pd:50051".into(),
            block_bytes,
            regions,
            layout: OfferLayout::Packed,
            checksums: (0..n).map(|i| i * 31 + 7).collect(),
        }
    }

    /// A strided offer of the lease whose blocks lie at `places` in KV memory of `pieces`
    /// segments of `region_blocks` places of `stride` bytes: per-lease regions, as
    /// [`super::super::lease_regions::LeaseRegions`] computes them.
    pub(crate) fn strided(
        stride: u64,
        pieces: usize,
        region_blocks: u64,
        places: &[u32],
    ) -> RdmaOffer {
        let segments: Vec<(u64, u64)> = (0..pieces)
            .map(|j| (0x1000_0000 * (j as u64 + 1), region_blocks * stride))
            .collect();
        let lease = super::super::lease_regions::LeaseRegions::new(&segments, stride, places)
            .expect("places inside the segments");
        let mut o = offer(stride * pieces as u64, &[]);
        o.regions = lease
            .ranges
            .iter()
            .enumerate()
            .map(|(k, &(addr, len))| RemoteRegion {
                addr,
                len,
                rkey: 200 + k as u32,
            })
            .collect();
        o.checksums = (0..places.len() as u64).map(|i| i * 17 + 3).collect();
        o.layout = OfferLayout::Strided {
            stride,
            blocks: places.to_vec(),
            runs: lease.runs,
        };
        o
    }

    #[test]
    fn round_trips_and_starts_with_the_documented_header() {
        let o = offer(4096, &[3, 1]);
        let b = o.encode();
        assert_eq!(&b[..4], b"PDRX");
        assert_eq!(&b[4..6], &[1, 0]);
        assert_eq!(
            b.len(),
            HEAD_LEN + o.connect_addr.len() + 2 * REGION_LEN + 4 * 8
        );
        assert_eq!(RdmaOffer::decode(&b), Ok(o));
    }

    #[test]
    fn inconsistent_offers_are_refused() {
        let mut o = offer(4096, &[2]);
        o.checksums.push(0);
        let e = RdmaOffer::decode(&o.encode()).unwrap_err().to_string();
        assert!(e.contains("3 blocks of 4096 bytes need 12288"), "{e}");
        let mut o = offer(4096, &[2]);
        o.connect_addr = "no-port".into();
        assert!(RdmaOffer::decode(&o.encode()).is_err());
        let mut o = offer(4096, &[2]);
        o.regions[0].addr = u64::MAX - 10;
        assert!(RdmaOffer::decode(&o.encode()).is_err());
        let b = offer(4096, &[2]).encode();
        assert!(matches!(
            RdmaOffer::decode(&b[..b.len() - 1]),
            Err(EndpointError::Length { .. })
        ));
        let mut long = b.clone();
        long.push(0);
        assert!(RdmaOffer::decode(&long).is_err());
        assert!(RdmaOffer::decode(&[]).is_err());
    }

    #[test]
    fn a_strided_offer_round_trips_as_version_3() {
        let o = strided(64, 3, 10, &[4, 5, 9, 0]);
        assert_eq!(o.regions.len(), 3 * 3, "3 segments x 3 runs");
        let b = o.encode();
        assert_eq!(&b[4..6], &[3, 0]);
        assert_eq!(
            b.len(),
            HEAD_LEN + o.connect_addr.len() + 9 * REGION_LEN + 4 * 8 + 16 + 4 * 4 + 3 * 8
        );
        assert_eq!(RdmaOffer::decode(&b), Ok(o));
        // Dropping the version-3 tail is a length error, not a packed offer.
        let v1 = b[..b.len() - 16 - 16 - 24].to_vec();
        assert!(RdmaOffer::decode(&v1).is_err());
    }

    #[test]
    fn inconsistent_strided_offers_are_refused() {
        let refused = |o: RdmaOffer, what: &str| {
            let e = RdmaOffer::decode(&o.encode()).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        let with_runs = |mut o: RdmaOffer, new_runs: Vec<BlockRun>| {
            if let OfferLayout::Strided { runs, .. } = &mut o.layout {
                *runs = new_runs;
            }
            o
        };
        // A run holding a place the lease does not: the offer would expose another block.
        let o = strided(64, 3, 10, &[1, 2]);
        refused(
            with_runs(o, vec![BlockRun { first: 1, len: 3 }]),
            "an offer exposes the lease's blocks and nothing else",
        );
        // A place outside every run.
        let o = strided(64, 3, 10, &[1, 5]);
        refused(
            with_runs(o, vec![BlockRun { first: 1, len: 2 }]),
            "the lease holds 2 distinct ones",
        );
        // A region longer than its run: it would expose the next block.
        let mut o = strided(64, 3, 10, &[1]);
        o.regions[2].len = 128;
        refused(o, "does not hold a run of 1 places");
        // Overlapping runs.
        let o = strided(64, 1, 10, &[1, 2]);
        let mut o = with_runs(
            o,
            vec![BlockRun { first: 1, len: 1 }, BlockRun { first: 1, len: 2 }],
        );
        o.regions.push(o.regions[0]);
        refused(o, "out of order or overlapping");
        // Pieces that do not make the block.
        let mut o = strided(64, 3, 10, &[1]);
        o.block_bytes = 200;
        refused(o, "do not make 200-byte blocks");
        let mut o = strided(64, 3, 10, &[1]);
        if let OfferLayout::Strided { stride, .. } = &mut o.layout {
            *stride = 0;
        }
        o.block_bytes = 0;
        refused(o, "block size of 0 bytes");
        // Version 2 (whole-memory segments) and others are refused.
        for version in [2u8, 4] {
            let mut b = strided(64, 3, 10, &[1]).encode();
            b[4] = version;
            assert_eq!(
                RdmaOffer::decode(&b),
                Err(EndpointError::Version(u16::from(version)))
            );
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = RdmaOffer::decode(&bytes);
        }

        #[test]
        fn any_consistent_offer_round_trips(
            block_bytes in 1u64..1 << 22,
            regions in proptest::collection::vec(1u64..50, 1..6),
        ) {
            let o = offer(block_bytes, &regions);
            prop_assert_eq!(RdmaOffer::decode(&o.encode()), Ok(o));
        }

        #[test]
        fn any_consistent_strided_offer_round_trips(
            stride in 1u64..1 << 16,
            pieces in 1usize..60,
            places in proptest::collection::vec(0u32..1000, 0..40),
        ) {
            let o = strided(stride, pieces, 1000, &places);
            prop_assert_eq!(RdmaOffer::decode(&o.encode()), Ok(o));
        }
    }
}
