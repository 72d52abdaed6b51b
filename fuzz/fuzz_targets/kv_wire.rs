//! The KV transport's wire, as a peer can write it: the importer's whole reading of an
//! exporter's reply (response frame, chunk headers, blocks, checksums, aborts), and the frame
//! headers and bodies both sides decode.
//!
//! Properties: reading never panics, never allocates by what the peer claims, and fails with a
//! typed error; a well-formed reply reads back exactly the blocks sent, and any one corrupted
//! byte or a cut is either harmless (a reserved field) or refused, never read as other
//! blocks; a refusal becomes the error of its status; every header that decodes encodes back
//! to the same bytes.
#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use pd_engine::kv::handoff::checksum::block_checksum;
use pd_engine::serve::LeaseSecret;
use pd_transport::wire::{
    CHUNK_HEADER_LEN, ChunkHeader, ChunkKind, FRAME_HEADER_LEN, FrameHeader, FrameKind,
    PULL_REQUEST_BODY_LEN, PULL_RESPONSE_BODY_LEN, PullRequestFrame, PullResponseFrame, Status,
};
use pd_transport::{LayoutFingerprint, PullRequest, TransportError, read_pull_reply};

/// Polls a future that reads from memory: it never waits.
fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("reading from memory waited"),
    }
}

/// A small pull described by 6 bytes (the fuzzer keeps the blocks small).
fn request(b: &[u8; 6]) -> PullRequest {
    PullRequest {
        lease_id: u64::from(b[0]),
        lease_secret: LeaseSecret::from_bytes([b[1]; 16]),
        fingerprint: LayoutFingerprint(u64::from(b[2])),
        first_block: usize::from(b[3]),
        count: usize::from(b[4] % 5),
        block_bytes: 1 + usize::from(b[5] % 48),
    }
}

/// What the importer read.
fn read(stream: &[u8], req: &PullRequest) -> Result<Vec<Vec<u8>>, TransportError> {
    let mut r = stream;
    let blocks = now(read_pull_reply(&mut r, req))?;
    assert_eq!(blocks.len(), req.count, "a pull reads its count of blocks");
    Ok(blocks
        .iter()
        .map(|b| {
            assert_eq!(
                b.as_bytes().len(),
                req.block_bytes,
                "a block has block_bytes"
            );
            b.as_bytes().to_vec()
        })
        .collect())
}

/// An error a reply from memory may cause: typed, with a message, never a deadline or RDMA.
fn check_error(e: &TransportError) {
    assert!(
        !matches!(
            e,
            TransportError::Deadline { .. }
                | TransportError::Rdma(_)
                | TransportError::Connect { .. }
        ),
        "impossible error for a reply read from memory: {e:?}"
    );
    assert!(!e.to_string().is_empty());
    let _ = e.reason();
}

/// The reply a correct exporter sends for `req`, with these blocks.
fn reply(req: &PullRequest, blocks: &[Vec<u8>]) -> Vec<u8> {
    let mut out = PullResponseFrame {
        status: Status::Ok,
        chunk_bytes: req.block_bytes as u32,
        fingerprint: req.fingerprint,
        lease_id: req.lease_id,
        first_block: req.first_block as u64,
        count: req.count as u64,
        block_bytes: req.block_bytes as u64,
        message: String::new(),
    }
    .encode();
    for (i, block) in blocks.iter().enumerate() {
        let header = ChunkHeader {
            kind: ChunkKind::Data,
            status: Status::Ok,
            len: block.len() as u64,
        };
        out.extend(header.encode());
        out.extend(block);
        let index = (req.first_block + i) as u64;
        out.extend(block_checksum(index, block).to_le_bytes());
    }
    out
}

