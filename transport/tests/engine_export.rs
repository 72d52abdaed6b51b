//! The real export path: a prefill engine thread serves its lease through
//! `impl KvSource for EngineHandle`, a decode engine imports the pulled KV, and the greedy
//! tokens equal one mixed engine's. Uses the engine's tiny transformers-golden checkpoint.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::backend::cpu::CpuBackend;
use pd_engine::config::ModelConfig;
use pd_engine::kv::KvLayout;
use pd_engine::kv::handoff::reservation::ImportReservation;
use pd_engine::serve::{
    Engine, EngineConfig, EngineHandle, EngineRequest, EngineThread, ImportedBlocks, ImportedKv,
    KvLease, RequestEvent, Role,
};
use pd_engine::weights::DType;
use pd_test_support::engine::{self as support, run};
use pd_transport::{KvExportServer, KvPuller, LayoutFingerprint, PullRequest, TransportError};

const BS: usize = 4;

/// An engine of `role` whose KV cache stores `kv`.
fn engine(role: Role, kv: DType) -> (Engine<CpuBackend>, KvLayout) {
    let exec = support::executor(CpuBackend::with_kv_dtype(kv), BS, 64);
    let mc = ModelConfig::from_file(&support::tiny_gqa().join("config.json")).unwrap();
    let layout = KvLayout::new(&mc, BS, kv).unwrap();
    assert_eq!(exec.layout(), &layout);
    let cfg = EngineConfig {
        lease_timeout: Duration::from_secs(60),
        ..support::config(role)
    };
    (support::engine(exec, cfg), layout)
}

fn request(id: &str, prompt: Vec<u32>, imported: Option<ImportedKv>) -> EngineRequest {
    EngineRequest {
        imported,
        ..support::request(id, prompt, 8, true)
    }
}

/// A prefill engine thread behind a real export server, and the lease of one prefill of
/// `prompt` on it.
struct Leased {
    _prefill: EngineThread,
    handle: EngineHandle,
    server: KvExportServer,
    addr: std::net::SocketAddr,
    first_token: u32,
    lease: KvLease,
}

async fn leased(prompt: &[u32], fp: LayoutFingerprint, kv: DType) -> Leased {
    let (prefill, _) = engine(Role::Prefill, kv);
    let prefill = EngineThread::spawn(prefill);
    let handle = prefill.handle();
    let (server, addr) =
        KvExportServer::bind("127.0.0.1:0".parse().unwrap(), fp, Arc::new(handle.clone()))
            .await
            .unwrap();
    let rx = handle.submit(request("p", prompt.to_vec(), None));
    let (first_token, lease) = tokio::task::spawn_blocking(move || {
        let mut first = None;
        loop {
            match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
                RequestEvent::Token(t) => first = Some(t.token_id),
                RequestEvent::Finished(f) => break (first.unwrap(), f.lease.unwrap()),
                RequestEvent::Failed(e) => panic!("{e}"),
                RequestEvent::PromptLogprobs(_) => {}
            }
        }
    })
    .await
    .unwrap();
    Leased {
        _prefill: prefill,
        handle,
        server,
        addr,
        first_token,
        lease,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_pulled_over_tcp_from_an_engine_lease_decodes_like_one_mixed_engine() {
    let prompt: Vec<u32> = (0..23u32).map(|i| (i * 37 + 11) % 390).collect();
    let (mut mixed, layout) = engine(Role::Mixed, DType::F32);
    let want = run(&mut mixed, request("m", prompt.clone(), None));

    let fp = LayoutFingerprint::new(&layout, "tiny-gqa|f32");
    let Leased {
        _prefill,
        handle,
        server,
        addr,
        first_token,
        lease,
    } = leased(&prompt, fp, DType::F32).await;

    // As a decode node does: blocks arrive in the decode engine's recycled buffers.
    let (mut decode, _) = engine(Role::Decode, DType::F32);
    let buffers = decode.import_buffers();
    let puller = KvPuller::with_buffers(buffers.clone());
    let block_bytes = layout.block_bytes();
    let pull = |first_block, count, fingerprint| {
        puller.pull(
            addr,
            PullRequest {
                lease_id: lease.lease_id,
                lease_secret: lease.secret,
                fingerprint,
                first_block,
                count,
                block_bytes,
            },
            Instant::now() + Duration::from_secs(30),
        )
    };
    // Another model's fingerprint is refused.
    let other = LayoutFingerprint::new(&layout, "tiny-gqa|bf16");
    let err = pull(0, lease.blocks.len(), other).await.unwrap_err();
    assert!(
        matches!(err, TransportError::FingerprintMismatch { .. }),
        "{err}"
    );
    // Past the lease's end: unknown.
    let err = pull(1, lease.blocks.len(), fp).await.unwrap_err();
    assert!(matches!(err, TransportError::UnknownLease { .. }), "{err}");

    let blocks = pull(0, lease.blocks.len(), fp).await.unwrap();
    assert_eq!(blocks.len(), 6, "23 tokens in blocks of 4");
    assert!(handle.release_lease(lease.lease_id, lease.secret));
    let err = pull(0, 1, fp).await.unwrap_err();
    assert!(
        matches!(err, TransportError::UnknownLease { .. }),
        "released: {err}"
    );

    let imported = ImportedKv {
        first_block: 0,
        blocks: ImportedBlocks::Buffers(blocks),
        first_token,
    };
    let mut got = vec![first_token];
    got.extend(run(&mut decode, request("d", prompt, Some(imported))));
    assert_eq!(
        got, want,
        "prefill -> TCP -> decode equals one mixed engine"
    );
    assert_eq!(
        buffers.spare(),
        6,
        "the decode engine gives the pulled blocks' buffers back once they are in KV storage"
    );
    server.shutdown(Duration::from_secs(5)).await;
    assert_eq!(handle.counters().kv_cache_usage, 0.0);
}

/// As a decode node on host memory does: the decode engine reserves the blocks it lacks and
/// the pull lands in them in place; the tokens equal one mixed engine's with the same KV
/// cache type, and a pull whose reservation does not fit is refused before anything is sent.
/// A 16-bit cache's blocks travel as stored: half the bytes of an f32 cache's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_pulled_in_place_over_tcp_decodes_like_one_mixed_engine_in_every_cache_type() {
    let f32_bytes = pulled_in_place_decodes_like_one_mixed_engine(DType::F32).await;
    for kv in [DType::F16, DType::BF16] {
        let bytes = pulled_in_place_decodes_like_one_mixed_engine(kv).await;
        assert_eq!(2 * bytes, f32_bytes, "{kv:?}");
    }
}

