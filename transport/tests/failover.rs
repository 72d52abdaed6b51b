//! Path selection and failover of [`KvImporter`] against a real TCP export server: an RDMA
//! read that fails is retried once over TCP and counted; without an offer, a device or a
//! common fabric the pull goes straight to TCP. The one-sided reader here is a test double
//! (no RDMA hardware on the build machines): one that always fails, and one that executes
//! the read plan against in-process memory, to check the RDMA path's accounting.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::kv::handoff::host_buffer::HostBuffer;
use pd_engine::serve::LeaseSecret;
use pd_transport::rdma::{
    BoxFuture, Fabric, LinkLayer, OfferLayout, RdmaError, RdmaOffer, RemoteRegion, block_checksum,
    plan_reads,
};
use pd_transport::{
    FailureReason, KvExportServer, KvImporter, LayoutFingerprint, OneSidedReader, PathUsed,
    PullRequest, TransportError,
};

use crate::support::OneLease;

const FP: LayoutFingerprint = LayoutFingerprint(0x0123_4567_89ab_cdef);
const LEASE: u64 = 9;
/// Bytes per block.
const BLOCK_BYTES: usize = 4096;

fn blocks(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|b| {
            (0..BLOCK_BYTES / 4)
                .flat_map(|i| ((b * 10_000 + i) as u32).to_le_bytes())
                .collect()
        })
        .collect()
}

fn fabric(subnet: u8) -> Fabric {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[7] = subnet;
    gid[15] = 1;
    Fabric {
        link_layer: LinkLayer::InfiniBand,
        lid: 5,
        gid,
    }
}

/// The offer a prefill node would publish for `blocks`, registered at a made-up address.
fn offer_for(blocks: &[Vec<u8>]) -> (RdmaOffer, Vec<u8>) {
    let bytes: Vec<u8> = blocks.concat();
    let block_bytes = BLOCK_BYTES as u64;
    let offer = RdmaOffer {
        fabric: fabric(1),
        connect_addr: "10.0.0.1:50051".into(),
        block_bytes,
        regions: vec![RemoteRegion {
            addr: 0x7f00_0000_0000,
            len: bytes.len() as u64,
            rkey: 77,
        }],
        layout: OfferLayout::Packed,
        checksums: bytes
            .chunks(block_bytes as usize)
            .enumerate()
            .map(|(i, b)| block_checksum(i as u64, b))
            .collect(),
    };
    (offer, bytes)
}

/// Fails every read; counts the attempts.
#[derive(Debug, Default)]
struct Failing {
    calls: AtomicUsize,
}

impl OneSidedReader for Failing {
    fn fabric(&self) -> Fabric {
        fabric(1)
    }
    fn read<'a>(
        &'a self,
        _offer: &'a RdmaOffer,
        _req: PullRequest,
        _buffers: Option<&'a BlockBuffers>,
        _deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<HostBuffer>, RdmaError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {
            Err(RdmaError::Completion {
                op: 0,
                status: "RetryExceededError".into(),
                remote_access: false,
            })
        })
    }
}

/// Executes the read plan against the "exporter's" memory, then checks the checksums, as the
/// RDMA backend does after its READs complete.
#[derive(Debug)]
struct InProcess {
    memory: HashMap<u32, (u64, Vec<u8>)>,
}

impl OneSidedReader for InProcess {
    fn fabric(&self) -> Fabric {
        fabric(1)
    }
    fn read<'a>(
        &'a self,
        offer: &'a RdmaOffer,
        req: PullRequest,
        _buffers: Option<&'a BlockBuffers>,
        _deadline: Instant,
    ) -> BoxFuture<'a, Result<Vec<HostBuffer>, RdmaError>> {
        Box::pin(async move {
            let ops = plan_reads(offer, req.first_block as u64, req.count as u64, 4096)?;
            let mut landed = vec![0u8; req.count * req.block_bytes];
            for op in ops {
                let (base, bytes) = &self.memory[&op.rkey];
                let at = (op.remote_addr - base) as usize;
                let to = op.local_offset as usize;
                landed[to..to + op.len as usize].copy_from_slice(&bytes[at..at + op.len as usize]);
            }
            landed
                .chunks(req.block_bytes)
                .enumerate()
                .map(|(i, b)| {
                    let index = (req.first_block + i) as u64;
                    if offer.checksums[index as usize] != block_checksum(index, b) {
                        return Err(RdmaError::Checksum { block: index });
                    }
                    Ok(Box::new(b.to_vec()) as HostBuffer)
                })
                .collect()
        })
    }
}

async fn server(n: usize) -> (KvExportServer, std::net::SocketAddr, Vec<Vec<u8>>) {
    let data = blocks(n);
    let (server, addr) = KvExportServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        FP,
        OneLease::new(LEASE, None, data.clone()),
    )
    .await
    .unwrap();
    (server, addr, data)
}

