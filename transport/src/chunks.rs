//! The chunked payload stream both sides share: the exporter cuts the blocks' bytes into
//! checksummed DATA chunks as it writes them, the importer reassembles them straight into
//! the blocks' f32 buffers and verifies every chunk as it reads.

use std::hash::Hasher as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use twox_hash::XxHash3_64 as Xxh3;

use crate::error::TransportError;
use crate::wire::{
    CHECKSUM_LEN, CHUNK_HEADER_LEN, ChunkHeader, ChunkKind, MAX_MESSAGE_LEN, Status, chunk_seed,
};

/// Bytes hashed and moved per step: small enough to stay in L2 between the hash and the copy,
/// large enough that a socket call per piece costs nothing.
const PIECE: usize = 256 << 10;

/// Cuts a payload of a known size into checksummed chunks.
pub(crate) struct ChunkWriter {
    chunk_bytes: u64,
    left_total: u64,
    left_in_segment: u64,
    left_in_chunk: u64,
    index: u64,
    hasher: Xxh3,
}

impl ChunkWriter {
    pub(crate) fn new(total: u64, chunk_bytes: u32) -> Self {
        Self {
            chunk_bytes: u64::from(chunk_bytes.max(1)),
            left_total: total,
            left_in_segment: total,
            left_in_chunk: 0,
            index: 0,
            hasher: Xxh3::with_seed(chunk_seed(0)),
        }
    }

    /// The next `bytes` of payload form a segment: no chunk spans its end, so the writer can
    /// stop (and send an ABORT chunk) there. Call only between segments.
    pub(crate) fn segment(&mut self, bytes: u64) {
        debug_assert_eq!(self.left_in_chunk, 0, "a segment starts between chunks");
        self.left_in_segment = bytes.min(self.left_total);
    }

    /// Append `data` to the payload.
    pub(crate) async fn write<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        mut data: &[u8],
    ) -> std::io::Result<()> {
        while !data.is_empty() {
            if self.left_in_chunk == 0 {
                let len = self.chunk_bytes.min(self.left_in_segment);
                if len == 0 {
                    return Err(std::io::Error::other(
                        "more payload than the response or segment announced",
                    ));
                }
                let header = ChunkHeader {
                    kind: ChunkKind::Data,
                    status: Status::Ok,
                    len,
                };
                w.write_all(&header.encode()).await?;
                self.left_in_chunk = len;
                self.hasher = Xxh3::with_seed(chunk_seed(self.index));
            }
            let n = data.len().min(PIECE).min(self.left_in_chunk as usize);
            let (piece, rest) = data.split_at(n);
            self.hasher.write(piece);
            w.write_all(piece).await?;
            data = rest;
            self.left_in_chunk -= n as u64;
            self.left_in_segment -= n as u64;
            self.left_total -= n as u64;
            if self.left_in_chunk == 0 {
                w.write_all(&self.hasher.finish().to_le_bytes()).await?;
                self.index += 1;
            }
        }
        Ok(())
    }

    /// True once the announced payload was written in full.
    pub(crate) fn is_complete(&self) -> bool {
        self.left_total == 0 && self.left_in_chunk == 0
    }
}

/// Write an ABORT chunk (the connection must close after it).
pub(crate) async fn write_abort<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: Status,
    message: &str,
) -> std::io::Result<()> {
    let message = crate::wire::truncate_message(message);
    let header = ChunkHeader {
        kind: ChunkKind::Abort,
        status,
        len: message.len() as u64,
    };
    w.write_all(&header.encode()).await?;
    w.write_all(message.as_bytes()).await?;
    w.flush().await
}

/// What an importer needs to turn an ABORT status into a typed error.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PullIdentity {
    pub(crate) lease_id: u64,
    pub(crate) first_block: u64,
    pub(crate) count: u64,
}

/// Reads and verifies a payload of a known size, chunk by chunk.
pub(crate) struct ChunkReader {
    chunk_bytes: u64,
    total: u64,
    received: u64,
    left_in_chunk: u64,
    index: u64,
    hasher: Xxh3,
    id: PullIdentity,
}

impl ChunkReader {
    pub(crate) fn new(total: u64, chunk_bytes: u32, id: PullIdentity) -> Self {
        Self {
            chunk_bytes: u64::from(chunk_bytes.max(1)),
            total,
            received: 0,
            left_in_chunk: 0,
            index: 0,
            hasher: Xxh3::with_seed(chunk_seed(0)),
            id,
        }
    }

