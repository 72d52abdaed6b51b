//! RDMA: the decode node reads a lease's KV blocks from the prefill node with one-sided
//! RDMA READs over a reliable-connected (RC) queue pair.
//!
//! # Why `sideway` (and not the `ibverbs` crate)
//!
//! The backend is built on `sideway` 0.4.3, behind the `rdma` cargo feature:
//! - it loads libibverbs at run time (`rdma-mummy-sys`), so a binary built with `rdma`
//!   starts on a host without rdma-core and `--kv-transport auto` falls back to TCP there;
//!   a binary built on `ibverbs` 0.9 links libibverbs.so.1 and does not start at all
//!   (exit 127) on such a host (the GPU test host is one);
//! - it exposes what this design needs and `ibverbs` 0.9.2 does not: posting RDMA READ work
//!   requests, choosing the HCA port and the send PSN (`ibverbs` hard-codes port 1 and PSN 0
//!   and offers SEND/RECV only), and objects owned through `Arc` instead of borrowed
//!   lifetimes, so queue pairs can live in long-lived per-peer state;
//! - errors are values; `ibverbs` 0.9 panics in `Drop` when a destroy call fails.
//!
//! The build needs cmake and libclang (bindgen), not libibverbs-dev (`scripts/rdma-check.sh`).
//! No sideway type leaves this module: errors become [`RdmaError`] text, endpoints and
//! offers are this crate's own types with their own encodings.
//!
//! # Data path
//!
//! - **Device** ([`RdmaDevice`]): `--rdma-device` (or the first device with an active port),
//!   `--rdma-port` (or the first active port), `--rdma-gid-index` (or: 0 on InfiniBand, the
//!   first RoCE v2 IPv4 GID on Ethernet, else the first non-zero GID); one protection domain.
//! - **Export** ([`RdmaExporter`], prefill node): where the engine's KV is host memory (the
//!   CPU backend), the exporter offers each lease **in place**, registering for remote read
//!   the lease's blocks alone when the lease is made: one region per KV memory segment (one
//!   per layer's K and V) and run of adjacent blocks ([`LeaseRegions`]), deregistered at
//!   release or expiry. The [`RdmaOffer`] names those regions and where each leased block
//!   lies in them (a strided offer); nothing is copied, no rkey of it reaches another
//!   lease's blocks, and the exporter holds the lease, so its blocks stay unwritten and
//!   allocated, until release or expiry. Otherwise (GPU KV: GPUDirect registration is not implemented;
//!   a failed registration) each lease is **staged**: its blocks back to back in a buffer
//!   registered for that lease alone (a packed offer; a GPU node's lease, which the engine
//!   copied out of device memory into one buffer, is registered as it is, other blocks are
//!   copied into one), deregistered at release or expiry. Either way the `KvHandle` carries the offer: the port's fabric, the RdmaConnect
//!   address, the regions (address, length, rkey), the layout and a checksum per block. The
//!   exporter logs which mode it uses.
//! - **Connect**: per pair of nodes, the decode node creates an RC queue pair and calls the
//!   prefill node's `PrefillService.RdmaConnect` with its [`QpEndpoint`] (LID/GID, QPN, PSN,
//!   port, MTU) and the id and secret of the live lease it is about to read (a caller
//!   without one gets no queue pair); the prefill node creates its queue pair (remote read allowed), moves it to
//!   RTR/RTS against the decode node's endpoint and answers with its own; the decode node then
//!   moves its queue pair to RTR/RTS. The connection is kept for later transfers and dropped
//!   after any error.
//! - **Read** ([`RdmaReader`], decode node): the blocks it lacks are planned into READs
//!   ([`plan_reads`]: at most 4 MiB each; a packed offer's bytes coalesced, a strided
//!   offer's pieces joined where the prefill node keeps blocks side by side), posted with at most 16 in flight
//!   ([`ReadWindow`]), completions polled on a blocking thread until done or the deadline;
//!   then every block is checked against the offer's checksum. Where the engine's KV lives
//!   in host memory (the CPU backend), the reader registers that memory once and the READs
//!   land in place in the blocks the engine reserved for the pull: [`scatter`] maps each
//!   READ onto the blocks' per-layer segments (splitting READs at the device's
//!   scatter/gather limit). Otherwise (GPU KV, no reservation, a failed registration) they
//!   land in a registered host buffer whose blocks are then copied into the engine's.
//! - **Teardown**: on a failure, a missed deadline or an abandoned pull the queue pair is
//!   destroyed before the memory READs land in is freed or given back (no DMA can then
//!   touch it); regions are deregistered before their memory is freed; dropping the device
//!   closes everything in dependency order.
//!
//! # Selection and failover
//!
//! [`select`] decides (pure, tested): whether RDMA starts, and per transfer whether it is
//! used; [`crate::KvImporter`] retries a failed RDMA read once over TCP and counts it.