fn request(lease_id: u64, first: usize, count: usize) -> PullRequest {
    PullRequest {
        lease_id,
        lease_secret: LeaseSecret::from_bytes([9; 16]),
        fingerprint: FP,
        first_block: first,
        count,
        block_bytes: BLOCK_BYTES,
    }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[tokio::test]
async fn a_failed_rdma_read_is_retried_once_over_tcp_and_counted() {
    let (server, addr, data) = server(6).await;
    let (offer, _) = offer_for(&data);
    let reader = Arc::new(Failing::default());
    let importer = KvImporter::with_rdma(reader.clone());
    let (got, path) = importer
        .pull(addr, &offer.encode(), request(LEASE, 2, 4), deadline())
        .await
        .unwrap();
    assert_eq!(path, PathUsed::TcpAfterRdmaFailure);
    assert_eq!(owned(&got), data[2..6].to_vec());
    assert_eq!(reader.calls.load(Ordering::SeqCst), 1);
    let c = importer.stats().snapshot();
    assert_eq!((c.failovers, c.transfers), (1, 1));
    assert_eq!(c.bytes, 4 * BLOCK_BYTES as u64);
    assert_eq!(c.failures.iter().map(|(_, n)| n).sum::<u64>(), 0);
    server.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn when_the_tcp_retry_fails_too_the_pull_fails_with_the_tcp_error() {
    let (server, addr, data) = server(3).await;
    let (offer, _) = offer_for(&data);
    let importer = KvImporter::with_rdma(Arc::new(Failing::default()));
    let err = importer
        .pull(addr, &offer.encode(), request(LEASE + 1, 0, 3), deadline())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::UnknownLease { .. }), "{err}");
    let c = importer.stats().snapshot();
    assert_eq!((c.failovers, c.transfers), (1, 0));
    let gone = c
        .failures
        .iter()
        .find(|(r, _)| *r == FailureReason::LeaseGone);
    assert_eq!(gone, Some(&(FailureReason::LeaseGone, 1)));
    server.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn without_an_offer_or_a_common_fabric_the_pull_goes_straight_to_tcp() {
    let (server, addr, data) = server(3).await;
    let reader = Arc::new(Failing::default());
    let importer = KvImporter::with_rdma(reader.clone());
    let (got, path) = importer
        .pull(addr, &[], request(LEASE, 0, 3), deadline())
        .await
        .unwrap();
    assert_eq!((path, owned(&got)), (PathUsed::Tcp, data.clone()));
    let (mut offer, _) = offer_for(&data);
    offer.fabric = fabric(2); // another InfiniBand subnet
    let (_, path) = importer
        .pull(addr, &offer.encode(), request(LEASE, 0, 3), deadline())
        .await
        .unwrap();
    assert_eq!(path, PathUsed::Tcp);
    let (_, path) = importer
        .pull(addr, b"not an offer", request(LEASE, 0, 3), deadline())
        .await
        .unwrap();
    assert_eq!(path, PathUsed::Tcp);
    assert_eq!(reader.calls.load(Ordering::SeqCst), 0, "RDMA never tried");
    assert_eq!(importer.stats().snapshot().failovers, 0);
    // A node without RDMA ignores offers.
    let (offer, _) = offer_for(&data);
    let tcp = KvImporter::tcp_only();
    let (_, path) = tcp
        .pull(addr, &offer.encode(), request(LEASE, 0, 3), deadline())
        .await
        .unwrap();
    assert_eq!(path, PathUsed::Tcp);
    server.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn an_rdma_read_is_counted_once_and_never_touches_tcp() {
    let (server, addr, data) = server(5).await;
    let (offer, bytes) = offer_for(&data);
    let memory = HashMap::from([(77, (offer.regions[0].addr, bytes))]);
    let importer = KvImporter::with_rdma(Arc::new(InProcess { memory }));
    let (got, path) = importer
        .pull(addr, &offer.encode(), request(LEASE, 1, 3), deadline())
        .await
        .unwrap();
    assert_eq!((path, owned(&got)), (PathUsed::Rdma, data[1..4].to_vec()));
    let c = importer.stats().snapshot();
    assert_eq!((c.transfers, c.failovers), (1, 0));
    assert_eq!(c.bytes, 3 * BLOCK_BYTES as u64);
    assert_eq!(server.stats().connections, 0, "TCP not used");
    server.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_checksum_mismatch_on_rdma_fails_over_to_tcp() {
    let (server, addr, data) = server(2).await;
    let (offer, mut bytes) = offer_for(&data);
    bytes[5] ^= 1; // the region holds something else than what was published
    let memory = HashMap::from([(77, (offer.regions[0].addr, bytes))]);
    let importer = KvImporter::with_rdma(Arc::new(InProcess { memory }));
    let (got, path) = importer
        .pull(addr, &offer.encode(), request(LEASE, 0, 2), deadline())
        .await
        .unwrap();
    assert_eq!((path, owned(&got)), (PathUsed::TcpAfterRdmaFailure, data));
    assert_eq!(importer.stats().snapshot().failovers, 1);
    server.shutdown(Duration::from_secs(1)).await;
}

/// The pulled blocks' bytes, to compare with what was exported.
fn owned(blocks: &[HostBuffer]) -> Vec<Vec<u8>> {
    blocks.iter().map(|b| b.as_bytes().to_vec()).collect()
}
