//! The TCP wire format, version 4. Every integer is little-endian; KV values travel as the
//! raw little-endian bytes the KV cache stores (f32, f16 or bf16: the layout fingerprint
//! says which, so both ends agree before a byte moves).
//!
//! ```text
//! frame header (12 B)   magic "PDKV" | version u16 = 4 | kind u16 | body_len u32
//!
//! kind 1 PULL_REQUEST, importer -> exporter, body 64 B:
//!   lease_id u64 | lease_secret 16 B | fingerprint u64 | first_block u64 | count u64
//!   | block_bytes u64 (bytes per block) | timeout_ms u32 | reserved u32 = 0
//!
//! kind 2 PULL_RESPONSE, exporter -> importer, body 56 B + message:
//!   status u16 | reserved u16 = 0 | chunk_bytes u32
//!   | fingerprint u64 | lease_id u64 | first_block u64 | count u64
//!   | block_bytes u64 | message_len u32 | reserved u32 = 0 | message (UTF-8, <= 4 KiB)
//!
//! status OK only: the payload follows, the count blocks in order (each block's bytes in
//! order), one chunk per block, each with a 16 B chunk header:
//!   kind u32 | status u32 | len u64
//!   kind 1 DATA:  len = block_bytes = chunk_bytes bytes of the block, then its checksum
//!                 (u64): xxh3-64 of those bytes with seed BLOCK_SEED + the block's index in
//!                 the lease (wrapping; `pd_engine::kv::handoff::checksum`), so a block delivered
//!                 in the wrong place fails too. The same checksum the RDMA offer carries;
//!                 computed once when the lease is made.
//!   kind 2 ABORT: the exporter cannot finish (the lease expired mid-transfer, ...): status
//!                 says why, len bytes of UTF-8 message follow, then the connection closes.
//!
//! Version 1 cut the payload into 4 MiB chunks checksummed as they were sent; version 2
//! makes a chunk a block so that the sender sends checksums it already has; version 3
//! sends KV as stored instead of widened to f32 (a 16-bit cache moves half the bytes), so
//! blocks are sized in bytes; version 4 seals leases: a request carries the lease's secret
//! and a refusal says nothing about the exporter.
//! ```
//!
//! **Sealed leases.** A lease is a capability: its id and its 16-byte secret (the
//! `KvHandle`'s `lease_secret`) together. The exporter first authenticates the request: the
//! lease must exist, the secret must match (compared in constant time) and the block range
//! must lie inside the lease. An unknown lease, a wrong secret and a range outside the lease
//! all get the same refusal, UNKNOWN_LEASE with one fixed message, whose fingerprint,
//! lease id, first block, count, block length and chunk length are all 0: a caller without
//! the secret learns neither the exporter's layout nor whether the id exists. Refusals
//! before authentication (BAD_REQUEST, UNSUPPORTED_VERSION) carry zeros too. Only an
//! authenticated request is checked against the exporter's layout: FINGERPRINT_MISMATCH then
//! carries the exporter's fingerprint, LENGTH says the block length differs.
//!
//! After the last DATA chunk the connection carries the next request (connection reuse). A
//! refusal (status != OK) sends no payload; after UNSUPPORTED_VERSION or BAD_REQUEST the
//! exporter closes the connection. An importer checks the magic, version, kind, the echoed
//! lease / first block / count / block length, the exporter's fingerprint, every chunk length
//! and every checksum.

use pd_engine::serve::{LEASE_SECRET_LEN, LeaseSecret};

use crate::fingerprint::LayoutFingerprint;

pub const MAGIC: [u8; 4] = *b"PDKV";
pub const VERSION: u16 = 4;
pub const FRAME_HEADER_LEN: usize = 12;
pub const PULL_REQUEST_BODY_LEN: usize = 64;
pub const PULL_RESPONSE_BODY_LEN: usize = 56;
pub const CHUNK_HEADER_LEN: usize = 16;
pub const CHECKSUM_LEN: usize = 8;
/// Longest message a response or an abort chunk may carry.
pub const MAX_MESSAGE_LEN: usize = 4096;
/// Largest block (= chunk) either side accepts.
pub const MAX_CHUNK_BYTES: u32 = 1 << 31;
/// Largest payload of one pull (either side refuses more).
pub const MAX_PULL_BYTES: u64 = 1 << 36;
/// A frame or chunk that does not follow this format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?} (not a pd-transport peer)")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    BadVersion(u16),
    #[error("unexpected frame kind {0}")]
    BadKind(u16),
    #[error("frame body of {got} bytes, expected {expected}")]
    BadBodyLen { got: u32, expected: u32 },
    #[error("unknown status {0}")]
    BadStatus(u32),
    #[error("unknown chunk kind {0}")]
    BadChunkKind(u32),
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum FrameKind {
    PullRequest = 1,
    PullResponse = 2,
}