/// One pull in place with a `kv` cache on both sides; the bytes it moved.
async fn pulled_in_place_decodes_like_one_mixed_engine(kv: DType) -> u64 {
    let prompt: Vec<u32> = (0..23u32).map(|i| (i * 41 + 5) % 390).collect();
    let (mut mixed, layout) = engine(Role::Mixed, kv);
    let want = run(&mut mixed, request("m", prompt.clone(), None));

    let fp = LayoutFingerprint::new(&layout, "tiny-gqa|f32");
    let Leased {
        _prefill,
        handle,
        server,
        addr,
        first_token,
        lease,
    } = leased(&prompt, fp, kv).await;

    let (mut decode, _) = engine(Role::Decode, kv);
    let released = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = released.clone();
    let Some(ImportReservation::Host(mut into)) = decode.reserve_import(
        &prompt,
        None,
        Arc::new(move |id| log.lock().unwrap().push(id)),
    ) else {
        panic!("host KV memory with room: a reservation in place");
    };
    assert_eq!((into.first_block(), into.len()), (0, 6));
    let puller = KvPuller::new();
    let req = |count| PullRequest {
        lease_id: lease.lease_id,
        lease_secret: lease.secret,
        fingerprint: fp,
        first_block: 0,
        count,
        block_bytes: layout.block_bytes(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let err = puller
        .pull_into(addr, req(5), &mut into, deadline)
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Length(_)), "{err}");
    assert_eq!(puller.stats().snapshot().transfers, 0, "nothing was sent");
    assert_eq!(puller.idle_connections(addr), 0, "no connection was made");
    puller
        .pull_into(addr, req(6), &mut into, deadline)
        .await
        .unwrap();
    let moved = puller.stats().snapshot().bytes;
    assert_eq!(moved, 6 * layout.block_bytes() as u64, "{kv:?}");
    assert!(handle.release_lease(lease.lease_id, lease.secret));

    let imported = ImportedKv {
        first_block: 0,
        blocks: ImportedBlocks::Placed(into.filled()),
        first_token,
    };
    let mut got = vec![first_token];
    got.extend(run(&mut decode, request("d", prompt, Some(imported))));
    assert_eq!(
        got, want,
        "prefill -> TCP in place -> decode equals one mixed engine ({kv:?} KV)"
    );
    assert!(
        released.lock().unwrap().is_empty(),
        "admitted, nothing to give back"
    );
    assert_eq!(decode.reservations_held(), 0);
    server.shutdown(Duration::from_secs(5)).await;
    moved
}
