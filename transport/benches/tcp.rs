//! KV transfer throughput over loopback TCP, beside two baselines measured in the same run:
//! a raw socket (plain write / read of the same bytes into preallocated buffers, no framing,
//! no checksum, no copy out of the source) and memcpy of the same bytes.
//!
//! `cargo bench -p pd-transport --bench tcp`
//!
//! Environment: `PD_BENCH_BLOCKS` (default 256), `PD_BENCH_BLOCK_LEN` f32 values per block
//! (default 917504 = Qwen3-0.6B: 2 x 28 layers x 16 tokens x 8 KV heads x 128 dims, 3.67 MB),
//! `PD_BENCH_ITERS` (default 3; the best run is reported).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_transport::{
    KvExportServer, KvPuller, KvSource, LayoutFingerprint, PullRequest, pull_blocks,
};

struct MemSource(Arc<Vec<Vec<f32>>>);

impl KvSource for MemSource {
    fn read_blocks(&self, lease_id: u64, first: usize, count: usize) -> Option<Vec<Vec<f32>>> {
        (lease_id == 1)
            .then(|| {
                self.0
                    .get(first..first.checked_add(count)?)
                    .map(<[_]>::to_vec)
            })
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

fn best<F: FnMut() -> Duration>(iters: usize, mut f: F) -> Duration {
    (0..iters)
        .map(|_| f())
        .min()
        .expect("at least one iteration")
}

fn main() {
    let blocks = env("PD_BENCH_BLOCKS", 256);
    let block_len = env("PD_BENCH_BLOCK_LEN", 2 * 28 * 16 * 8 * 128);
    let iters = env("PD_BENCH_ITERS", 3).max(1);
    let bytes = (blocks * block_len * 4) as u64;
    println!(
        "{blocks} blocks x {:.2} MB = {:.1} MB per transfer, best of {iters}",
        block_len as f64 * 4.0 / 1e6,
        bytes as f64 / 1e6
    );

    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let source: Arc<Vec<Vec<f32>>> = Arc::new(
        (0..blocks)
            .map(|_| {
                (0..block_len)
                    .map(|_| {
                        state = state
                            .wrapping_mul(6_364_136_223_846_793_005)
                            .wrapping_add(1_442_695_040_888_963_407);
                        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                    })
                    .collect()
            })
            .collect(),
    );
    let mut dst: Vec<Vec<f32>> = vec![vec![0.0f32; block_len]; blocks];

    // memcpy baseline.
    let memcpy = best(iters, || {
        let t = Instant::now();
        for (d, s) in dst.iter_mut().zip(source.iter()) {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&dst);
        t.elapsed()
    });

    // Raw socket baseline: same bytes, preallocated destination.
    let raw = best(iters, || {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let src = Arc::clone(&source);
        let writer = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            for b in src.iter() {
                s.write_all(bytemuck::cast_slice(b)).expect("write");
            }
        });
        let mut s = TcpStream::connect(addr).expect("connect");
        let t = Instant::now();
        for d in dst.iter_mut() {
            s.read_exact(bytemuck::cast_slice_mut(d)).expect("read");
        }
        let e = t.elapsed();
        writer.join().expect("writer");
        e
    });
    assert!(dst.iter().zip(source.iter()).all(|(d, s)| d == s));
    drop(dst);

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
    let req = PullRequest {
        lease_id: 1,
        fingerprint: fp,
        first_block: 0,
        count: blocks,
        block_len,
    };
    let deadline = || Instant::now() + Duration::from_secs(600);
    let check = |got: &[Vec<f32>]| {
        assert_eq!(got.len(), blocks);
        assert!(
            got.iter().zip(source.iter()).all(|(g, s)| g == s),
            "data differs"
        );
    };

    let fresh = best(iters, || {
        let t = Instant::now();
        let got = rt
            .block_on(pull_blocks(addr, req, deadline()))
            .expect("pull");
        let e = t.elapsed();
        check(&got);
        e
    });
    let puller = KvPuller::new();
    rt.block_on(puller.pull(addr, req, deadline()))
        .expect("warm-up pull");
    let pooled = best(iters, || {
        let t = Instant::now();
        let got = rt
            .block_on(puller.pull(addr, req, deadline()))
            .expect("pull");
        let e = t.elapsed();
        check(&got);
        e
    });
    rt.block_on(server.shutdown(Duration::from_secs(5)));

    let row = |name: &str, d: Duration| {
        println!(
            "{name:<34} {:>8.1} ms {:>7.2} GB/s",
            d.as_secs_f64() * 1e3,
            gbps(bytes, d)
        );
    };
    row("memcpy (baseline)", memcpy);
    row("raw TCP socket (baseline)", raw);
    row("pd-transport, new connection", fresh);
    row("pd-transport, pooled connection", pooled);
    let t = fresh.min(pooled);
    println!(
        "pd-transport / raw socket: {:.2}   pd-transport / memcpy: {:.2}",
        raw.as_secs_f64() / t.as_secs_f64(),
        memcpy.as_secs_f64() / t.as_secs_f64()
    );
}
