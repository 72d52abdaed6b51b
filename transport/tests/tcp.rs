//! The TCP backend through real sockets on 127.0.0.1 with ephemeral ports: round trips,
//! every refusal and failure as its typed error, misbehaving peers (stalling, corrupting,
//! truncating, not speaking the protocol), concurrency, connection reuse and shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pd_engine::kv::handoff::host_buffer::HostBuffer;
use pd_engine::serve::{LeaseSecret, LeasedKv};
use pd_transport::wire::{
    FRAME_HEADER_LEN, FrameHeader, PULL_RESPONSE_BODY_LEN, PullRequestFrame, PullResponseFrame,
    Status,
};
use pd_transport::{
    ExportConfig, ExportStats, FailureReason, KvExportServer, KvPuller, KvSource,
    LayoutFingerprint, PullRequest, SharedBlocks, TransportError, pull_blocks,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const FP: LayoutFingerprint = LayoutFingerprint(0x5eed_f1a7_0000_0001);
const LEASE: u64 = 42;
const SECRET: LeaseSecret = LeaseSecret::from_bytes(*b"sixteen byte key");

/// An in-memory exporter: one lease holding `blocks`; `fail_after` calls, the lease is gone
/// (as if it expired mid-transfer).
struct MemSource {
    lease: Arc<LeasedKv>,
    calls: AtomicUsize,
    fail_after: usize,
}

impl MemSource {
    fn new(blocks: Vec<Vec<u8>>) -> Arc<Self> {
        Self::failing_after(blocks, usize::MAX)
    }

    fn failing_after(blocks: Vec<Vec<u8>>, fail_after: usize) -> Arc<Self> {
        Arc::new(Self {
            lease: Arc::new(LeasedKv::new(blocks)),
            calls: AtomicUsize::new(0),
            fail_after,
        })
    }
}

impl KvSource for MemSource {
    fn read_blocks(
        &self,
        lease_id: u64,
        secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<SharedBlocks> {
        if self.calls.fetch_add(1, Ordering::SeqCst) >= self.fail_after
            || lease_id != LEASE
            || !secret.matches(&SECRET)
        {
            return None;
        }
        SharedBlocks::new(Arc::clone(&self.lease), first, count)
    }
}

/// Random bytes, `len` per block (as f32 they hold NaNs and infinities too: the transport
/// moves bytes).
fn random_blocks(n: usize, len: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut s = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| (0..len).map(|_| next() as u8).collect())
        .collect()
}

/// Pulled blocks hold exactly the exported ones.
fn same_bits(a: &[HostBuffer], b: &[Vec<u8>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.as_bytes() == &b[..])
}

/// Small batches so that a few MB cross many batch boundaries.
fn small_config() -> ExportConfig {
    ExportConfig {
        batch_bytes: 3 << 20,
        ..ExportConfig::default()
    }
}

async fn serve(source: Arc<MemSource>, config: ExportConfig) -> (KvExportServer, SocketAddr) {
    KvExportServer::bind_with("127.0.0.1:0".parse().unwrap(), FP, source, config)
        .await
        .expect("bind an ephemeral port")
}

fn req(first_block: usize, count: usize, block_bytes: usize) -> PullRequest {
    PullRequest {
        lease_id: LEASE,
        lease_secret: SECRET,
        fingerprint: FP,
        first_block,
        count,
        block_bytes,
    }
}

/// The exporter counts a pull once its last byte is flushed, which can be just after the
/// importer returns: wait (briefly) for its counters to settle.
async fn settled_stats(
    server: &KvExportServer,
    done: impl Fn(&ExportStats) -> bool,
) -> ExportStats {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = server.stats();
        if done(&stats) || Instant::now() > give_up {
            return stats;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_blocks_of_random_data_round_trip_bit_exact() {
    let len = 160_000; // 160 KB blocks, several per 3 MiB batch
    let blocks = random_blocks(64, len, 1);
    let source = MemSource::new(blocks.clone());
    let (server, addr) = serve(Arc::clone(&source), small_config()).await;
    assert_ne!(addr.port(), 0, "the real port is returned");
    assert_eq!(server.local_addr(), addr);

    let all = pull_blocks(addr, req(0, 64, len), soon()).await.unwrap();
    assert!(same_bits(&all, &blocks));
    let mid = pull_blocks(addr, req(17, 30, len), soon()).await.unwrap();
    assert!(same_bits(&mid, &blocks[17..47]));
    let last = pull_blocks(addr, req(63, 1, len), soon()).await.unwrap();
    assert!(same_bits(&last, &blocks[63..]));
    let none = pull_blocks(addr, req(64, 0, len), soon()).await.unwrap();
    assert!(none.is_empty());

    let stats = settled_stats(&server, |s| s.pulls_ok == 4).await;
    assert_eq!(
        (stats.pulls_ok, stats.pulls_refused, stats.pulls_failed),
        (4, 0, 0)
    );
    assert_eq!(stats.bytes_sent, (64 + 30 + 1) * len as u64);
    server.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn default_config_moves_qwen_sized_blocks() {
    let len = 2 * 28 * 16 * 8 * 128 * 4 / 16; // a Qwen3-0.6B f32 block cut 16x, to be quick
    let blocks = random_blocks(40, len, 2);
    let (server, addr) = serve(MemSource::new(blocks.clone()), ExportConfig::default()).await;
    let got = pull_blocks(addr, req(0, 40, len), soon()).await.unwrap();
    assert!(same_bits(&got, &blocks));
    server.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn unknown_lease_and_out_of_range_blocks_are_unknown_lease() {
    let blocks = random_blocks(4, 100, 3);
    let (server, addr) = serve(MemSource::new(blocks), small_config()).await;
    let mut bad = req(0, 1, 100);
    bad.lease_id = 7;
    let err = pull_blocks(addr, bad, soon()).await.unwrap_err();
    assert!(
        matches!(err, TransportError::UnknownLease { lease_id: 7, .. }),
        "{err}"
    );
    assert_eq!(err.reason(), FailureReason::LeaseGone);
    let err = pull_blocks(addr, req(3, 2, 100), soon()).await.unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::UnknownLease {
                first_block: 3,
                count: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("blocks 3..5"), "{err}");
    assert_eq!(server.stats().pulls_refused, 2);
}

/// The raw answer to one pull request frame: the response header, then whatever else the
/// exporter sent before closing (nothing, for a refusal).
async fn raw_answer(addr: SocketAddr, frame: PullRequestFrame) -> (PullResponseFrame, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&frame.encode()).await.unwrap();
    s.shutdown().await.unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).await.unwrap();
    let header = FrameHeader::decode(reply[..FRAME_HEADER_LEN].try_into().unwrap()).unwrap();
    let body = &reply[FRAME_HEADER_LEN..FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN];
    let (mut resp, msg_len) = PullResponseFrame::decode_body(body.try_into().unwrap()).unwrap();
    let rest = FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN;
    resp.message = String::from_utf8(reply[rest..rest + msg_len].to_vec()).unwrap();
    assert_eq!(header.body_len as usize, PULL_RESPONSE_BODY_LEN + msg_len);
    (resp, reply[rest + msg_len..].to_vec())
}

#[tokio::test]
async fn a_wrong_secret_an_unknown_id_and_a_range_outside_get_one_refusal_saying_nothing() {
    let blocks = random_blocks(4, 100, 3);
    let source = MemSource::new(blocks);
    let (server, addr) = serve(Arc::clone(&source), small_config()).await;
    let good = PullRequestFrame {
        lease_id: LEASE,
        lease_secret: SECRET,
        fingerprint: FP,
        first_block: 0,
        count: 4,
        block_bytes: 100,
        timeout_ms: 5000,
    };
    let (ok, payload) = raw_answer(addr, good).await;
    assert_eq!(ok.status, Status::Ok);
    assert!(payload.len() > 400, "the right secret gets the KV");

    let mut wrong_secret_bytes = *SECRET.as_bytes();
    wrong_secret_bytes[0] ^= 0x80;
    let cases = [
        PullRequestFrame {
            lease_secret: LeaseSecret::from_bytes(wrong_secret_bytes),
            ..good
        },
        PullRequestFrame {
            lease_secret: LeaseSecret::from_bytes([0; 16]),
            ..good
        },
        PullRequestFrame {
            lease_id: LEASE + 1,
            ..good
        },
        PullRequestFrame {
            lease_id: LEASE - 1,
            ..good
        },
        PullRequestFrame {
            first_block: 3,
            count: 2,
            ..good
        },
        // A wrong fingerprint with a wrong secret: still nothing about the layout.
        PullRequestFrame {
            lease_secret: LeaseSecret::from_bytes(wrong_secret_bytes),
            fingerprint: LayoutFingerprint(1),
            ..good
        },
        // A wrong block length with a wrong secret: nothing about the block length.
        PullRequestFrame {
            lease_secret: LeaseSecret::from_bytes(wrong_secret_bytes),
            block_bytes: 99,
            ..good
        },
    ];
    let mut answers = Vec::new();
    for frame in cases {
        let (resp, payload) = raw_answer(addr, frame).await;
        assert!(
            payload.is_empty(),
            "no byte of KV: {} bytes came",
            payload.len()
        );
        assert_eq!(resp.status, Status::UnknownLease);
        assert_eq!(
            (
                resp.fingerprint,
                resp.chunk_bytes,
                resp.block_bytes,
                resp.count
            ),
            (LayoutFingerprint(0), 0, 0, 0),
            "no fingerprint, block size or count"
        );
        assert_eq!((resp.lease_id, resp.first_block), (0, 0));
        assert!(
            !resp.message.contains("100") && !resp.message.contains(&FP.to_string()),
            "{}",
            resp.message
        );
        answers.push(resp);
    }
    assert!(
        answers.windows(2).all(|w| w[0] == w[1]),
        "every refusal is the same: {answers:?}"
    );
    // Through the importer: a lease that is gone, as far as it can tell.
    let mut wrong = req(0, 1, 100);
    wrong.lease_secret = LeaseSecret::from_bytes(wrong_secret_bytes);
    let err = pull_blocks(addr, wrong, soon()).await.unwrap_err();
    assert!(matches!(err, TransportError::UnknownLease { .. }), "{err}");
    assert_eq!(err.reason(), FailureReason::LeaseGone);
    assert_eq!(server.stats().pulls_ok, 1);
}

#[tokio::test]
async fn a_fingerprint_mismatch_is_said_only_to_the_lease_holder_and_sends_no_kv() {
    let blocks = random_blocks(4, 100, 4);
    let source = MemSource::new(blocks);
    let (server, addr) = serve(Arc::clone(&source), small_config()).await;
    let mut other = req(0, 4, 100);
    other.fingerprint = LayoutFingerprint(1);
    let err = pull_blocks(addr, other, soon()).await.unwrap_err();
    match &err {
        TransportError::FingerprintMismatch { ours, theirs } => {
            assert_eq!((*ours, *theirs), (LayoutFingerprint(1), FP));
        }
        e => panic!("{e}"),
    }
    assert_eq!(err.reason(), FailureReason::LayoutMismatch);
    assert!(err.to_string().contains(&FP.to_string()), "{err}");
    assert_eq!(
        source.calls.load(Ordering::SeqCst),
        1,
        "the lease was authenticated first"
    );

    // On the wire: exactly one response frame, then nothing (no payload).
    let frame = PullRequestFrame {
        lease_id: LEASE,
        lease_secret: SECRET,
        fingerprint: LayoutFingerprint(1),
        first_block: 0,
        count: 4,
        block_bytes: 400,
        timeout_ms: 5000,
    };
    let (resp, payload) = raw_answer(addr, frame).await;
    assert!(payload.is_empty());
    assert_eq!(resp.status, Status::FingerprintMismatch);
    assert_eq!(resp.fingerprint, FP);
    let stats = server.stats();
    assert_eq!((stats.pulls_refused, stats.bytes_sent), (2, 0));
}

#[tokio::test]
async fn a_wrong_block_length_is_a_length_error() {
    let (_server, addr) = serve(MemSource::new(random_blocks(4, 100, 5)), small_config()).await;
    let err = pull_blocks(addr, req(0, 2, 99), soon()).await.unwrap_err();
    assert!(matches!(err, TransportError::Length(_)), "{err}");
    assert!(err.to_string().contains("99"), "{err}");
}

#[tokio::test]
async fn a_lease_that_vanishes_mid_transfer_aborts_with_unknown_lease() {
    let len = 400_000; // 400 KB blocks, 3 MiB batches: several source reads per pull
    let source = MemSource::failing_after(random_blocks(32, len, 6), 2);
    let (server, addr) = serve(source, small_config()).await;
    let err = pull_blocks(addr, req(0, 32, len), soon())
        .await
        .unwrap_err();
    match &err {
        TransportError::UnknownLease { message, .. } => {
            assert!(message.contains("aborted after"), "{message}");
        }
        e => panic!("{e}"),
    }
    assert_eq!(server.stats().pulls_failed, 1);
}

#[tokio::test]
async fn a_stalled_exporter_fails_with_deadline() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stall = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (s, _) = listener.accept().await.unwrap();
            held.push(s); // accept, read nothing, answer nothing
        }
    });
    let err = pull_blocks(
        addr,
        req(0, 1, 10),
        Instant::now() + Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Deadline {
                stage: "transferring",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(err.reason(), FailureReason::Timeout);
    let err = KvPuller::new()
        .pull(
            addr,
            req(0, 1, 10),
            Instant::now() + Duration::from_millis(200),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Deadline { .. }), "{err}");
    stall.abort();
}