/// The exporter's answer to a pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    /// No such lease, a wrong secret, or a range outside the lease: the exporter does not
    /// say which (see the module documentation).
    UnknownLease = 1,
    /// The request's fingerprint is not the exporter's (said to authenticated requests only).
    FingerprintMismatch = 2,
    /// The lease's blocks do not have the requested block length (authenticated requests
    /// only).
    Length = 3,
    /// Malformed or oversized request.
    BadRequest = 4,
    /// Shutting down or an internal failure.
    Unavailable = 5,
    /// The request's protocol version is not spoken here.
    UnsupportedVersion = 6,
}

impl Status {
    pub fn from_u32(v: u32) -> Result<Self, WireError> {
        Ok(match v {
            0 => Self::Ok,
            1 => Self::UnknownLease,
            2 => Self::FingerprintMismatch,
            3 => Self::Length,
            4 => Self::BadRequest,
            5 => Self::Unavailable,
            6 => Self::UnsupportedVersion,
            _ => return Err(WireError::BadStatus(v)),
        })
    }
}

/// The 12-byte header in front of every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub version: u16,
    pub kind: u16,
    pub body_len: u32,
}

impl FrameHeader {
    pub fn new(kind: FrameKind, body_len: u32) -> Self {
        Self {
            version: VERSION,
            kind: kind as u16,
            body_len,
        }
    }

    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..12].copy_from_slice(&self.body_len.to_le_bytes());
        b
    }

    /// Checks the magic only: the caller decides what an unknown version or kind means.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let mut r = Reader(&b[4..]);
        Ok(Self {
            version: r.u16(),
            kind: r.u16(),
            body_len: r.u32(),
        })
    }

    /// The header of a current-version frame of `kind` with a body of `expected` bytes.
    pub fn expect(&self, kind: FrameKind, expected: usize) -> Result<(), WireError> {
        if self.version != VERSION {
            return Err(WireError::BadVersion(self.version));
        }
        if self.kind != kind as u16 {
            return Err(WireError::BadKind(self.kind));
        }
        if self.body_len as usize != expected {
            return Err(WireError::BadBodyLen {
                got: self.body_len,
                expected: expected as u32,
            });
        }
        Ok(())
    }
}

/// A request for blocks `first_block .. first_block + count` of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullRequestFrame {
    pub lease_id: u64,
    /// The lease's secret: without it the lease does not exist for this request.
    pub lease_secret: LeaseSecret,
    pub fingerprint: LayoutFingerprint,
    pub first_block: u64,
    pub count: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Time the importer still waits; the exporter gives up after it.
    pub timeout_ms: u32,
}

impl PullRequestFrame {
    pub const FRAME_LEN: usize = FRAME_HEADER_LEN + PULL_REQUEST_BODY_LEN;

    /// Header and body.
    pub fn encode(&self) -> [u8; Self::FRAME_LEN] {
        let mut b = [0u8; Self::FRAME_LEN];
        b[..FRAME_HEADER_LEN].copy_from_slice(
            &FrameHeader::new(FrameKind::PullRequest, PULL_REQUEST_BODY_LEN as u32).encode(),
        );
        let mut w = Writer(&mut b[FRAME_HEADER_LEN..]);
        w.u64(self.lease_id);
        w.bytes(self.lease_secret.as_bytes());
        w.u64(self.fingerprint.0);
        w.u64(self.first_block);
        w.u64(self.count);
        w.u64(self.block_bytes);
        w.u32(self.timeout_ms);
        w.u32(0);
        b
    }

    pub fn decode_body(b: &[u8; PULL_REQUEST_BODY_LEN]) -> Self {
        let mut r = Reader(b);
        Self {
            lease_id: r.u64(),
            lease_secret: LeaseSecret::from_bytes(r.take::<LEASE_SECRET_LEN>()),
            fingerprint: LayoutFingerprint(r.u64()),
            first_block: r.u64(),
            count: r.u64(),
            block_bytes: r.u64(),
            timeout_ms: r.u32(),
        }
    }

