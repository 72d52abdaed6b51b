//! The payload stream both sides share: one checksummed DATA chunk per block. The exporter
//! sends each block with the checksum computed when its lease was made (it hashes nothing
//! while sending); the importer reads each block straight into its buffer, or in place into
//! the KV memory reserved for it, hashing it as it arrives, and compares.

use pd_engine::kv::handoff::checksum::BlockChecksummer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::TransportError;
use crate::wire::{
    CHECKSUM_LEN, CHUNK_HEADER_LEN, ChunkHeader, ChunkKind, MAX_MESSAGE_LEN, Status,
};

/// Bytes read and hashed per step: small enough to stay in L2 between the read and the hash,
/// large enough that a socket call per piece costs nothing.
const PIECE: usize = 256 << 10;

/// Write one block as a DATA chunk: header, the block's bytes (given in one piece or
/// several, in order: a block held in place in KV memory lies in one piece per layer's K and V),
/// the block's checksum.
pub(crate) async fn write_block<W: AsyncWrite + Unpin>(
    w: &mut W,
    pieces: &[&[u8]],
    checksum: u64,
) -> std::io::Result<()> {
    let header = ChunkHeader {
        kind: ChunkKind::Data,
        status: Status::Ok,
        len: pieces.iter().map(|p| p.len() as u64).sum(),
    };
    w.write_all(&header.encode()).await?;
    for piece in pieces {
        w.write_all(piece).await?;
    }
    w.write_all(&checksum.to_le_bytes()).await
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

/// What an importer needs to turn an ABORT status into a typed error, and to know which
/// lease block a chunk holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PullIdentity {
    pub(crate) lease_id: u64,
    pub(crate) first_block: u64,
    pub(crate) count: u64,
}

/// Reads and verifies the blocks of one pull, in order.
pub(crate) struct BlockReader {
    block_bytes: u64,
    /// Blocks read so far.
    done: u64,
    id: PullIdentity,
}

impl BlockReader {
    pub(crate) fn new(block_bytes: u64, id: PullIdentity) -> Self {
        Self {
            block_bytes,
            done: 0,
            id,
        }
    }