#[tokio::test]
async fn a_past_deadline_and_a_closed_port_fail_at_once() {
    let (_server, addr) = serve(MemSource::new(random_blocks(1, 10, 7)), small_config()).await;
    let err = pull_blocks(addr, req(0, 1, 10), Instant::now())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Deadline {
                stage: "connecting",
                ..
            }
        ),
        "{err}"
    );

    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let err = pull_blocks(closed, req(0, 1, 10), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err}");
    assert_eq!(err.reason(), FailureReason::Connection);
    assert!(err.to_string().contains(&closed.to_string()), "{err}");
}

#[derive(Clone, Copy)]
enum Fault {
    /// XOR this byte (offset in the exporter -> importer stream) with 0x01.
    Flip(u64),
    /// Close both sides after this many exporter -> importer bytes.
    Cut(u64),
}

/// A man in the middle in front of `upstream` that damages what the exporter sends.
async fn faulty_proxy(upstream: SocketAddr, fault: Fault) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let server = TcpStream::connect(upstream).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                });
                let mut offset = 0u64;
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let piece = &mut buf[..n];
                    match fault {
                        Fault::Flip(at) if (offset..offset + n as u64).contains(&at) => {
                            piece[(at - offset) as usize] ^= 0x01;
                        }
                        Fault::Cut(at) if offset + n as u64 >= at => {
                            let keep = (at - offset) as usize;
                            let _ = cw.write_all(&piece[..keep]).await;
                            break;
                        }
                        _ => {}
                    }
                    if cw.write_all(piece).await.is_err() {
                        break;
                    }
                    offset += n as u64;
                }
                up.abort();
            });
        }
    });
    addr
}

