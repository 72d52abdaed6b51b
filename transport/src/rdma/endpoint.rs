//! A port's place on the fabric ([`Fabric`]) and a queue pair's endpoint ([`QpEndpoint`]),
//! with the binary encoding they travel in over gRPC (`RdmaConnectRequest.endpoint`,
//! `RdmaConnectResponse.endpoint`, and inside the `KvHandle.rdma` descriptor).
//!
//! Encoding of an endpoint (version 1, 40 bytes, integers little-endian):
//!
//! ```text
//! "PDRE"          4 bytes, magic
//! version: u16    1
//! link_layer: u8  1 InfiniBand, 2 Ethernet (RoCE)
//! port: u8        the HCA port (1-based)
//! lid: u16        InfiniBand local id (0 on Ethernet)
//! mtu: u8         path MTU code: 1=256 2=512 3=1024 4=2048 5=4096 (ibverbs' enum ibv_mtu)
//! reserved: u8    0
//! qpn: u32        queue pair number (24 bits)
//! psn: u32        first packet sequence number (24 bits)
//! reserved: u32   0
//! gid: [u8; 16]   the port's GID (network byte order, as the HCA reports it)
//! ```
//!
//! Decoding validates every field, so a corrupt or hostile peer is refused before any verbs
//! call sees its values.

use std::fmt;

/// The link layer of an RDMA port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    InfiniBand,
    /// RoCE: RDMA over Converged Ethernet; routed by GID (an IP address).
    Ethernet,
}

impl LinkLayer {
    fn code(self) -> u8 {
        match self {
            Self::InfiniBand => 1,
            Self::Ethernet => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::InfiniBand),
            2 => Some(Self::Ethernet),
            _ => None,
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InfiniBand => "InfiniBand",
            Self::Ethernet => "Ethernet (RoCE)",
        })
    }
}

/// Path MTU of a connection (the smaller of both ports' active MTUs is used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathMtu {
    Mtu256 = 1,
    Mtu512 = 2,
    Mtu1024 = 3,
    Mtu2048 = 4,
    Mtu4096 = 5,
}

impl PathMtu {
    /// ibverbs' `enum ibv_mtu` value.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            3 => Self::Mtu1024,
            4 => Self::Mtu2048,
            5 => Self::Mtu4096,
            _ => return None,
        })
    }

    pub fn bytes(self) -> u32 {
        256 << (self as u32 - 1)
    }
}

/// Where a port sits on the fabric: enough to tell whether two ports can reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fabric {
    pub link_layer: LinkLayer,
    /// InfiniBand local id (unicast: 1..=0xBFFF); 0 on Ethernet.
    pub lid: u16,
    pub gid: [u8; 16],
}

impl Fabric {
    /// The upper 64 bits of the GID: the InfiniBand subnet prefix.
    pub fn subnet_prefix(&self) -> u64 {
        u64::from_be_bytes(self.gid[..8].try_into().expect("8 bytes"))
    }

    fn gid_is_zero(&self) -> bool {
        self.gid.iter().all(|&b| b == 0)
    }

    /// An IPv4 address in IPv4-mapped form (`::ffff:a.b.c.d`), the RoCE v2 GID of an IPv4
    /// interface.
    fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|&b| b == 0) && self.gid[10..12] == [0xff, 0xff]
    }

    /// Whether a port here and `other` share a fabric a reliable connection can cross: the
    /// same link layer; on InfiniBand the same subnet (no IB router is assumed); on Ethernet
    /// both GIDs set and of the same IP family (routing itself is only proven by connecting,
    /// and a failed connection falls back to TCP).
    pub fn common_with(&self, other: &Fabric) -> bool {
        if self.link_layer != other.link_layer {
            return false;
        }
        match self.link_layer {
            LinkLayer::InfiniBand => self.subnet_prefix() == other.subnet_prefix(),
            LinkLayer::Ethernet => {
                !self.gid_is_zero()
                    && !other.gid_is_zero()
                    && self.is_ipv4_mapped() == other.is_ipv4_mapped()
            }
        }
    }

    /// The fabric is addressable: a unicast LID on InfiniBand, a GID on Ethernet.
    pub fn validate(&self) -> Result<(), EndpointError> {
        match self.link_layer {
            LinkLayer::InfiniBand if !(1..=0xBFFF).contains(&self.lid) => {
                Err(EndpointError::Invalid(format!(
                    "InfiniBand LID {:#x} is not a unicast LID (1..=0xbfff)",
                    self.lid
                )))
            }
            LinkLayer::Ethernet if self.gid_is_zero() => Err(EndpointError::Invalid(
                "a RoCE endpoint needs a GID (the zero GID cannot be routed)".into(),
            )),
            _ => Ok(()),
        }
    }

    /// The GID as text (`fe80:0000:...`), for logs and errors.
    pub fn gid_string(&self) -> String {
        self.gid
            .chunks(2)
            .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
            .collect::<Vec<_>>()
            .join(":")
    }
}