    /// Read the next block into `buf` (`block_bytes` long), verified.
    pub(crate) async fn read_block<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        buf: &mut [u8],
    ) -> Result<(), TransportError> {
        self.read_block_into(r, &mut [buf]).await
    }

    /// Read the next block into `segments`, which together are `block_bytes` long and take
    /// its bytes in order (a block landing in place in KV memory), verified.
    pub(crate) async fn read_block_into<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        segments: &mut [&mut [u8]],
    ) -> Result<(), TransportError> {
        debug_assert_eq!(
            segments.iter().map(|s| s.len() as u64).sum::<u64>(),
            self.block_bytes
        );
        if self.done >= self.id.count {
            return Err(TransportError::Length(format!(
                "more than the {} blocks of the pull read",
                self.id.count
            )));
        }
        self.next_chunk(r).await?;
        let index = self.id.first_block + self.done;
        let mut hasher = BlockChecksummer::new(index);
        for segment in segments.iter_mut() {
            for piece in segment.chunks_mut(PIECE) {
                self.read_exact(r, piece).await?;
                hasher.update(piece);
            }
        }
        let mut sum = [0u8; CHECKSUM_LEN];
        self.read_exact(r, &mut sum).await?;
        let sent = u64::from_le_bytes(sum);
        let computed = hasher.digest();
        if sent != computed {
            return Err(TransportError::Checksum {
                block: index,
                computed,
                sent,
            });
        }
        self.done += 1;
        Ok(())
    }

    /// The next chunk's header: a DATA chunk of exactly one block, or an ABORT (its error).
    async fn next_chunk<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> Result<(), TransportError> {
        let mut h = [0u8; CHUNK_HEADER_LEN];
        self.read_exact(r, &mut h).await?;
        let header = ChunkHeader::decode(&h)
            .map_err(|e| TransportError::Protocol(format!("chunk {}: {e}", self.done)))?;
        match header.kind {
            ChunkKind::Data => {
                if header.len != self.block_bytes || header.status != Status::Ok {
                    return Err(TransportError::Length(format!(
                        "chunk {} announces {} bytes, a block has {} ({} of {} blocks received)",
                        self.done, header.len, self.block_bytes, self.done, self.id.count
                    )));
                }
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
                    "the exporter aborted after {} of {} blocks: {}",
                    self.done,
                    self.id.count,
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
                    "the stream ended after {} of {} blocks",
                    self.done, self.id.count
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
    use pd_engine::kv::handoff::checksum::block_checksum;

    use super::*;

    const LEN: usize = 3 * PIECE + 12_345;

    fn id(first_block: u64, count: u64) -> PullIdentity {
        PullIdentity {
            lease_id: 1,
            first_block,
            count,
        }
    }

    fn block(seed: usize) -> Vec<u8> {
        (0..LEN)
            .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect()
    }

    /// Lease blocks `first..first + n` on the wire, each with its own checksum.
    async fn encode(first: u64, n: usize) -> (Vec<Vec<u8>>, Vec<u8>) {
        let blocks: Vec<Vec<u8>> = (0..n).map(block).collect();
        let mut out = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            let sum = block_checksum(first + i as u64, b);
            write_block(&mut out, &[b], sum).await.unwrap();
        }
        (blocks, out)
    }

    async fn decode(stream: &[u8], first: u64, n: usize) -> Result<Vec<Vec<u8>>, TransportError> {
        let mut r = BlockReader::new(LEN as u64, id(first, n as u64));
        let mut src = stream;
        let mut out = Vec::new();
        for _ in 0..n {
            let mut buf = vec![0u8; LEN];
            r.read_block(&mut src, &mut buf).await?;
            out.push(buf);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn blocks_round_trip_with_their_lease_index_checksums() {
        let (blocks, stream) = encode(5, 3).await;
        assert_eq!(stream.len(), 3 * (CHUNK_HEADER_LEN + LEN + CHECKSUM_LEN));
        assert_eq!(decode(&stream, 5, 3).await.unwrap(), blocks);
    }

    #[tokio::test]
    async fn a_block_read_into_segments_lands_in_order_and_verifies() {
        let (blocks, stream) = encode(2, 2).await;
        let mut r = BlockReader::new(LEN as u64, id(2, 2));
        let mut src = &stream[..];
        for want in &blocks {
            // Uneven segments, one of them longer than a read piece.
            let mut a = vec![0u8; 100];
            let mut b = vec![0u8; PIECE + 7];
            let mut c = vec![0u8; LEN - 107 - PIECE];
            r.read_block_into(&mut src, &mut [&mut a, &mut b, &mut c])
                .await
                .unwrap();
            assert_eq!([a, b, c].concat(), *want);
        }
    }

    #[tokio::test]
    async fn a_block_read_as_another_lease_index_fails_its_checksum() {
        let (_, stream) = encode(5, 2).await;
        let err = decode(&stream, 6, 2).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Checksum { block: 6, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_flipped_payload_bit_fails_the_checksum_of_its_block() {
        let (_, mut stream) = encode(0, 2).await;
        stream[2 * CHUNK_HEADER_LEN + LEN + CHECKSUM_LEN + 5] ^= 0x10;
        let err = decode(&stream, 0, 2).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Checksum { block: 1, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn swapped_blocks_fail_even_with_valid_checksums() {
        let (_, stream) = encode(0, 2).await;
        let c = CHUNK_HEADER_LEN + LEN + CHECKSUM_LEN;
        let mut swapped = stream[c..].to_vec();
        swapped.extend_from_slice(&stream[..c]);
        let err = decode(&swapped, 0, 2).await.unwrap_err();
        assert!(
            matches!(err, TransportError::Checksum { block: 0, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn truncation_and_wrong_chunk_lengths_are_length_errors() {
        let (_, stream) = encode(0, 2).await;
        for cut in [0, 10, CHUNK_HEADER_LEN + 100, stream.len() - 1] {
            let err = decode(&stream[..cut], 0, 2).await.unwrap_err();
            assert!(matches!(err, TransportError::Length(_)), "cut {cut}: {err}");
        }
        let mut bad = stream.clone();
        bad[8] ^= 1; // chunk 0's length
        let err = decode(&bad, 0, 2).await.unwrap_err();
        assert!(matches!(err, TransportError::Length(_)), "{err}");
        let mut bad = stream;
        bad[0] = 7; // chunk kind
        let err = decode(&bad, 0, 2).await.unwrap_err();
        assert!(matches!(err, TransportError::Protocol(_)), "{err}");
    }

    #[tokio::test]
    async fn an_abort_chunk_becomes_the_typed_error_of_its_status() {
        let (_, mut stream) = encode(0, 1).await;
        write_abort(&mut stream, Status::UnknownLease, "lease 1 expired")
            .await
            .unwrap();
        let err = decode(&stream, 0, 2).await.unwrap_err();
        match err {
            TransportError::UnknownLease {
                lease_id: 1,
                message,
                ..
            } => {
                assert!(message.contains("lease 1 expired") && message.contains("1 of 2"));
            }
            e => panic!("{e}"),
        }
    }
}