/// Response header, response body and the first chunk header come before payload byte 0.
const PAYLOAD_START: u64 = (FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN + 16) as u64;

#[tokio::test]
async fn a_corrupted_payload_fails_the_checksum() {
    let blocks = random_blocks(8, 400_000, 8);
    let (_server, upstream) = serve(MemSource::new(blocks), small_config()).await;
    let proxy = faulty_proxy(upstream, Fault::Flip(PAYLOAD_START + 1_500_000)).await;
    let err = pull_blocks(proxy, req(0, 8, 400_000), soon())
        .await
        .unwrap_err();
    // A chunk is a block (400,000 bytes) with 24 bytes of framing: payload byte 1.5 M is
    // in block 3.
    assert!(
        matches!(err, TransportError::Checksum { block: 3, .. }),
        "{err}"
    );
    assert_eq!(err.reason(), FailureReason::Checksum);
}

#[tokio::test]
async fn a_corrupted_header_is_caught_too() {
    let blocks = random_blocks(2, 1000, 9);
    let (_server, upstream) = serve(MemSource::new(blocks), small_config()).await;
    // The echoed fingerprint (response body bytes 8..16).
    let proxy = faulty_proxy(upstream, Fault::Flip(FRAME_HEADER_LEN as u64 + 8)).await;
    let err = pull_blocks(proxy, req(0, 2, 1000), soon())
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::FingerprintMismatch { .. }),
        "{err}"
    );
    // The first chunk's length.
    let proxy = faulty_proxy(upstream, Fault::Flip(PAYLOAD_START - 8)).await;
    let err = pull_blocks(proxy, req(0, 2, 1000), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Length(_)), "{err}");
    // The magic.
    let proxy = faulty_proxy(upstream, Fault::Flip(0)).await;
    let err = pull_blocks(proxy, req(0, 2, 1000), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Protocol(_)), "{err}");
}

