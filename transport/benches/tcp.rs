//! KV transfer throughput over loopback TCP, beside two baselines measured in the same run:
//! a raw socket (plain write / read of the same bytes into preallocated buffers over one
//! open connection, no framing, no checksum, no copy out of the source) and memcpy of the
//! same bytes.
//!
//! `cargo bench -p pd-transport --bench tcp`
//!
//! The raw socket and the transport run alternately, so that load from elsewhere on a shared
//! machine falls on both alike; the best run of each is reported. Rows:
//! - "pooled into buffers": as a decode node with GPU KV (or no room to reserve) pulls: a
//!   pooled connection, blocks received into the engine's recycled buffers
//!   ([`BlockBuffers`]), which it gives back after copying them into KV storage. Compared
//!   with the raw socket, which also reuses its connection and buffers.
//! - "in place (decode node)": as a decode node with host-memory KV pulls: a pooled
//!   connection, each block read straight into its reserved place in KV memory laid out as
//!   the CPU backend's (`PD_BENCH_REGIONS` regions, default 56 = 28 layers x K and V, so a
//!   block lands in 56 separate 64 KiB pieces); nothing is copied afterwards.
//! - "new conn + buffers": a fresh connection and freshly allocated blocks per pull (what a
//!   GPU node's first pull from a peer costs).
//! - "new conn, in place": a fresh connection per pull into the (already touched) reserved KV
//!   memory: what a CPU node's first pull from a peer costs, TCP's window growth alone.
//! - "over mTLS, in place": the "in place" pull from a second export server over the same
//!   lease with TLS and client certificates (`--tls-*` on both nodes), on a pooled
//!   connection; its ratio to the plaintext row is what TLS costs a KV pull.
//!
//! Environment: `PD_BENCH_BLOCKS` (default 256), `PD_BENCH_BLOCK_BYTES` bytes per block
//! (default 3670016 = Qwen3-0.6B with an f32 cache: 2 x 28 layers x 16 tokens x 8 KV heads
//! x 128 dims x 4 bytes, 3.67 MB; half that is its block with a 16-bit cache),
//! `PD_BENCH_ITERS` (default 10: with 5, one disturbed run on a shared 2-core machine was
//! enough to move the ratio by 0.3).
//!
//! The per-block checksums are computed once, when the lease is made (as the prefill engine
//! does); that time is printed too, but it is not part of a transfer, and so is the copy into
//! fresh buffers that a lease of GPU KV makes first (a lease of host-memory KV pins its
//! blocks in place instead).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::checksum::block_checksum;
use pd_engine::kv::handoff::host_buffer::HostBuffer;
use pd_engine::kv::handoff::placement::{HostKvMemory, KvReservation, ReservationId};
use pd_engine::serve::{LeaseSecret, LeasedKv};
use pd_transport::{
    ExportConfig, KvExportServer, KvPuller, KvSource, LayoutFingerprint, PullRequest, SharedBlocks,
    pull_blocks,
};

struct MemSource(Arc<LeasedKv>);

