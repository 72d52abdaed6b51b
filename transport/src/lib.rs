//! pd-transport: moving KV blocks from a prefill node to a decode node.
//!
//! # Model: one-sided reads, like RDMA
//!
//! The contract is shaped so that an ibverbs backend maps onto it directly:
//!
//! | this crate                                   | RDMA                                        |
//! |----------------------------------------------|---------------------------------------------|
//! | [`KvSource`] on the exporter (prefill node)  | registered memory region(s)                 |
//! | a lease id and secret (the prefill `KvHandle`) | the region's remote key, valid until released or expired |
//! | [`PullRequest`]: first block, count, length  | a batch of (region, offset, length) descriptors |
//! | one pull = one request, one packed response | one batch of RDMA READs, one completion     |
//! | the `async` pull completing                  | polling the completion queue               |
//! | [`LayoutFingerprint`] checked on both sides  | checked in the control plane before the read |
//!
//! The exporting side registers nothing per transfer: it answers reads of whatever its
//! [`KvSource`] holds under a lease (the engine's `EngineHandle::lease_blocks`) and never
//! pushes. Releasing the lease after the pull stays with the control plane (gRPC). The importer
//! asks for a contiguous run of a lease's blocks (the blocks it does not cache), all packed into
//! one response: per-operation cost dominates below ~256 KiB, so a pull is one request and
//! one streamed response, not a message per block.
//!
//! # TCP backend
//!
//! - Export: [`KvExportServer::bind`] listens (port 0 gives an ephemeral port; the real
//!   address is returned) and serves many connections, many pulls per connection. Blocks are
//!   lent by the source ([`SharedBlocks`]: the lease store's memory, no copy) in batches of
//!   ~32 MiB, each block sent with the checksum computed when its lease was made, so the
//!   exporter neither copies nor hashes. [`KvExportServer::shutdown`] stops gracefully.
//! - Import: [`pull_blocks`] (one connection per pull) or [`KvPuller::pull`] (connections
//!   reused per exporter; blocks land in the decode engine's recycled buffers). Every pull has a deadline, sent to the exporter too so it stops
//!   working for an importer that gave up.
//! - Sealed leases: every pull presents the lease's secret; an unknown lease, a wrong secret
//!   and a range outside the lease get one refusal that says nothing about the exporter (no
//!   fingerprint, block length or count; [`wire`] documents it).
//! - Checks on every pull: the exporter refuses a wrong fingerprint before sending any KV
//!   (once the lease is authenticated);
//!   the importer verifies the echoed fingerprint, lease, block range, block length, every
//!   chunk length and every block's xxh3-64 checksum (`pd_engine::kv::handoff::checksum`), and a
//!   short stream is a
//!   [`TransportError::Length`]. Failures are typed ([`TransportError`]) with a stable
//!   metric label ([`TransportError::reason`], a [`FailureReason`]).
//! - Counters for the node's metrics ([`TransferStats`]: bytes, latency histogram, failures
//!   by reason) are kept by the puller ([`KvPuller::stats`]) and the export server
//!   ([`KvExportServer::transfer_stats`]).
//! - Bytes go straight between the sockets and KV memory or block buffers, as the KV cache
//!   stores them (f32, f16 or bf16: part of the layout fingerprint), with no per-value
//!   conversion. The wire carries them little-endian, so big-endian hosts are refused at
//!   compile time.
//!
//! The wire format is documented in [`wire`].
//!
//! # RDMA backend
//!
//! [`rdma`]: one-sided RDMA READs of registered lease regions (cargo feature `rdma`; the
//! pure parts, such as endpoint encoding, read planning, the in-flight window and path
//! selection, are built and tested in every build). [`KvImporter`] picks the path per
//! transfer and retries a failed RDMA read once over TCP, counted in
//! [`TransferCounts::failovers`].
//!
//! # Wiring
//!
//! ```no_run
//! # async fn demo(handle: pd_engine::serve::EngineHandle, layout: pd_engine::kv::KvLayout)
//! # -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use pd_transport::{KvExportServer, KvPuller, LayoutFingerprint, PullRequest};
//!
//! let fp = LayoutFingerprint::new(&layout, "Qwen/Qwen3-0.6B|bf16");
//! // Prefill node:
//! let (server, addr) = KvExportServer::bind("0.0.0.0:0".parse()?, fp, Arc::new(handle)).await?;
//! // Decode node (lease id and secret from the KvHandle, first block and count from the
//! // local cache):
//! let puller = KvPuller::new();
//! let lease_secret = pd_engine::serve::LeaseSecret::from_bytes([7; 16]);
//! let req = PullRequest { lease_id: 7, lease_secret, fingerprint: fp, first_block: 0,
//!                         count: 4, block_bytes: layout.block_bytes() };
//! let blocks = puller.pull(addr, req, Instant::now() + Duration::from_secs(5)).await?;
//! # drop(blocks); server.shutdown(Duration::from_secs(5)).await; Ok(()) }
//! ```

#[cfg(target_endian = "big")]
compile_error!("pd-transport sends KV as little-endian bytes; big-endian hosts are not supported");

mod chunks;
mod client;
mod error;
mod fingerprint;
mod importer;
pub mod rdma;
mod server;
mod stats;
pub mod wire;

pub use client::{KvPuller, PullRequest, pull_blocks, read_pull_reply};
pub use error::TransportError;
pub use fingerprint::{LayoutFingerprint, ParseFingerprintError};
pub use importer::{KvImporter, OneSidedReader, PathUsed};
pub use server::{ExportConfig, ExportStats, KvExportServer, KvSource, SharedBlocks};
pub use stats::{FailureReason, TRANSFER_SECONDS_BUCKETS, TransferCounts, TransferStats};