    /// Payload bytes this request asks for (`None` on overflow).
    pub fn payload_bytes(&self) -> Option<u64> {
        self.count.checked_mul(self.block_bytes)
    }
}

/// The exporter's reply header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullResponseFrame {
    pub status: Status,
    pub chunk_bytes: u32,
    /// The exporter's own fingerprint on OK and FINGERPRINT_MISMATCH (authenticated
    /// requests); 0 on every other refusal.
    pub fingerprint: LayoutFingerprint,
    pub lease_id: u64,
    pub first_block: u64,
    pub count: u64,
    pub block_bytes: u64,
    pub message: String,
}

impl PullResponseFrame {
    /// A refusal that says nothing but `status` and `message`: every other field 0.
    pub fn refusal(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            chunk_bytes: 0,
            fingerprint: LayoutFingerprint(0),
            lease_id: 0,
            first_block: 0,
            count: 0,
            block_bytes: 0,
            message: message.into(),
        }
    }

    /// Header, body and message (cut to [`MAX_MESSAGE_LEN`] on a character boundary).
    pub fn encode(&self) -> Vec<u8> {
        let msg = truncate_message(&self.message);
        let body_len = PULL_RESPONSE_BODY_LEN + msg.len();
        let mut b = vec![0u8; FRAME_HEADER_LEN + body_len];
        b[..FRAME_HEADER_LEN]
            .copy_from_slice(&FrameHeader::new(FrameKind::PullResponse, body_len as u32).encode());
        let mut w = Writer(&mut b[FRAME_HEADER_LEN..]);
        w.u16(self.status as u16);
        w.u16(0);
        w.u32(self.chunk_bytes);
        w.u64(self.fingerprint.0);
        w.u64(self.lease_id);
        w.u64(self.first_block);
        w.u64(self.count);
        w.u64(self.block_bytes);
        w.u32(msg.len() as u32);
        w.u32(0);
        w.bytes(msg.as_bytes());
        b
    }

    /// The fixed part of the body; returns the message length still to read.
    pub fn decode_body(b: &[u8; PULL_RESPONSE_BODY_LEN]) -> Result<(Self, usize), WireError> {
        let mut r = Reader(b);
        let status = Status::from_u32(r.u16() as u32)?;
        let _reserved = r.u16();
        let frame = Self {
            status,
            chunk_bytes: r.u32(),
            fingerprint: LayoutFingerprint(r.u64()),
            lease_id: r.u64(),
            first_block: r.u64(),
            count: r.u64(),
            block_bytes: r.u64(),
            message: String::new(),
        };
        let msg_len = r.u32() as usize;
        Ok((frame, msg_len))
    }
}

/// Chunk kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ChunkKind {
    Data = 1,
    Abort = 2,
}

/// The 16-byte header in front of every payload chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub kind: ChunkKind,
    /// `Ok` on DATA; why on ABORT.
    pub status: Status,
    pub len: u64,
}

impl ChunkHeader {
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        let mut w = Writer(&mut b);
        w.u32(self.kind as u32);
        w.u32(self.status as u32);
        w.u64(self.len);
        b
    }

    pub fn decode(b: &[u8; CHUNK_HEADER_LEN]) -> Result<Self, WireError> {
        let mut r = Reader(b);
        let kind = match r.u32() {
            1 => ChunkKind::Data,
            2 => ChunkKind::Abort,
            k => return Err(WireError::BadChunkKind(k)),
        };
        Ok(Self {
            kind,
            status: Status::from_u32(r.u32())?,
            len: r.u64(),
        })
    }
}

/// `message` cut to at most [`MAX_MESSAGE_LEN`] bytes on a character boundary.
pub fn truncate_message(message: &str) -> &str {
    if message.len() <= MAX_MESSAGE_LEN {
        return message;
    }
    let mut end = MAX_MESSAGE_LEN;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        head.try_into().expect("split_at gave N bytes")
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

struct Writer<'a>(&'a mut [u8]);

