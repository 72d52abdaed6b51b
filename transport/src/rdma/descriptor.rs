//! [`RdmaOffer`]: what a prefill node's `KvHandle.rdma` says about a lease's blocks, and its
//! binary encoding.
//!
//! The blocks lie in registered regions in one of two layouts ([`OfferLayout`]):
//! - **packed** (a staged copy, version 1): back to back in one or more regions; block `i`
//!   is bytes `i * block_bytes .. (i + 1) * block_bytes` of the regions' concatenation;
//! - **strided** (in place in the prefill node's KV memory, version 2): the regions are the
//!   KV memory's segments in transfer-layout order (layer 0's K, layer 0's V, layer 1's K,
//!   …), each registered once, and piece `j` of block `i` is the `stride` bytes at
//!   `blocks[i] * stride` of region `j` (`blocks[i]` is where the prefill node keeps the
//!   lease's block `i`).
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
//! version 2 only:
//! stride: u64
//! num_blocks x block: u32      where block i lies in the regions
//! ```
//!
//! A version-1 reader refuses a version-2 offer (and the pull then moves over TCP), so a
//! prefill node keeps writing version 1 for packed offers.

use pd_engine::serve::LeasedKv;

use super::endpoint::{EndpointError, Fabric, LinkLayer};

/// The per-block checksum TCP sends too, computed when the lease is made.
pub use pd_engine::kv::checksum::{BLOCK_SEED, block_checksum};

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

/// How an offer's blocks lie in its regions (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OfferLayout {
    /// Back to back in the regions' concatenation.
    Packed,
    /// Piece `j` of block `i` is `stride` bytes at `blocks[i] * stride` of region `j`.
    Strided { stride: u64, blocks: Vec<u32> },
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
/// Strided offers.
const VERSION_STRIDED: u16 = 2;
const HEAD_LEN: usize = 4 + 2 + 1 + 1 + 4 + 16 + 8 + 4 + 4 + 4 + 4;
const REGION_LEN: usize = 24;

impl RdmaOffer {
    /// The strided offer of `kv`'s blocks where they lie: `regions` are the exporter's
    /// registrations of the host KV memory the lease is pinned in, one per memory region in
    /// order. `None` if the lease is not pinned, or `regions` do not match its memory.
    pub fn in_place(
        fabric: Fabric,
        connect_addr: String,
        regions: &[RemoteRegion],
        kv: &LeasedKv,
    ) -> Option<Self> {
        let (memory, blocks) = kv.pinned_blocks()?;
        let matches = memory.regions().len() == regions.len()
            && memory
                .regions()
                .iter()
                .zip(regions)
                .all(|(m, r)| m.addr() == r.addr && m.len() as u64 == r.len);
        matches.then(|| Self {
            fabric,
            connect_addr,
            block_bytes: memory.block_bytes() as u64,
            regions: regions.to_vec(),
            layout: OfferLayout::Strided {
                stride: memory.stride() as u64,
                blocks: blocks.to_vec(),
            },
            checksums: kv.checksums.clone(),
        })
    }

