//! RDMA transfer benchmark between two hosts, with the production exporter and reader
//! (`scripts/rdma-check.sh --fabric` runs it next to `ib_read_bw`).
//!
//! ```text
//! rdma_bench serve [--listen 0.0.0.0:18600] [--advertise HOST:18600] [--mib 1024]
//!                  [--block-kib 3584] [--export in-place|staged] [--regions 56]
//!                  [--device D] [--port P] [--gid-index G]
//! rdma_bench read --peer HOST:18600 [--sizes 65536,1048576,4194304] [--iters 20]
//!                 [--landing in-place|buffers] [--regions 56]
//!                 [--device D] [--port P] [--gid-index G]
//! ```
//!
//! `serve` registers one lease of `--mib` MiB in blocks of `--block-kib` KiB and answers a
//! tiny TCP control protocol (the offer, and the queue-pair exchange that the nodes do over
//! gRPC). `--export in-place` (the default: a prefill node with host-memory KV) pins the
//! lease in KV memory laid out as the CPU backend's (`--regions` per block), registered
//! once, and offers it where it lies (a strided offer: the reader's READs follow the
//! regions); `--export staged` (a prefill node with GPU KV) offers a packed copy. `read` reads the whole lease `--iters` times with READs of each size and prints
//! one JSON line per size: `{"size": S, "bytes": B, "seconds": T, "gbit_per_s": X}`.
//! The time covers what a decode node's pull costs. `--landing in-place` (the default: a
//! decode node with host-memory KV, the CPU backend): READs scatter each block straight into
//! reserved KV memory laid out as the CPU backend's (`--regions`, default 56 = 28 layers x K
//! and V), registered once before the timing, plus the per-block checksums.
//! `--landing buffers` (a decode node with GPU KV): landing-buffer registration, the READs,
//! the checksums and the copy into per-block buffers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::placement::{HostKvMemory, KvReservation, ReservationId};
use pd_engine::serve::LeasedKv;
use pd_transport::rdma::{
    BoxFuture, RdmaConfig, RdmaConnector, RdmaDevice, RdmaExporter, RdmaOffer, RdmaReader,
};
use pd_transport::{LayoutFingerprint, OneSidedReader, PullRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LEASE: u64 = 1;
const FP: LayoutFingerprint = LayoutFingerprint(0x00be_9c4e_0000_0001);

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn flags(args: &[String]) -> HashMap<String, String> {
    args.chunks(2)
        .filter_map(|kv| {
            Some((
                kv[0].trim_start_matches("--").to_string(),
                kv.get(1)?.clone(),
            ))
        })
        .collect()
}

fn config(f: &HashMap<String, String>) -> Result<RdmaConfig> {
    Ok(RdmaConfig {
        device: f.get("device").cloned(),
        port: f.get("port").map(|p| p.parse()).transpose()?,
        gid_index: f.get("gid-index").map(|g| g.parse()).transpose()?,
        ..Default::default()
    })
}

/// `blocks` blocks of `block_bytes` in host memory laid out as the CPU backend's KV, in
/// `regions` regions per block (`--regions`).
fn kv_memory(blocks: usize, block_bytes: usize, regions: usize) -> Result<HostKvMemory> {
    HostKvMemory::allocate(blocks, block_bytes, regions).ok_or_else(|| {
        format!("--regions {regions} does not divide a block of {block_bytes} bytes").into()
    })
}

async fn send_frame(s: &mut TcpStream, bytes: &[u8]) -> Result<()> {
    s.write_u32_le(u32::try_from(bytes.len())?).await?;
    s.write_all(bytes).await?;
    Ok(())
}

async fn recv_frame(s: &mut TcpStream) -> Result<Vec<u8>> {
    let len = s.read_u32_le().await? as usize;
    if len > 64 << 20 {
        return Err("control frame too long".into());
    }
    let mut b = vec![0; len];
    s.read_exact(&mut b).await?;
    Ok(b)
}

async fn serve(f: HashMap<String, String>) -> Result<()> {
    let listen = f
        .get("listen")
        .map_or("0.0.0.0:18600", String::as_str)
        .to_string();
    let advertise = f
        .get("advertise")
        .cloned()
        .unwrap_or_else(|| listen.clone());
    let mib: usize = f.get("mib").map_or(Ok(1024), |m| m.parse())?;
    let block_kib: usize = f.get("block-kib").map_or(Ok(3584), |b| b.parse())?;
    let in_place = match f.get("export").map_or("in-place", String::as_str) {
        "in-place" => true,
        "staged" => false,
        other => return Err(format!("--export {other:?}: in-place or staged").into()),
    };
    let regions: usize = f.get("regions").map_or(Ok(56), |r| r.parse())?;
    let device = RdmaDevice::open(&config(&f)?)?;
    let block_bytes = block_kib * 1024;
    let count = (mib * 1024 / block_kib).max(1);
    let exporter = RdmaExporter::new(&device, advertise)?;
    let (exporter, kv) = if in_place {
        let memory = kv_memory(count, block_bytes, regions)?;
        let exporter = exporter.with_host_kv(Some(memory.clone()));
        if !exporter.in_place() {
            return Err("registering the KV memory failed (raise `ulimit -l`?); \
                        --export staged measures the other path"
                .into());
        }
        // SAFETY: nothing else references the freshly allocated memory; it stays unwritten.
        let kv = unsafe { LeasedKv::in_place(memory, (0..count as u32).collect()) };
        (exporter, kv)
    } else {
        let blocks: Vec<Vec<u8>> = (0..count)
            .map(|b| (0..block_bytes).map(|i| (b * 7 + i) as u8).collect())
            .collect();
        (exporter, LeasedKv::new(blocks))
    };
    let exporter = Arc::new(exporter);
    let kv = Arc::new(kv);
    let (offer, mode) =
        exporter.publish(LEASE, &kv, Instant::now() + Duration::from_secs(86_400))?;
    eprintln!("lease exported {}", mode.as_str());
    drop(kv);
    let listener = TcpListener::bind(&listen).await?;
    eprintln!(
        "serving {count} blocks of {block_kib} KiB on {listen} ({})",
        device.describe()
    );
    loop {
        let (mut s, peer) = listener.accept().await?;
        let (exporter, offer) = (Arc::clone(&exporter), offer.clone());
        tokio::spawn(async move {
            let result: Result<()> = async {
                match s.read_u8().await? {
                    b'O' => send_frame(&mut s, &offer).await,
                    b'C' => {
                        let endpoint = recv_frame(&mut s).await?;
                        let answer = exporter.accept(&endpoint)?;
                        send_frame(&mut s, &answer).await
                    }
                    op => Err(format!("unknown op {op}").into()),
                }
            }
            .await;
            if let Err(e) = result {
                eprintln!("{peer}: {e}");
            }
        });
    }
}

/// The queue-pair exchange over the benchmark's TCP control connection.
#[derive(Debug)]
struct TcpConnector;

impl RdmaConnector for TcpConnector {
    fn connect(
        &self,
        addr: String,
        _fingerprint: LayoutFingerprint,
        endpoint: Vec<u8>,
        _lease: (u64, pd_engine::serve::LeaseSecret),
    ) -> BoxFuture<'static, std::result::Result<Vec<u8>, String>> {
        Box::pin(async move {
            let exchange = async {
                let mut s = TcpStream::connect(&addr).await?;
                s.write_u8(b'C').await?;
                send_frame(&mut s, &endpoint).await?;
                recv_frame(&mut s).await
            };
            exchange
                .await
                .map_err(|e: Box<dyn std::error::Error + Send + Sync>| e.to_string())
        })
    }
}