impl KvSource for MemSource {
    fn read_blocks(
        &self,
        lease_id: u64,
        _secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<SharedBlocks> {
        // Shared, not copied, checksummed beforehand: as the engine's lease store lends a
        // lease's blocks.
        (lease_id == 1)
            .then(|| SharedBlocks::new(Arc::clone(&self.0), first, count))
            .flatten()
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// A raw-socket peer over one open connection: each request byte is answered with every
/// block's bytes.
struct RawPeer {
    stream: TcpStream,
    writer: std::thread::JoinHandle<()>,
}

impl RawPeer {
    fn start(source: Arc<Vec<Vec<u8>>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let writer = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut go = [0u8; 1];
            while s.read_exact(&mut go).is_ok() {
                for b in source.iter() {
                    s.write_all(b).expect("write");
                }
            }
        });
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Self { stream, writer }
    }

    fn read(&mut self, dst: &mut [Vec<u8>]) -> Duration {
        let t = Instant::now();
        self.stream.write_all(&[1]).expect("request");
        for d in dst.iter_mut() {
            self.stream.read_exact(d).expect("read");
        }
        t.elapsed()
    }

    fn stop(self) {
        drop(self.stream);
        self.writer.join().expect("writer");
    }
}

/// Every block of host KV memory laid out as the CPU backend's, reserved in order.
fn reservation(blocks: usize, block_bytes: usize, regions: usize) -> KvReservation {
    let memory = HostKvMemory::allocate(blocks, block_bytes, regions)
        .expect("PD_BENCH_REGIONS must divide the block");
    let ids: Vec<u32> = (0..blocks as u32).collect();
    KvReservation::new(ReservationId(1), 0, &ids, memory, Arc::new(|_| {}))
}

fn main() {
    let blocks = env("PD_BENCH_BLOCKS", 256);
    let block_bytes = env("PD_BENCH_BLOCK_BYTES", 2 * 28 * 16 * 8 * 128 * 4);
    let iters = env("PD_BENCH_ITERS", 10).max(1);
    let regions = env("PD_BENCH_REGIONS", 56).max(1);
    let bytes = (blocks * block_bytes) as u64;
    println!(
        "{blocks} blocks x {:.2} MB = {:.1} MB per transfer, best of {iters}, raw socket and \
         transport alternating",
        block_bytes as f64 / 1e6,
        bytes as f64 / 1e6
    );

    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let blocks_data: Vec<Vec<u8>> = (0..blocks)
        .map(|_| {
            (0..block_bytes)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    (state >> 56) as u8
                })
                .collect()
        })
        .collect();
    // The per-block checksums are computed here, as the prefill engine computes them when
    // it makes a lease (not during a transfer).
    // A GPU node's lease first copies the blocks out of KV storage into fresh buffers (a
    // host-memory node's pins them in place instead): that copy, timed.
    let copy_started = Instant::now();
    let copies = blocks_data.clone();
    let copy_time = copy_started.elapsed();
    let lease_started = Instant::now();
    let source = Arc::new(LeasedKv::new(copies));
    let checksum_time = lease_started.elapsed();
    let blocks_data = Arc::new(blocks_data);
    let mut dst: Vec<Vec<u8>> = vec![vec![0u8; block_bytes]; blocks];
    let check = |got: &[&[u8]]| {
        assert_eq!(got.len(), blocks);
        assert!(
            got.iter().zip(blocks_data.iter()).all(|(g, s)| g == s),
            "data differs"
        );
    };
    let check_buffers = |got: &[HostBuffer]| {
        check(&got.iter().map(|b| b.as_bytes()).collect::<Vec<_>>());
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let fp = LayoutFingerprint(0x1234);
    let (server, addr): (KvExportServer, SocketAddr) = rt
        .block_on(KvExportServer::bind(
            "127.0.0.1:0".parse().expect("addr"),
            fp,
            Arc::new(MemSource(Arc::clone(&source))),
        ))
        .expect("bind");
    // The same source behind a second export server with mTLS, and a puller with the
    // member certificate: KV pull throughput over TLS beside plaintext, in the same rounds.
    let certs = tempfile::tempdir().expect("tempdir");
    let tls = mtls_settings(certs.path());
    let tls_config = ExportConfig {
        tls: pd_tls::ServerTls::new(&tls, pd_tls::Alpn::None).expect("server TLS"),
        ..ExportConfig::default()
    };
    let (tls_server, tls_addr): (KvExportServer, SocketAddr) = rt
        .block_on(KvExportServer::bind_with(
            "127.0.0.1:0".parse().expect("addr"),
            fp,
            Arc::new(MemSource(Arc::clone(&source))),
            tls_config,
        ))
        .expect("bind");
    let tls_puller = KvPuller::new()
        .with_tls(pd_tls::ClientTls::new(&tls, pd_tls::Alpn::None).expect("client TLS"));
    let req = PullRequest {
        lease_id: 1,
        lease_secret: LeaseSecret::from_bytes([1; 16]),
        fingerprint: fp,
        first_block: 0,
        count: blocks,
        block_bytes,
    };
    let deadline = || Instant::now() + Duration::from_secs(600);

    let buffers = BlockBuffers::new(block_bytes, bytes as usize);
    let puller = KvPuller::with_buffers(buffers.clone());
    let mut raw_peer = RawPeer::start(Arc::clone(&blocks_data));
    // Warm-up: connections open, buffers faulted in.
    raw_peer.read(&mut dst);
    let warm = rt
        .block_on(puller.pull(addr, req, deadline()))
        .expect("warm-up pull");
    buffers.give_all(warm);
    let mut into = reservation(blocks, block_bytes, regions);
    rt.block_on(puller.pull_into(addr, req, &mut into, deadline()))
        .expect("warm-up pull in place");
    let check_placed = |r: &KvReservation| {
        for (i, b) in blocks_data.iter().enumerate() {
            let want = block_checksum(i as u64, b);
            assert_eq!(r.block_checksum(i, i as u64), want, "block {i} differs");
        }
    };
    rt.block_on(tls_puller.pull_into(tls_addr, req, &mut into, deadline()))
        .expect("warm-up pull over TLS");
    check_placed(&into);
    let mut tls_placed = Duration::MAX;

    // Each transport row gets its own raw-socket samples, taken just before it, so that
    // both sides of each ratio are the best of the same number of runs.
    let (mut memcpy, mut raw, mut raw2, mut fresh, mut pooled, mut placed, mut fresh_placed) = (
        Duration::MAX,
        Duration::MAX,
        Duration::MAX,
        Duration::MAX,
        Duration::MAX,
        Duration::MAX,
        Duration::MAX,
    );
    for _ in 0..iters {
        let t = Instant::now();
        for (d, s) in dst.iter_mut().zip(blocks_data.iter()) {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&dst);
        memcpy = memcpy.min(t.elapsed());

        raw = raw.min(raw_peer.read(&mut dst));
        check(&dst.iter().map(Vec::as_slice).collect::<Vec<_>>());

        let t = Instant::now();
        let got = rt
            .block_on(puller.pull(addr, req, deadline()))
            .expect("pull");
        pooled = pooled.min(t.elapsed());
        check_buffers(&got);
        buffers.give_all(got);

        raw2 = raw2.min(raw_peer.read(&mut dst));
        let t = Instant::now();
        rt.block_on(puller.pull_into(addr, req, &mut into, deadline()))
            .expect("pull in place");
        placed = placed.min(t.elapsed());
        check_placed(&into);

        let t = Instant::now();
        rt.block_on(tls_puller.pull_into(tls_addr, req, &mut into, deadline()))
            .expect("pull in place over TLS");
        tls_placed = tls_placed.min(t.elapsed());
        check_placed(&into);

        let t = Instant::now();
        rt.block_on(KvPuller::new().pull_into(addr, req, &mut into, deadline()))
            .expect("pull in place over a new connection");
        fresh_placed = fresh_placed.min(t.elapsed());
        check_placed(&into);

        let t = Instant::now();
        let got = rt
            .block_on(pull_blocks(addr, req, deadline()))
            .expect("pull");
        fresh = fresh.min(t.elapsed());
        check_buffers(&got);
    }
    raw_peer.stop();
    rt.block_on(server.shutdown(Duration::from_secs(5)));
    rt.block_on(tls_server.shutdown(Duration::from_secs(5)));

    let row = |name: &str, d: Duration| {
        println!(
            "{name:<36} {:>8.1} ms {:>7.2} GB/s",
            d.as_secs_f64() * 1e3,
            gbps(bytes, d)
        );
    };
    row("memcpy (baseline)", memcpy);
    row("raw TCP socket (baseline)", raw.min(raw2));
    row("pd-transport, pooled into buffers", pooled);
    row("pd-transport, in place (decode node)", placed);
    row("pd-transport, new conn + buffers", fresh);
    row("pd-transport, new conn, in place", fresh_placed);
    row("pd-transport over mTLS, in place", tls_placed);
    row("(checksums at lease time, once)", checksum_time);
    row("(lease copy into fresh buffers)", copy_time);
    println!(
        "pd-transport in place / raw socket: {:.2}   into buffers / raw socket: {:.2}   new \
         conn / raw socket: {:.2} (in place {:.2})   buffers / memcpy: {:.2}",
        raw2.as_secs_f64() / placed.as_secs_f64(),
        raw.as_secs_f64() / pooled.as_secs_f64(),
        raw.as_secs_f64() / fresh.as_secs_f64(),
        raw2.as_secs_f64() / fresh_placed.as_secs_f64(),
        memcpy.as_secs_f64() / pooled.as_secs_f64()
    );
    println!(
        "pd-transport over mTLS / plaintext, in place, pooled connection: {:.2}",
        placed.as_secs_f64() / tls_placed.as_secs_f64()
    );
}

/// A cluster CA and member certificate in `dir`, as both ends of a KV pull use them.
fn mtls_settings(dir: &std::path::Path) -> pd_tls::TlsSettings {
    use pd_tls::certs::{ClusterCa, write_file};
    let ca = ClusterCa::new("bench CA").expect("CA");
    let member = ca.issue_member(&[]).expect("member");
    let [ca_path, cert, key] = ["ca.crt", "node.crt", "node.key"].map(|f| dir.join(f));
    write_file(&ca_path, ca.pem().cert.as_bytes(), false).expect("ca.crt");
    write_file(&cert, member.cert.as_bytes(), false).expect("node.crt");
    write_file(&key, member.key.as_bytes(), true).expect("node.key");
    pd_tls::TlsSettings {
        identity: Some(pd_tls::Identity { cert, key }),
        client_ca: Some(ca_path.clone()),
        ca: Some(ca_path),
        ..pd_tls::TlsSettings::default()
    }
}