    /// Fill `buf` with the next payload bytes.
    pub(crate) async fn read_into<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        mut buf: &mut [u8],
    ) -> Result<(), TransportError> {
        while !buf.is_empty() {
            if self.left_in_chunk == 0 {
                self.next_chunk(r).await?;
            }
            let n = buf.len().min(PIECE).min(self.left_in_chunk as usize);
            let (piece, rest) = std::mem::take(&mut buf).split_at_mut(n);
            self.read_exact(r, piece).await?;
            self.hasher.write(piece);
            self.received += n as u64;
            self.left_in_chunk -= n as u64;
            if self.left_in_chunk == 0 {
                let mut sum = [0u8; CHECKSUM_LEN];
                self.read_exact(r, &mut sum).await?;
                let sent = u64::from_le_bytes(sum);
                let computed = self.hasher.finish();
                if sent != computed {
                    return Err(TransportError::Checksum {
                        chunk: self.index,
                        computed,
                        sent,
                    });
                }
                self.index += 1;
            }
            buf = rest;
        }
        Ok(())
    }

    async fn next_chunk<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> Result<(), TransportError> {
        let mut h = [0u8; CHUNK_HEADER_LEN];
        self.read_exact(r, &mut h).await?;
        let header = ChunkHeader::decode(&h)
            .map_err(|e| TransportError::Protocol(format!("chunk {}: {e}", self.index)))?;
        match header.kind {
            ChunkKind::Data => {
                let most = self.chunk_bytes.min(self.total - self.received);
                if !(1..=most).contains(&header.len) || header.status != Status::Ok {
                    return Err(TransportError::Length(format!(
                        "chunk {} announces {} bytes, expected 1..={most} ({} of {} payload \
                         bytes received)",
                        self.index, header.len, self.received, self.total
                    )));
                }
                self.left_in_chunk = header.len;
                self.hasher = Xxh3::with_seed(chunk_seed(self.index));
                Ok(())
            }
            ChunkKind::Abort => {
                let len = usize::try_from(header.len).unwrap_or(usize::MAX);
                if len > MAX_MESSAGE_LEN {
                    return Err(TransportError::Protocol(format!(
                        "abort message of {} bytes (limit {MAX_MESSAGE_LEN})",
                        header.len
                    )));
                }
                let mut msg = vec![0u8; len];
                self.read_exact(r, &mut msg).await?;
                let message = format!(
                    "the exporter aborted after {} of {} payload bytes: {}",
                    self.received,
                    self.total,
                    String::from_utf8_lossy(&msg)
                );
                Err(status_error(header.status, message, self.id))
            }
        }
    }

    async fn read_exact<R: AsyncRead + Unpin>(
        &self,
        r: &mut R,
        buf: &mut [u8],
    ) -> Result<(), TransportError> {
        match r.read_exact(buf).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(TransportError::Length(format!(
                    "the stream ended after {} of {} payload bytes (chunk {})",
                    self.received, self.total, self.index
                )))
            }
            Err(e) => Err(TransportError::Io(e)),
        }
    }
}

