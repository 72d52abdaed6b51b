//! [`RdmaOffer`]: what a prefill node's `KvHandle.rdma` says about a lease's blocks, and its
//! binary encoding.
//!
//! The blocks of a lease lie back to back in one or more registered regions (the CPU backend
//! uses one region per lease); block `i` is bytes `i * block_bytes .. (i + 1) * block_bytes`
//! of the regions' concatenation. A per-block xxh3-64 checksum lets the reader verify that
//! the bytes it read are the bytes the prefill node published (RDMA's link-level CRC covers
//! the wire, not a region freed and reused under a late reader).
//!
//! Encoding (version 1, integers little-endian):
//!
//! ```text
//! "PDRX"                 4 bytes, magic
//! version: u16           1
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
//! ```

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

/// A lease's blocks as registered RDMA memory on the prefill node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaOffer {
    /// The exporter's port.
    pub fabric: Fabric,
    /// `host:port` of the exporter's gRPC server (for `RdmaConnect`).
    pub connect_addr: String,
    pub block_bytes: u64,
    pub regions: Vec<RemoteRegion>,
    /// One per block.
    pub checksums: Vec<u64>,
}

const MAGIC: [u8; 4] = *b"PDRX";
const VERSION: u16 = 1;
const HEAD_LEN: usize = 4 + 2 + 1 + 1 + 4 + 16 + 8 + 4 + 4 + 4 + 4;
const REGION_LEN: usize = 24;

impl RdmaOffer {
    pub fn num_blocks(&self) -> u64 {
        self.checksums.len() as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            HEAD_LEN
                + self.connect_addr.len()
                + self.regions.len() * REGION_LEN
                + self.checksums.len() * 8,
        );
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
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
        b
    }

    /// Decode and [validate](RdmaOffer::validate).
    pub fn decode(b: &[u8]) -> Result<Self, EndpointError> {
        let mut r = Reader { b, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(EndpointError::BadMagic);
        }
        let version = r.u16()?;
        if version != VERSION {
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
        let expected =
            HEAD_LEN + addr_len + num_regions as usize * REGION_LEN + num_blocks as usize * 8;
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
        let offer = Self {
            fabric: Fabric {
                link_layer,
                lid,
                gid,
            },
            connect_addr,
            block_bytes,
            regions,
            checksums,
        };
        offer.validate()?;
        Ok(offer)
    }

    /// The regions hold exactly the blocks, no region wraps the address space, the fabric is
    /// addressable and the connect address is `host:port`.
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
            checksums: (0..n).map(|i| i * 31 + 7).collect(),
        }
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
    }
}