impl fmt::Display for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} lid {:#x} gid {}",
            self.link_layer,
            self.lid,
            self.gid_string()
        )
    }
}

/// A reliable-connected queue pair's endpoint: what the other side needs to connect to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpEndpoint {
    pub fabric: Fabric,
    pub port: u8,
    pub mtu: PathMtu,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
}

/// An endpoint or descriptor that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("RDMA endpoint is {got} bytes, expected {expected}")]
    Length { got: usize, expected: usize },
    #[error("not an RDMA endpoint of this project (bad magic)")]
    BadMagic,
    #[error("RDMA encoding version {0} is not supported (this build reads version 1)")]
    Version(u16),
    #[error("invalid RDMA endpoint: {0}")]
    Invalid(String),
}

const MAGIC: [u8; 4] = *b"PDRE";
const VERSION: u16 = 1;
/// 24-bit fields: queue pair numbers and packet sequence numbers.
const MAX_24: u32 = (1 << 24) - 1;

impl QpEndpoint {
    /// Bytes of the encoding.
    pub const LEN: usize = 40;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(self.fabric.link_layer.code());
        b.push(self.port);
        b.extend_from_slice(&self.fabric.lid.to_le_bytes());
        b.push(self.mtu.code());
        b.push(0);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&self.fabric.gid);
        debug_assert_eq!(b.len(), Self::LEN);
        b
    }

    /// Decode and [validate](QpEndpoint::validate).
    pub fn decode(b: &[u8]) -> Result<Self, EndpointError> {
        if b.len() != Self::LEN {
            return Err(EndpointError::Length {
                got: b.len(),
                expected: Self::LEN,
            });
        }
        if b[..4] != MAGIC {
            return Err(EndpointError::BadMagic);
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(EndpointError::Version(version));
        }
        let link_layer = LinkLayer::from_code(b[6])
            .ok_or_else(|| EndpointError::Invalid(format!("link layer code {}", b[6])))?;
        let mtu = PathMtu::from_code(b[10])
            .ok_or_else(|| EndpointError::Invalid(format!("path MTU code {}", b[10])))?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let ep = Self {
            fabric: Fabric {
                link_layer,
                lid: u16::from_le_bytes([b[8], b[9]]),
                gid: b[24..40].try_into().expect("16 bytes"),
            },
            port: b[7],
            mtu,
            qpn: u32_at(12),
            psn: u32_at(16),
        };
        ep.validate()?;
        Ok(ep)
    }

    /// Every field is in range: a port number, 24-bit QPN (not 0 or 1, reserved for QP0 and
    /// QP1) and PSN, an addressable fabric.
    pub fn validate(&self) -> Result<(), EndpointError> {
        if self.port == 0 {
            return Err(EndpointError::Invalid("port 0 (ports count from 1)".into()));
        }
        if !(2..=MAX_24).contains(&self.qpn) {
            return Err(EndpointError::Invalid(format!(
                "queue pair number {:#x} outside 2..=0xffffff",
                self.qpn
            )));
        }
        if self.psn > MAX_24 {
            return Err(EndpointError::Invalid(format!(
                "packet sequence number {:#x} wider than 24 bits",
                self.psn
            )));
        }
        self.fabric.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ib(lid: u16, prefix: u64) -> Fabric {
        let mut gid = [0u8; 16];
        gid[..8].copy_from_slice(&prefix.to_be_bytes());
        gid[15] = 7;
        Fabric {
            link_layer: LinkLayer::InfiniBand,
            lid,
            gid,
        }
    }

    fn roce_v4(last: u8) -> Fabric {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 0, last]);
        Fabric {
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            gid,
        }
    }

    fn endpoint(fabric: Fabric) -> QpEndpoint {
        QpEndpoint {
            fabric,
            port: 1,
            mtu: PathMtu::Mtu4096,
            qpn: 0x12_3456,
            psn: 0xab_cdef,
        }
    }

    #[test]
    fn the_encoding_has_the_documented_layout() {
        let ep = endpoint(ib(0x11, 0xfe80_0000_0000_0000));
        let b = ep.encode();
        assert_eq!(b.len(), QpEndpoint::LEN);
        assert_eq!(&b[..4], b"PDRE");
        assert_eq!(&b[4..6], &[1, 0]);
        assert_eq!(b[6], 1, "InfiniBand");
        assert_eq!(b[7], 1, "port");
        assert_eq!(&b[8..10], &[0x11, 0]);
        assert_eq!(b[10], 5, "MTU 4096");
        assert_eq!(&b[12..16], &[0x56, 0x34, 0x12, 0]);
        assert_eq!(&b[16..20], &[0xef, 0xcd, 0xab, 0]);
        assert_eq!(&b[24..26], &[0xfe, 0x80]);
        assert_eq!(QpEndpoint::decode(&b), Ok(ep));
    }

    #[test]
    fn bad_encodings_are_refused_with_their_reason() {
        let good = endpoint(roce_v4(1)).encode();
        assert!(matches!(
            QpEndpoint::decode(&good[..39]),
            Err(EndpointError::Length { got: 39, .. })
        ));
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(QpEndpoint::decode(&b), Err(EndpointError::BadMagic));
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(QpEndpoint::decode(&b), Err(EndpointError::Version(2)));
        for (at, value, what) in [
            (6, 9, "link layer"),
            (10, 6, "MTU"),
            (7, 0, "port 0"),
            (15, 1, "queue pair number"),
            (19, 1, "sequence number"),
        ] {
            let mut b = good.clone();
            b[at] = value;
            let e = QpEndpoint::decode(&b).unwrap_err().to_string();
            assert!(
                e.contains(what) || e.contains("queue pair") || e.contains("24 bits"),
                "{what}: {e}"
            );
        }
        let mut zero_gid = endpoint(roce_v4(1));
        zero_gid.fabric.gid = [0; 16];
        assert!(QpEndpoint::decode(&zero_gid.encode()).is_err());
        let mut multicast_lid = endpoint(ib(0xC001, 1));
        assert!(multicast_lid.validate().is_err());
        multicast_lid.fabric.lid = 0xBFFF;
        assert!(multicast_lid.validate().is_ok());
    }

    #[test]
    fn common_fabric_needs_the_same_link_layer_and_subnet_or_ip_family() {
        let a = ib(1, 0xfe80_0000_0000_0000);
        assert!(a.common_with(&ib(2, 0xfe80_0000_0000_0000)));
        assert!(
            !a.common_with(&ib(2, 0xfe80_0000_0000_0001)),
            "other subnet"
        );
        assert!(!a.common_with(&roce_v4(1)), "other link layer");
        assert!(roce_v4(1).common_with(&roce_v4(2)));
        let mut v6 = roce_v4(3);
        v6.gid = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        assert!(!roce_v4(1).common_with(&v6), "IPv4 and IPv6 GIDs");
        let mut none = roce_v4(1);
        none.gid = [0; 16];
        assert!(!none.common_with(&roce_v4(1)));
    }

    #[test]
    fn mtu_codes_follow_ibverbs() {
        assert_eq!(PathMtu::Mtu256.bytes(), 256);
        assert_eq!(PathMtu::Mtu4096.bytes(), 4096);
        for code in 1..=5 {
            assert_eq!(PathMtu::from_code(code).unwrap().code(), code);
        }
        assert_eq!(PathMtu::from_code(0), None);
    }

    proptest! {
        #[test]
        fn every_valid_endpoint_round_trips(
            ib_link in any::<bool>(),
            lid in 1u16..=0xBFFF,
            gid in any::<[u8; 16]>(),
            port in 1u8..=255,
            mtu in 1u8..=5,
            qpn in 2u32..=0xff_ffff,
            psn in 0u32..=0xff_ffff,
        ) {
            let mut fabric = Fabric {
                link_layer: if ib_link { LinkLayer::InfiniBand } else { LinkLayer::Ethernet },
                lid: if ib_link { lid } else { 0 },
                gid,
            };
            if !ib_link && fabric.gid_is_zero() {
                fabric.gid[15] = 1;
            }
            let ep = QpEndpoint { fabric, port, mtu: PathMtu::from_code(mtu).unwrap(), qpn, psn };
            prop_assert_eq!(QpEndpoint::decode(&ep.encode()), Ok(ep));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = QpEndpoint::decode(&bytes);
        }
    }
}