    pub fn num_blocks(&self) -> u64 {
        self.checksums.len() as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let (version, tail) = match &self.layout {
            OfferLayout::Packed => (VERSION_PACKED, 0),
            OfferLayout::Strided { blocks, .. } => (VERSION_STRIDED, 8 + blocks.len() * 4),
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
        if let OfferLayout::Strided { stride, blocks } = &self.layout {
            b.extend_from_slice(&stride.to_le_bytes());
            for block in blocks {
                b.extend_from_slice(&block.to_le_bytes());
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
        let tail = if version == VERSION_STRIDED {
            8 + num_blocks as usize * 4
        } else {
            0
        };
        let expected = HEAD_LEN
            + addr_len
            + num_regions as usize * REGION_LEN
            + num_blocks as usize * 8
            + tail;
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
            let blocks = (0..num_blocks)
                .map(|_| r.u32())
                .collect::<Result<Vec<_>, _>>()?;
            OfferLayout::Strided { stride, blocks }
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

    /// The regions hold exactly the blocks (packed) or every piece of every block (strided),
    /// no region wraps the address space, the fabric is addressable and the connect address
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
            OfferLayout::Strided { stride, blocks } => self.validate_strided(*stride, blocks),
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

    fn validate_strided(&self, stride: u64, blocks: &[u32]) -> Result<(), EndpointError> {
        let pieces = self.regions.len() as u64;
        if stride == 0 || stride.checked_mul(pieces) != Some(self.block_bytes) {
            return Err(EndpointError::Invalid(format!(
                "{pieces} regions of {stride}-byte pieces do not make {}-byte blocks",
                self.block_bytes
            )));
        }
        if blocks.len() != self.checksums.len() {
            return Err(EndpointError::Invalid(format!(
                "{} block places for {} blocks",
                blocks.len(),
                self.checksums.len()
            )));
        }
        // Every region must hold the piece of the furthest block.
        let Some(&furthest) = blocks.iter().max() else {
            return Ok(());
        };
        let needed = (u64::from(furthest) + 1).checked_mul(stride);
        if let Some(r) = self
            .regions
            .iter()
            .find(|r| needed.is_none_or(|n| r.len < n))
        {
            return Err(EndpointError::Invalid(format!(
                "block place {furthest} lies past the {}-byte region at {:#x}",
                r.len, r.addr
            )));
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

    /// A strided offer: `pieces` regions of `region_blocks` places of `stride` bytes, the
    /// lease's blocks at `places`.
    pub(crate) fn strided(
        stride: u64,
        pieces: usize,
        region_blocks: u64,
        places: &[u32],
    ) -> RdmaOffer {
        let mut o = offer(stride * pieces as u64, &[]);
        o.regions = (0..pieces)
            .map(|j| RemoteRegion {
                addr: 0x1000_0000 * (j as u64 + 1),
                len: region_blocks * stride,
                rkey: 200 + j as u32,
            })
            .collect();
        o.checksums = (0..places.len() as u64).map(|i| i * 17 + 3).collect();
        o.layout = OfferLayout::Strided {
            stride,
            blocks: places.to_vec(),
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
    fn a_strided_offer_round_trips_as_version_2() {
        let o = strided(64, 3, 10, &[4, 5, 9, 0]);
        let b = o.encode();
        assert_eq!(&b[4..6], &[2, 0]);
        assert_eq!(
            b.len(),
            HEAD_LEN + o.connect_addr.len() + 3 * REGION_LEN + 4 * 8 + 8 + 4 * 4
        );
        assert_eq!(RdmaOffer::decode(&b), Ok(o));
        // Dropping the version-2 tail is a length error, not a packed offer.
        let mut v1 = b[..b.len() - 8 - 16].to_vec();
        assert!(RdmaOffer::decode(&v1).is_err());
        v1[4] = 1;
        assert!(
            RdmaOffer::decode(&v1).is_err(),
            "3 regions of 640 bytes are not 4 blocks"
        );
    }

    #[test]
    fn inconsistent_strided_offers_are_refused() {
        let refused = |o: RdmaOffer, what: &str| {
            let e = RdmaOffer::decode(&o.encode()).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        // A place past the regions' end.
        refused(
            strided(64, 3, 10, &[10]),
            "block place 10 lies past the 640-byte region",
        );
        let mut o = strided(64, 3, 10, &[1]);
        o.regions[2].len = 64;
        refused(o, "block place 1 lies past the 64-byte region");
        // Pieces that do not make the block.
        let mut o = strided(64, 3, 10, &[1]);
        o.block_bytes = 200;
        refused(o, "3 regions of 64-byte pieces do not make 200-byte blocks");
        let mut o = strided(64, 3, 10, &[1]);
        o.layout = OfferLayout::Strided {
            stride: 0,
            blocks: vec![1],
        };
        o.block_bytes = 0;
        refused(o, "block size of 0 bytes");
        // A version other than 1 or 2.
        let mut b = strided(64, 3, 10, &[1]).encode();
        b[4] = 3;
        assert_eq!(RdmaOffer::decode(&b), Err(EndpointError::Version(3)));
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