async fn read(f: HashMap<String, String>) -> Result<()> {
    let peer = f.get("peer").ok_or("--peer HOST:PORT is required")?.clone();
    let sizes: Vec<u32> = f
        .get("sizes")
        .map_or("65536,1048576,4194304", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    let iters: u32 = f.get("iters").map_or(Ok(20), |i| i.parse())?;
    let in_place = match f.get("landing").map_or("in-place", String::as_str) {
        "in-place" => true,
        "buffers" => false,
        other => return Err(format!("--landing {other:?}: in-place or buffers").into()),
    };
    let regions: usize = f.get("regions").map_or(Ok(56), |r| r.parse())?;
    let mut s = TcpStream::connect(&peer).await?;
    s.write_u8(b'O').await?;
    let offer = RdmaOffer::decode(&recv_frame(&mut s).await?)?;
    let device = RdmaDevice::open(&config(&f)?)?;
    let req = PullRequest {
        lease_id: LEASE,
        lease_secret: pd_engine::serve::LeaseSecret::from_bytes([0; 16]),
        fingerprint: FP,
        first_block: 0,
        count: offer.num_blocks() as usize,
        block_bytes: offer.block_bytes as usize,
    };
    let bytes = offer.num_blocks() * offer.block_bytes;
    for size in sizes {
        let config = RdmaConfig {
            max_op_bytes: size,
            ..config(&f)?
        };
        let reader = RdmaReader::new(&device, Arc::new(TcpConnector), FP, &config)?;
        let deadline = || Instant::now() + Duration::from_secs(60);
        if in_place {
            let memory = kv_memory(req.count, req.block_bytes, regions)?;
            let reader = reader.with_host_kv(Some(memory.clone()));
            if !reader.lands_in_place() {
                return Err("registering the KV memory failed (raise `ulimit -l`?); \
                            --landing buffers measures the other path"
                    .into());
            }
            let ids: Vec<u32> = (0..req.count as u32).collect();
            let mut into = KvReservation::new(ReservationId(1), 0, &ids, memory, Arc::new(|_| {}));
            // One warm-up read: connection set-up is not part of the figure.
            reader.read_into(&offer, req, &mut into, deadline()).await?;
            let started = Instant::now();
            for _ in 0..iters {
                reader.read_into(&offer, req, &mut into, deadline()).await?;
            }
            report(
                size,
                bytes * u64::from(iters),
                started.elapsed().as_secs_f64(),
            );
            continue;
        }
        // Into recycled buffers, as a decode node's engine gives them back: the warm-up read
        // (connection set-up is not part of the figure) leaves them warm.
        let buffers = BlockBuffers::new(req.block_bytes, bytes as usize);
        let warm = reader.read(&offer, req, Some(&buffers), deadline()).await?;
        buffers.give_all(warm);
        let started = Instant::now();
        for _ in 0..iters {
            let got = reader.read(&offer, req, Some(&buffers), deadline()).await?;
            buffers.give_all(got);
        }
        report(
            size,
            bytes * u64::from(iters),
            started.elapsed().as_secs_f64(),
        );
    }
    Ok(())
}

/// One JSON line per operation size.
fn report(size: u32, total: u64, seconds: f64) {
    println!(
        "{{\"size\": {size}, \"bytes\": {total}, \"seconds\": {seconds:.6}, \"gbit_per_s\": {:.3}}}",
        total as f64 * 8.0 / seconds / 1e9
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((mode, rest)) = args.split_first() else {
        return Err("usage: rdma_bench serve|read [--flag value ...]".into());
    };
    match mode.as_str() {
        "serve" => serve(flags(rest)).await,
        "read" => read(flags(rest)).await,
        other => Err(format!("unknown mode {other:?}: serve or read").into()),
    }
}