fn status_of(b: u8) -> Status {
    match b % 7 {
        0 => Status::Ok,
        1 => Status::UnknownLease,
        2 => Status::FingerprintMismatch,
        3 => Status::Length,
        4 => Status::BadRequest,
        5 => Status::Unavailable,
        _ => Status::UnsupportedVersion,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Some((head, rest)) = rest.split_first_chunk::<6>() else {
        return;
    };
    let req = request(head);
    match mode % 4 {
        // Whatever a peer sends.
        0 => {
            if let Err(e) = read(rest, &req) {
                check_error(&e);
            }
        }
        // A correct reply, then one byte changed or the stream cut.
        1 => {
            let Some((edit, payload)) = rest.split_first_chunk::<4>() else {
                return;
            };
            let blocks: Vec<Vec<u8>> = (0..req.count)
                .map(|i| {
                    (0..req.block_bytes)
                        .map(|j| {
                            payload
                                .get(i * req.block_bytes + j)
                                .copied()
                                .unwrap_or(j as u8)
                        })
                        .collect()
                })
                .collect();
            let good = reply(&req, &blocks);
            assert_eq!(read(&good, &req).expect("a correct reply reads"), blocks);
            let at = usize::from(u16::from_le_bytes([edit[0], edit[1]])) % good.len();
            let mut bad = good.clone();
            if edit[2] == 0 {
                bad.truncate(at);
                match read(&bad, &req) {
                    Ok(_) => panic!("a reply cut at byte {at} of {} was read", good.len()),
                    Err(e) => check_error(&e),
                }
            } else {
                bad[at] ^= edit[2];
                match read(&bad, &req) {
                    // Only reserved bytes may change unseen.
                    Ok(got) => {
                        assert_eq!(got, blocks, "byte {at} changed the blocks read");
                        let reserved = [
                            FRAME_HEADER_LEN + 2..FRAME_HEADER_LEN + 4,
                            FRAME_HEADER_LEN + 52..FRAME_HEADER_LEN + 56,
                        ];
                        assert!(
                            reserved.iter().any(|r| r.contains(&at))
                                || (req.count == 0
                                    && (FRAME_HEADER_LEN + 4..FRAME_HEADER_LEN + 8).contains(&at)),
                            "byte {at} changed unnoticed"
                        );
                    }
                    Err(e) => check_error(&e),
                }
            }
        }
        // A refusal, read by the importer: the error of its status, never blocks.
        2 => {
            let status = status_of(rest.first().copied().unwrap_or(1));
            let message = String::from_utf8_lossy(rest.get(1..).unwrap_or_default());
            let refusal = PullResponseFrame::refusal(status, message.clone());
            let encoded = refusal.encode();
            if status == Status::Ok {
                return;
            }
            let e = read(&encoded, &req).expect_err("a refusal reads no blocks");
            check_error(&e);
            match status {
                Status::UnknownLease => {
                    assert!(matches!(e, TransportError::UnknownLease { .. }), "{e:?}")
                }
                Status::FingerprintMismatch => {
                    assert!(
                        matches!(e, TransportError::FingerprintMismatch { .. }),
                        "{e:?}"
                    )
                }
                Status::Length => assert!(matches!(e, TransportError::Length(_)), "{e:?}"),
                _ => assert!(matches!(e, TransportError::Refused(_)), "{e:?}"),
            }
        }
        // Headers and bodies: what decodes encodes back to the same bytes.
        _ => {
            if let Some(b) = rest.first_chunk::<FRAME_HEADER_LEN>()
                && let Ok(h) = FrameHeader::decode(b)
            {
                assert_eq!(&h.encode(), b);
                if h.expect(FrameKind::PullRequest, PULL_REQUEST_BODY_LEN)
                    .is_ok()
                {
                    assert_eq!(h, FrameHeader::new(FrameKind::PullRequest, 64));
                }
            }
            if let Some(b) = rest.first_chunk::<PULL_REQUEST_BODY_LEN>() {
                let req = PullRequestFrame::decode_body(b);
                let encoded = req.encode();
                // All but the reserved last 4 bytes.
                assert_eq!(
                    encoded[FRAME_HEADER_LEN..FRAME_HEADER_LEN + 60],
                    b[..60],
                    "a pull request body round trips"
                );
                assert_eq!(
                    PullRequestFrame::decode_body(encoded[12..].try_into().unwrap()),
                    req
                );
            }
            if let Some(b) = rest.first_chunk::<PULL_RESPONSE_BODY_LEN>()
                && let Ok((resp, msg_len)) = PullResponseFrame::decode_body(b)
            {
                let encoded = resp.encode();
                let body = &encoded[FRAME_HEADER_LEN..];
                assert_eq!(body[..2], b[..2], "status");
                assert_eq!(
                    body[4..48],
                    b[4..48],
                    "all but reserved fields and the message"
                );
                assert_eq!(
                    msg_len,
                    u32::from_le_bytes(b[48..52].try_into().unwrap()) as usize
                );
            }
            if let Some(b) = rest.first_chunk::<CHUNK_HEADER_LEN>()
                && let Ok(h) = ChunkHeader::decode(b)
            {
                assert_eq!(&h.encode(), b, "a chunk header round trips");
            }
        }
    }
});