#[tokio::test]
async fn a_truncated_stream_is_a_length_error() {
    let blocks = random_blocks(8, 400_000, 10);
    let (_server, upstream) = serve(MemSource::new(blocks), small_config()).await;
    for cut in [PAYLOAD_START + 2_000_000, PAYLOAD_START + 3] {
        let proxy = faulty_proxy(upstream, Fault::Cut(cut)).await;
        let err = pull_blocks(proxy, req(0, 8, 400_000), soon())
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransportError::Length(_)),
            "cut at {cut}: {err}"
        );
        assert!(err.to_string().contains("of 8 blocks"), "{err}");
    }
    // Cut inside the response header: an I/O error (nothing of the payload was announced).
    let proxy = faulty_proxy(upstream, Fault::Cut(5)).await;
    let err = pull_blocks(proxy, req(0, 8, 400_000), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Io(_)), "{err}");
}

#[tokio::test]
async fn a_peer_that_is_not_an_exporter_is_a_protocol_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 76];
        let _ = s.read_exact(&mut buf).await;
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
    });
    let err = pull_blocks(addr, req(0, 1, 10), soon()).await.unwrap_err();
    assert!(matches!(err, TransportError::Protocol(_)), "{err}");
    assert!(err.to_string().contains("magic"), "{err}");
}