/// The typed error for a refusal or abort status (never called with `Ok`).
pub(crate) fn status_error(status: Status, message: String, id: PullIdentity) -> TransportError {
    match status {
        Status::UnknownLease => TransportError::UnknownLease {
            lease_id: id.lease_id,
            first_block: id.first_block,
            count: id.count,
            message,
        },
        Status::Length => TransportError::Length(message),
        Status::FingerprintMismatch => TransportError::Protocol(format!(
            "fingerprint refusal where none was expected: {message}"
        )),
        Status::Ok => {
            TransportError::Protocol(format!("status OK where an error was expected: {message}"))
        }
        Status::BadRequest | Status::Unavailable | Status::UnsupportedVersion => {
            TransportError::Refused(format!("{status:?}: {message}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: PullIdentity = PullIdentity {
        lease_id: 1,
        first_block: 0,
        count: 1,
    };

    async fn encode(payload: &[u8], chunk: u32, split: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut w = ChunkWriter::new(payload.len() as u64, chunk);
        for part in payload.chunks(split.max(1)) {
            w.write(&mut out, part).await.unwrap();
        }
        assert!(w.is_complete());
        out
    }

    async fn decode(
        stream: &[u8],
        total: usize,
        chunk: u32,
        split: usize,
    ) -> Result<Vec<u8>, TransportError> {
        let mut out = vec![0u8; total];
        let mut r = ChunkReader::new(total as u64, chunk, ID);
        let mut src = stream;
        for part in out.chunks_mut(split.max(1)) {
            r.read_into(&mut src, part).await?;
        }
        Ok(out)
    }

    fn payload(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect()
    }

    #[tokio::test]
    async fn any_split_of_writes_and_reads_round_trips() {
        let data = payload(3 * PIECE + 12_345);
        for chunk in [1000u32, 4096, PIECE as u32, 1 << 20, 64 << 20] {
            for (ws, rs) in [(1 << 20, 7777), (333, 1 << 20), (data.len(), data.len())] {
                let stream = encode(&data, chunk, ws).await;
                let chunks = data.len().div_ceil(chunk as usize);
                assert_eq!(
                    stream.len(),
                    data.len() + chunks * (CHUNK_HEADER_LEN + CHECKSUM_LEN)
                );
                assert_eq!(decode(&stream, data.len(), chunk, rs).await.unwrap(), data);
            }
        }
    }

    #[tokio::test]
    async fn segments_end_chunks_early_and_an_abort_can_follow_any_segment() {
        let data = payload(10_000);
        let mut stream = Vec::new();
        let mut w = ChunkWriter::new(data.len() as u64, 4096);
        for seg in data.chunks(3000).take(2) {
            w.segment(seg.len() as u64);
            w.write(&mut stream, seg).await.unwrap();
        }
        // 2 segments of 3000 bytes: 2 chunks, each ended by its segment.
        assert_eq!(stream.len(), 6000 + 2 * (CHUNK_HEADER_LEN + CHECKSUM_LEN));
        write_abort(&mut stream, Status::Length, "gone")
            .await
            .unwrap();
        let err = decode(&stream, data.len(), 4096, 10_000).await.unwrap_err();
        assert!(
            matches!(&err, TransportError::Length(m) if m.contains("6000 of 10000")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_flipped_payload_bit_fails_the_checksum_of_its_chunk() {
        let data = payload(10_000);
        let mut stream = encode(&data, 4096, 1000).await;
        // Chunk 1's payload starts after chunk 0 (16 + 4096 + 8) and its own header.
        stream[16 + 4096 + 8 + 16 + 5] ^= 0x10;
        let err = decode(&stream, data.len(), 4096, 10_000).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Checksum { chunk: 1, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn swapped_chunks_fail_even_with_valid_checksums() {
        let data = payload(8192);
        let stream = encode(&data, 4096, 8192).await;
        let c = 16 + 4096 + 8;
        let mut swapped = stream[c..].to_vec();
        swapped.extend_from_slice(&stream[..c]);
        let err = decode(&swapped, data.len(), 4096, 8192).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Checksum { chunk: 0, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn truncation_and_wrong_chunk_lengths_are_length_errors() {
        let data = payload(10_000);
        let stream = encode(&data, 4096, 10_000).await;
        for cut in [0, 10, 16 + 100, stream.len() - 1] {
            let err = decode(&stream[..cut], data.len(), 4096, 10_000)
                .await
                .unwrap_err();
            assert!(matches!(err, TransportError::Length(_)), "cut {cut}: {err}");
        }
        let mut bad = stream.clone();
        bad[8] ^= 1; // chunk 0's length
        let err = decode(&bad, data.len(), 4096, 10_000).await.unwrap_err();
        assert!(matches!(err, TransportError::Length(_)), "{err}");
        let mut bad = stream;
        bad[0] = 7; // chunk kind
        let err = decode(&bad, data.len(), 4096, 10_000).await.unwrap_err();
        assert!(matches!(err, TransportError::Protocol(_)), "{err}");
    }

    #[tokio::test]
    async fn an_abort_chunk_becomes_the_typed_error_of_its_status() {
        let data = payload(5000);
        let mut stream = encode(&data[..4096], 4096, 4096).await;
        // Rewrite: announce 5000 bytes total, then abort after the first chunk.
        write_abort(&mut stream, Status::UnknownLease, "lease 1 expired")
            .await
            .unwrap();
        let err = decode(&stream, data.len(), 4096, 5000).await.unwrap_err();
        match err {
            TransportError::UnknownLease {
                lease_id: 1,
                message,
                ..
            } => {
                assert!(message.contains("lease 1 expired") && message.contains("4096 of 5000"));
            }
            e => panic!("{e}"),
        }
    }
}