impl Writer<'_> {
    fn bytes(&mut self, v: &[u8]) {
        let buf = std::mem::take(&mut self.0);
        let (head, rest) = buf.split_at_mut(v.len());
        head.copy_from_slice(v);
        self.0 = rest;
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_has_the_documented_layout() {
        let secret = LeaseSecret::from_bytes(*b"0123456789abcdef");
        let req = PullRequestFrame {
            lease_id: 0x0102_0304_0506_0708,
            lease_secret: secret,
            fingerprint: LayoutFingerprint(0xdead_beef),
            first_block: 3,
            count: 5,
            block_bytes: 917_504 * 4,
            timeout_ms: 1500,
        };
        let b = req.encode();
        assert_eq!(&b[..4], b"PDKV");
        assert_eq!(&b[4..6], &[4, 0], "version 4, little-endian");
        assert_eq!(&b[6..8], &[1, 0], "kind PULL_REQUEST");
        assert_eq!(&b[8..12], &[64, 0, 0, 0]);
        assert_eq!(
            &b[12..20],
            &[8, 7, 6, 5, 4, 3, 2, 1],
            "lease id little-endian"
        );
        assert_eq!(&b[20..36], b"0123456789abcdef", "the secret after the id");
        assert_eq!(
            &b[36..44],
            &0xdead_beef_u64.to_le_bytes(),
            "then the fingerprint"
        );
        let h = FrameHeader::decode(b[..12].try_into().unwrap()).unwrap();
        h.expect(FrameKind::PullRequest, PULL_REQUEST_BODY_LEN)
            .unwrap();
        assert_eq!(
            PullRequestFrame::decode_body(b[12..].try_into().unwrap()),
            req
        );
        assert_eq!(req.payload_bytes(), Some(5 * 917_504 * 4));
        let huge = PullRequestFrame {
            count: u64::MAX,
            ..req
        };
        assert_eq!(huge.payload_bytes(), None);
    }

    #[test]
    fn response_round_trips_with_its_message() {
        let resp = PullResponseFrame {
            status: Status::FingerprintMismatch,
            chunk_bytes: 3 << 20,
            fingerprint: LayoutFingerprint(42),
            lease_id: 9,
            first_block: 1,
            count: 2,
            block_bytes: 3,
            message: "différent".into(),
        };
        let b = resp.encode();
        let h = FrameHeader::decode(b[..12].try_into().unwrap()).unwrap();
        let msg_len = "différent".len();
        h.expect(FrameKind::PullResponse, PULL_RESPONSE_BODY_LEN + msg_len)
            .unwrap();
        let (mut got, len) = PullResponseFrame::decode_body(b[12..68].try_into().unwrap()).unwrap();
        assert_eq!(len, msg_len);
        got.message = String::from_utf8(b[68..].to_vec()).unwrap();
        assert_eq!(got, resp);
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let long = "é".repeat(MAX_MESSAGE_LEN);
        let cut = truncate_message(&long);
        assert!(cut.len() <= MAX_MESSAGE_LEN && cut.len() >= MAX_MESSAGE_LEN - 1);
        let resp = PullResponseFrame::refusal(Status::Unavailable, long);
        assert!(resp.encode().len() <= FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN + MAX_MESSAGE_LEN);
    }

    #[test]
    fn bad_headers_are_typed_errors() {
        let mut b = PullRequestFrame {
            lease_id: 1,
            lease_secret: LeaseSecret::from_bytes([1; 16]),
            fingerprint: LayoutFingerprint(1),
            first_block: 0,
            count: 1,
            block_bytes: 1,
            timeout_ms: 1,
        }
        .encode();
        let h: [u8; 12] = b[..12].try_into().unwrap();
        assert_eq!(
            FrameHeader::decode(&h)
                .unwrap()
                .expect(FrameKind::PullResponse, 64),
            Err(WireError::BadKind(1))
        );
        assert!(matches!(
            FrameHeader::decode(&h)
                .unwrap()
                .expect(FrameKind::PullRequest, 48),
            Err(WireError::BadBodyLen { got: 64, .. })
        ));
        b[4] = 3; // version 3 peers (no lease secret) are refused
        let h: [u8; 12] = b[..12].try_into().unwrap();
        assert_eq!(
            FrameHeader::decode(&h)
                .unwrap()
                .expect(FrameKind::PullRequest, 64),
            Err(WireError::BadVersion(3))
        );
        b[0] = b'X';
        let h: [u8; 12] = b[..12].try_into().unwrap();
        assert!(matches!(
            FrameHeader::decode(&h),
            Err(WireError::BadMagic(_))
        ));
        assert_eq!(
            ChunkHeader::decode(&[9; 16]),
            Err(WireError::BadChunkKind(0x0909_0909))
        );
        let ok = ChunkHeader {
            kind: ChunkKind::Abort,
            status: Status::UnknownLease,
            len: 77,
        };
        assert_eq!(ChunkHeader::decode(&ok.encode()), Ok(ok));
        assert_eq!(Status::from_u32(99), Err(WireError::BadStatus(99)));
    }
}