mod descriptor;
mod endpoint;
mod error;
pub mod lease_regions;
mod plan;
pub mod scatter;
pub mod select;
mod window;

#[cfg(not(feature = "rdma"))]
mod absent;
#[cfg(feature = "rdma")]
mod verbs;

#[cfg(not(feature = "rdma"))]
use absent as imp;
#[cfg(feature = "rdma")]
use verbs as imp;

use std::future::Future;
use std::pin::Pin;

pub use descriptor::{
    BLOCK_SEED, BlockRun, ExportMode, MAX_OFFER_REGIONS, OfferLayout, RdmaOffer, RemoteRegion,
    block_checksum,
};
pub use endpoint::{EndpointError, Fabric, LinkLayer, PathMtu, QpEndpoint};
pub use error::{RdmaError, RdmaStartError};
pub use imp::{RdmaDevice, RdmaExporter, RdmaReader};
pub use lease_regions::LeaseRegions;
pub use plan::{DEFAULT_MAX_OP_BYTES, PlanError, ReadOp, plan_reads};
pub use select::{KvTransportMode, start_rdma};
pub use window::{CompletionError, DEFAULT_MAX_IN_FLIGHT, ReadWindow};

use pd_engine::serve::LeaseSecret;

use crate::LayoutFingerprint;

/// Whether this build has the RDMA backend (the types of a build without it are in
/// `absent.rs`; `pd_kernels::BUILT` says the same of the CUDA backend).
pub const BUILT: bool = cfg!(feature = "rdma");

/// `--rdma-device`, `--rdma-port`, `--rdma-gid-index` and the read tuning.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// Device name (`mlx5_0`, `rxe0`); `None`: the first with an active port.
    pub device: Option<String>,
    /// HCA port (1-based); `None`: the device's first active port.
    pub port: Option<u8>,
    /// GID table index; `None`: chosen as described in the module docs.
    pub gid_index: Option<u32>,
    /// Largest READ.
    pub max_op_bytes: u32,
    /// Outstanding READs per queue pair.
    pub max_in_flight: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: None,
            gid_index: None,
            max_op_bytes: DEFAULT_MAX_OP_BYTES,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }
}

/// A boxed future (the control-plane call is made by the node, over gRPC).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The endpoint exchange over the control plane: the decode node's half of
/// `PrefillService.RdmaConnect`, implemented by the node with its gRPC client.
pub trait RdmaConnector: Send + Sync + std::fmt::Debug {
    /// Send this node's encoded [`QpEndpoint`] to the prefill node whose gRPC server is at
    /// `addr`, with the id and secret of the lease about to be read there (the prefill node
    /// connects only a holder of a live lease); its encoded endpoint, or why not.
    fn connect(
        &self,
        addr: String,
        fingerprint: LayoutFingerprint,
        endpoint: Vec<u8>,
        lease: (u64, LeaseSecret),
    ) -> BoxFuture<'static, Result<Vec<u8>, String>>;
}
