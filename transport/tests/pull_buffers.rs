//! Where a TCP pull gets the buffers its blocks arrive in: the decode engine's spares first,
//! new ones from its allocator on a blocking thread. A GPU node's allocator page-locks memory
//! (milliseconds per block while the pool is cold); on a runtime thread it would stall every
//! other stream that thread serves.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::host_buffer::heap_buffer;
use pd_engine::serve::LeaseSecret;
use pd_transport::{ExportConfig, KvExportServer, KvPuller, LayoutFingerprint, PullRequest};

use crate::support::OneLease;

const FP: LayoutFingerprint = LayoutFingerprint(0x5eed_f1a7_0000_0002);
const LEASE: u64 = 7;
const BLOCK: usize = 4096;

fn blocks(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| vec![i as u8 + 1; BLOCK]).collect()
}

fn pull(count: usize) -> PullRequest {
    PullRequest {
        lease_id: LEASE,
        lease_secret: LeaseSecret::from_bytes([7; 16]),
        fingerprint: FP,
        first_block: 0,
        count,
        block_bytes: BLOCK,
    }
}

/// On a one-thread runtime, the allocator asks a task of that runtime to answer before it
/// returns. Were the buffers allocated on the runtime's thread, the task could not run until
/// the allocator gave up waiting, and the pull would record that it starved the runtime.
#[tokio::test(flavor = "current_thread")]
async fn new_buffers_are_allocated_off_the_runtime_thread() {
    let exported = blocks(5);
    let source = OneLease::new(LEASE, None, exported.clone());
    let (server, addr) = KvExportServer::bind_with(
        "127.0.0.1:0".parse().unwrap(),
        FP,
        source,
        ExportConfig::default(),
    )
    .await
    .unwrap();

    // Pings from the allocator, answered by a task on this runtime.
    let (ping_tx, mut ping_rx) = tokio::sync::mpsc::unbounded_channel::<mpsc::Sender<()>>();
    let answerer = tokio::spawn(async move {
        while let Some(reply) = ping_rx.recv().await {
            let _ = reply.send(());
        }
    });
    let starved = Arc::new(AtomicUsize::new(0));
    let allocations = Arc::new(AtomicUsize::new(0));
    let ping_tx = Mutex::new(ping_tx);
    let (s, a) = (Arc::clone(&starved), Arc::clone(&allocations));
    let pool = BlockBuffers::with_allocator(
        BLOCK,
        64 * BLOCK,
        Arc::new(move |len| {
            a.fetch_add(1, Ordering::SeqCst);
            let (reply_tx, reply_rx) = mpsc::channel();
            ping_tx.lock().unwrap().send(reply_tx).unwrap();
            if reply_rx.recv_timeout(Duration::from_secs(20)).is_err() {
                s.fetch_add(1, Ordering::SeqCst);
            }
            heap_buffer(len)
        }),
    );
    // Two spares (not from the allocator): the pull takes them and allocates three more.
    pool.give_all([heap_buffer(BLOCK), heap_buffer(BLOCK)]);
    let puller = KvPuller::with_buffers(pool.clone());

    let got = puller
        .pull(addr, pull(5), Instant::now() + Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        allocations.load(Ordering::SeqCst),
        3,
        "spares are used before new buffers are made"
    );
    assert_eq!(
        starved.load(Ordering::SeqCst),
        0,
        "a buffer was allocated on the runtime's thread"
    );
    assert_eq!(got.len(), 5);
    for (g, want) in got.iter().zip(&exported) {
        assert_eq!(g.as_bytes(), &want[..]);
    }

    answerer.abort();
    server.shutdown(Duration::from_secs(5)).await;
}