#[tokio::test]
async fn the_exporter_answers_an_unknown_version_with_its_own_and_closes() {
    let (_server, addr) = serve(MemSource::new(random_blocks(1, 10, 11)), small_config()).await;
    let mut frame = PullRequestFrame {
        lease_id: LEASE,
        lease_secret: SECRET,
        fingerprint: FP,
        first_block: 0,
        count: 1,
        block_bytes: 40,
        timeout_ms: 1000,
    }
    .encode();
    frame[4] = 9; // version 9
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&frame).await.unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).await.unwrap();
    let header = FrameHeader::decode(reply[..FRAME_HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(header.version, pd_transport::wire::VERSION);
    let body = &reply[FRAME_HEADER_LEN..FRAME_HEADER_LEN + PULL_RESPONSE_BODY_LEN];
    let (resp, _) = PullResponseFrame::decode_body(body.try_into().unwrap()).unwrap();
    assert_eq!(resp.status, Status::UnsupportedVersion);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_pulls_each_get_their_own_blocks() {
    let len = 80_000;
    let blocks = Arc::new(random_blocks(128, len, 12));
    let (server, addr) = serve(MemSource::new(blocks.to_vec()), small_config()).await;
    let puller = KvPuller::new();
    let mut tasks = Vec::new();
    for t in 0..16usize {
        let blocks = Arc::clone(&blocks);
        let puller = puller.clone();
        tasks.push(tokio::spawn(async move {
            let (first, count) = (t * 7, 8 + t % 5);
            let r = req(first, count, len);
            let got = if t % 2 == 0 {
                pull_blocks(addr, r, soon()).await
            } else {
                puller.pull(addr, r, soon()).await
            }
            .unwrap();
            assert!(same_bits(&got, &blocks[first..first + count]), "task {t}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        settled_stats(&server, |s| s.pulls_ok == 16).await.pulls_ok,
        16
    );
    assert!(puller.idle_connections(addr) >= 1);
}

#[tokio::test]
async fn a_pooled_connection_serves_many_pulls_and_survives_refusals() {
    let blocks = random_blocks(16, 1000, 13);
    let (server, addr) = serve(MemSource::new(blocks.clone()), small_config()).await;
    let puller = KvPuller::new();
    for i in 0..5 {
        let got = puller.pull(addr, req(i, 3, 1000), soon()).await.unwrap();
        assert!(same_bits(&got, &blocks[i..i + 3]));
    }
    assert_eq!(
        server.stats().connections,
        1,
        "one connection for five pulls"
    );
    assert_eq!(puller.idle_connections(addr), 1);
    // A refusal leaves no payload behind; the next pull opens a new connection (failed
    // connections are never pooled) and works.
    let err = puller
        .pull(addr, req(15, 2, 1000), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::UnknownLease { .. }), "{err}");
    let got = puller.pull(addr, req(15, 1, 1000), soon()).await.unwrap();
    assert!(same_bits(&got, &blocks[15..]));
    assert_eq!(server.stats().connections, 2);
}

#[tokio::test]
async fn a_pooled_connection_the_exporter_closed_is_replaced_transparently() {
    let blocks = random_blocks(4, 1000, 14);
    let config = ExportConfig {
        idle_timeout: Duration::from_millis(100),
        ..small_config()
    };
    let (server, addr) = serve(MemSource::new(blocks.clone()), config).await;
    let puller = KvPuller::new();
    puller.pull(addr, req(0, 1, 1000), soon()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await; // the exporter idles it out
    let got = puller.pull(addr, req(1, 3, 1000), soon()).await.unwrap();
    assert!(same_bits(&got, &blocks[1..]));
    assert_eq!(server.stats().connections, 2);
}

#[tokio::test]
async fn shutdown_closes_idle_connections_and_frees_the_port() {
    let blocks = random_blocks(4, 1000, 15);
    let (server, addr) = serve(MemSource::new(blocks), small_config()).await;
    let puller = KvPuller::new();
    puller.pull(addr, req(0, 4, 1000), soon()).await.unwrap();
    let t = Instant::now();
    server.shutdown(Duration::from_secs(10)).await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "an idle pooled connection does not hold shutdown up"
    );
    let err = pull_blocks(addr, req(0, 1, 1000), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err}");
    let err = puller
        .pull(addr, req(0, 1, 1000), soon())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err}");
}

#[tokio::test]
async fn dropping_the_server_stops_it() {
    let (server, addr) = serve(MemSource::new(random_blocks(1, 10, 16)), small_config()).await;
    drop(server);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let err = pull_blocks(addr, req(0, 1, 10), soon()).await.unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err}");
}
