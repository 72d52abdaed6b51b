//! decode-node: pulls a prompt's KV from a prefill node and generates the rest with
//! continuous batching, streaming the tokens.
//!
//! `pd.v1.DecodeService`:
//! - `Decode`: the `KvHandle` must match this node's layout (fingerprint, which covers the KV
//!   cache's type since blocks travel as stored, and block size; otherwise
//!   FAILED_PRECONDITION naming both), the request is validated at the edge
//!   (INVALID_ARGUMENT), then only the blocks this node does not cache already are pulled from
//!   the prefill node's export server before a deadline (the lease's, at most
//!   [`MAX_PULL_TIME`]; over RDMA when both nodes run it (`--kv-transport rdma|auto`), a
//!   failed RDMA read retried once over TCP; a failed transfer is UNAVAILABLE with the
//!   transport's reason), and the request runs on the engine with the pulled KV. Each
//!   response carries the tokens generated since the previous one (one per engine step,
//!   several when they were already waiting); the last carries the finish reason and usage.
//!   A client that drops the stream aborts the request. Releasing the lease is the router's
//!   job (after the first message or a failure), not this node's.
//! - `Decode` **without** a `KvHandle` (the router's aggregated mode, no prefill nodes): this
//!   node computes the prompt itself (its own prefix cache, chunked prefill) and streams every
//!   token, the first included; `first_token` is ignored. The engine runs with role `Mixed`,
//!   which takes both kinds of request; the node still reports role decode.
//! - `SetKvPeers`: the router's set of prefill nodes' KV export addresses (peers.rs). A
//!   `Decode` whose `KvHandle` names another address is refused PERMISSION_DENIED before
//!   anything is resolved or dialed; before the first set, every `Decode` with a handle is
//!   UNAVAILABLE. The handle's lease secret goes with every pull (a malformed one is
//!   INVALID_ARGUMENT).
//! - `Abort`, `Info`.
//!
//! Start-up, health, reflection, the ready line and draining are shared with prefill-node
//! (crate `pd-node`); the response stream is [`DecodeStream`] (stream.rs).

mod peers;
mod stream;

pub use peers::{KvPeers, MAX_KV_PEERS};
pub use stream::DecodeStream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use pd_engine::kv::host_buffer::HostBuffer;
use pd_engine::kv::reservation::{DeviceReservation, ImportReservation, Landing, ReservedBlocks};
use pd_engine::sampling::GuideCache;
use pd_engine::serve::validate_prompt;
use pd_engine::serve::{
    EngineRequest, EngineThread, ImportedBlocks, ImportedKv, LeaseSecret, RequestId, Role,
};
use pd_node::requests::forward_events;
use pd_node::{ModelFacts, NodeArgs, NodeMetrics, NodeServer, Ready, Requests};
use pd_proto::convert;
use pd_proto::pb;
use pd_proto::pb::decode_service_server::{DecodeService, DecodeServiceServer};
use pd_transport::{KvImporter, LayoutFingerprint, PathUsed, PullRequest};
use tonic::{Request, Response, Status};

/// The longest a KV pull may take, whatever the lease's deadline.
pub const MAX_PULL_TIME: Duration = Duration::from_secs(5);
/// The shortest deadline a pull gets, so that clocks a little apart between the nodes do not
/// fail a pull the prefill node would still serve (it enforces the lease itself).
pub const MIN_PULL_TIME: Duration = Duration::from_millis(500);

/// The decode node's flags (each also from a `PD_...` environment variable).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "decode-node",
    version,
    about = "PD cluster decode node: pulls prompts' KV from prefill nodes and generates the rest"
)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub node: NodeArgs,
}

/// Cumulative KV-transfer counters of a decode node.
#[derive(Debug, Default)]
pub struct TransferStats {
    pulls_ok: AtomicU64,
    pulls_failed: AtomicU64,
    blocks_pulled: AtomicU64,
    bytes_pulled: AtomicU64,
    /// Blocks not pulled because this node cached them already.
    blocks_cached: AtomicU64,
}

/// A snapshot of [`TransferStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferCounts {
    pub pulls_ok: u64,
    pub pulls_failed: u64,
    pub blocks_pulled: u64,
    pub bytes_pulled: u64,
    pub blocks_cached: u64,
}

impl TransferStats {
    pub fn snapshot(&self) -> TransferCounts {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TransferCounts {
            pulls_ok: r(&self.pulls_ok),
            pulls_failed: r(&self.pulls_failed),
            blocks_pulled: r(&self.blocks_pulled),
            bytes_pulled: r(&self.bytes_pulled),
            blocks_cached: r(&self.blocks_cached),
        }
    }
}

/// A decode request checked against this node: the engine request (KV not pulled yet) and
/// where the KV lies (none: the prompt is computed here).
struct ValidDecode {
    request: EngineRequest,
    first_token: u32,
    kv: Option<(pb::KvHandle, LeaseSecret)>,
}

/// `pd.v1.DecodeService` over an engine of role `Decode`.
#[derive(Debug)]
struct DecodeNodeService {
    requests: Arc<Requests>,
    facts: ModelFacts,
    /// Pulls over RDMA where both nodes can (`--kv-transport`), over TCP otherwise or after
    /// an RDMA failure.
    importer: KvImporter,
    stats: Arc<TransferStats>,
    metrics: Arc<NodeMetrics>,
    guides: Arc<GuideCache>,
    /// The prefill nodes this node may pull from (`SetKvPeers`).
    peers: Arc<KvPeers>,
}

impl DecodeNodeService {
    fn validate(&self, req: pb::DecodeRequest) -> Result<ValidDecode, Status> {
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument(
                "request_id is required (the router's id for this request)",
            ));
        }
        let f = &self.facts;
        let resumed = req.resumed_tokens as usize;
        if resumed > 0 && resumed >= req.prompt_token_ids.len() {
            return Err(Status::invalid_argument(format!(
                "resumed_tokens ({resumed}) must be less than the length of prompt_token_ids ({})",
                req.prompt_token_ids.len()
            )));
        }
        // Resumed tokens are output: they take their share of max_tokens, not of the prompt.
        validate_prompt(
            &req.prompt_token_ids,
            f.vocab_size,
            f.max_model_len,
            req.max_tokens.saturating_sub(req.resumed_tokens),
        )
        .map_err(|e| convert::status(e.kind(), e.to_string()))?;
        let params = convert::sampling_params(
            req.sampling.as_ref(),
            req.max_tokens,
            vec![],
            req.stop_token_ids,
            req.ignore_eos,
            // Text is the router's: stop strings and special tokens' text do not reach nodes.
            false,
            true,
        );
        params
            .validate(f.vocab_size, f.max_model_len as u32)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let kv = match req.kv {
            Some(kv) => {
                let secret = self.validate_kv(&kv, &req.prompt_token_ids, req.first_token)?;
                Some((kv, secret))
            }
            None => None,
        };
        Ok(ValidDecode {
            request: EngineRequest {
                id: RequestId(req.request_id),
                prompt: req.prompt_token_ids,
                params,
                cache_salt: req.cache_salt,
                imported: None,
                lease_kv: false,
                guide: None,
                resumed,
            },
            first_token: req.first_token,
            kv,
        })
    }

    /// A KV handle fits this node's layout and the prompt it comes with, and names a prefill
    /// node this node knows; returns its lease secret.
    fn validate_kv(
        &self,
        kv: &pb::KvHandle,
        prompt: &[u32],
        first_token: u32,
    ) -> Result<LeaseSecret, Status> {
        let secret = convert::lease_secret("kv.lease_secret", &kv.lease_secret)?;
        let f = &self.facts;
        let theirs: LayoutFingerprint = kv
            .layout_fingerprint
            .parse()
            .map_err(|e| Status::invalid_argument(format!("kv.layout_fingerprint: {e}")))?;
        if theirs != f.fingerprint || kv.block_size as usize != f.block_size() {
            return Err(Status::failed_precondition(format!(
                "KV layout mismatch: the prefill node's KV has layout fingerprint {theirs} with \
                 block size {}, this decode node ({}) has {} with block size {}; run both nodes \
                 with the same --model (and dtype), --block-size and --kv-cache-dtype",
                kv.block_size,
                f.served_name,
                f.fingerprint,
                f.block_size()
            )));
        }
        if kv.block_bytes != f.block_bytes() as u64 {
            return Err(Status::failed_precondition(format!(
                "KV layout mismatch: the prefill node's blocks have {} bytes, this node's {}",
                kv.block_bytes,
                f.block_bytes()
            )));
        }
        if first_token as usize >= f.vocab_size {
            return Err(Status::invalid_argument(format!(
                "first_token {first_token} is outside the vocabulary (size {})",
                f.vocab_size
            )));
        }
        let prompt_len = prompt.len();
        let blocks = prompt_len.div_ceil(f.block_size());
        if kv.num_tokens as usize != prompt_len || kv.num_blocks as usize != blocks {
            return Err(Status::invalid_argument(format!(
                "the KvHandle covers {} tokens in {} blocks; the prompt has {prompt_len} tokens \
                 in {blocks} blocks: send the prompt the prefill node computed",
                kv.num_tokens, kv.num_blocks
            )));
        }
        // Last, and before anything is resolved or dialed.
        self.peers.check(&kv.addr)?;
        Ok(secret)
    }

    /// Pull the blocks of the prompt this node does not cache, as the engine's imported KV:
    /// into blocks the engine reserves for them where its pool has room (in place where its
    /// KV is in host memory; on a GPU into buffers this task then copies into the reserved
    /// device blocks, so the engine thread copies nothing), else into buffers: placed in
    /// blocks reserved after the pull if the pool has room by then, or else copied in by the
    /// engine at admission.
    async fn pull(
        &self,
        req: &EngineRequest,
        kv: &pb::KvHandle,
        lease_secret: LeaseSecret,
        first_token: u32,
    ) -> Result<ImportedKv, Status> {
        let addr = resolve(&kv.addr).await?;
        // An RDMA offer is followed only to the known prefill node's host.
        let rdma = peers::rdma_offer_on_peer(&kv.addr, &kv.rdma);
        let engine = self.requests.engine().clone();
        let (prompt, salt) = (req.prompt.clone(), req.cache_salt.clone());
        let total = req.prompt.len().div_ceil(self.facts.block_size());
        let (cached, reservation) = tokio::task::spawn_blocking(move || {
            match engine.reserve_import(prompt.clone(), salt.clone()) {
                Some(r) => (r.first_block(), Some(r)),
                None => (engine.cached_prefix_blocks(prompt, salt), None),
            }
        })
        .await
        .map_err(|e| Status::internal(format!("prefix lookup task failed: {e}")))?;
        // The block holding the last prompt token is never cached here; keep at least it.
        let first_block = cached.min(total - 1);
        let count = total - first_block;
        let pull = PullRequest {
            lease_id: kv.lease_id,
            lease_secret,
            fingerprint: self.facts.fingerprint,
            first_block,
            count,
            block_bytes: self.facts.block_bytes(),
        };
        let started = Instant::now();
        let deadline = started + pull_budget(kv.lease_deadline_unix_ms, SystemTime::now());
        // Where the imported KV starts: `first_block`, or a later block where KV pulled into
        // buffers lands in blocks reserved after the pull and more is cached here by then.
        let mut first_placed = first_block;
        let pulled = match reservation {
            Some(ImportReservation::Host(mut into)) => self
                .importer
                .pull_into(addr, rdma, pull, &mut into, deadline)
                .await
                .map(|path| (ImportedBlocks::Placed(into.filled()), path)),
            Some(ImportReservation::Device(into)) => {
                match self.importer.pull(addr, rdma, pull, deadline).await {
                    Ok((buffers, path)) => {
                        let placed = self.write_in(into, buffers).await?;
                        Ok((ImportedBlocks::Placed(placed), path))
                    }
                    Err(e) => Err(e),
                }
            }
            None => match self.importer.pull(addr, rdma, pull, deadline).await {
                Ok((buffers, path)) => {
                    let (first, blocks) = self.place_pulled(req, first_block, buffers).await?;
                    first_placed = first;
                    Ok((blocks, path))
                }
                Err(e) => Err(e),
            },
        };
        match pulled {
            Ok((blocks, path)) => {
                let s = &self.stats;
                s.pulls_ok.fetch_add(1, Ordering::Relaxed);
                s.blocks_pulled.fetch_add(count as u64, Ordering::Relaxed);
                s.bytes_pulled
                    .fetch_add(pull.payload_bytes().unwrap_or(0), Ordering::Relaxed);
                s.blocks_cached
                    .fetch_add(first_block as u64, Ordering::Relaxed);
                tracing::debug!(
                    request_id = %req.id,
                    %addr,
                    lease_id = kv.lease_id,
                    cached_blocks = first_block,
                    pulled_blocks = count,
                    landing = match &blocks {
                        ImportedBlocks::Placed(r) => match r.landing() {
                            Landing::HostInPlace => "in place",
                            Landing::DeviceCopy => "copied into reserved device blocks",
                            Landing::HostCopy => "copied into blocks reserved after the pull",
                        },
                        ImportedBlocks::Buffers(_) => "buffers",
                    },
                    path = match path {
                        PathUsed::Rdma => "rdma",
                        PathUsed::Tcp => "tcp",
                        PathUsed::TcpAfterRdmaFailure => "tcp after rdma failure",
                    },
                    elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                    "KV pulled"
                );
                Ok(ImportedKv {
                    first_block: first_placed,
                    blocks,
                    first_token,
                })
            }
            Err(e) => {
                self.stats.pulls_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    request_id = %req.id,
                    %addr,
                    lease_id = kv.lease_id,
                    reason = %e.reason(),
                    error = %e,
                    "KV pull failed"
                );
                Err(pd_proto::failure::FailureCause::KvPull.status(
                    tonic::Code::Unavailable,
                    format!(
                        "pulling the prompt's KV ({count} blocks of lease {}) from the prefill \
                         node at {addr} failed [{}]: {e}",
                        kv.lease_id,
                        e.reason()
                    ),
                ))
            }
        }
    }

    /// KV pulled into buffers because the pool had no room when the pull began: into
    /// blocks reserved now if it has room by then, copied on a blocking thread
    /// ([`pd_engine::serve::EngineHandle::place_pulled`]), else left in the buffers.
    async fn place_pulled(
        &self,
        req: &EngineRequest,
        first_block: usize,
        buffers: Vec<HostBuffer>,
    ) -> Result<(usize, ImportedBlocks), Status> {
        let engine = self.requests.engine().clone();
        let (prompt, salt) = (req.prompt.clone(), req.cache_salt.clone());
        tokio::task::spawn_blocking(move || engine.place_pulled(prompt, salt, first_block, buffers))
            .await
            .map_err(|e| Status::internal(format!("placing the pulled KV failed: {e}")))
    }

    /// Copy pulled blocks into the device blocks reserved for them (the backend's import
    /// stream), on a blocking thread since the copy waits for the device, then give the
    /// buffers back for the next import.
    async fn write_in(
        &self,
        into: DeviceReservation,
        buffers: Vec<HostBuffer>,
    ) -> Result<ReservedBlocks, Status> {
        let engine = self.requests.engine().clone();
        tokio::task::spawn_blocking(move || {
            let placed = into.write(&buffers);
            engine.import_buffers().give_all(buffers);
            placed
        })
        .await
        .map_err(|e| {
            Status::internal(format!(
                "copying the pulled KV into device memory failed: {e}"
            ))
        })
    }
}

/// How long a pull may take: until the lease's deadline (by this node's clock), within
/// [`MIN_PULL_TIME`, `MAX_PULL_TIME`]; an unset deadline (0) gets the maximum.
fn pull_budget(lease_deadline_unix_ms: u64, now: SystemTime) -> Duration {
    if lease_deadline_unix_ms == 0 {
        return MAX_PULL_TIME;
    }
    let deadline = UNIX_EPOCH + Duration::from_millis(lease_deadline_unix_ms);
    deadline
        .duration_since(now)
        .unwrap_or(Duration::ZERO)
        .clamp(MIN_PULL_TIME, MAX_PULL_TIME)
}

/// `host:port` of a KV export server.
async fn resolve(addr: &str) -> Result<SocketAddr, Status> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    if addr
        .rsplit_once(':')
        .is_none_or(|(_, port)| port.parse::<u16>().is_err())
    {
        return Err(Status::invalid_argument(format!(
            "kv.addr {addr:?} is not host:port"
        )));
    }
    let found = tokio::time::timeout(MAX_PULL_TIME, tokio::net::lookup_host(addr)).await;
    match found {
        Ok(Ok(mut addrs)) => addrs
            .next()
            .ok_or_else(|| Status::unavailable(format!("kv.addr {addr:?} resolves to no address"))),
        Ok(Err(e)) => Err(Status::unavailable(format!(
            "cannot resolve kv.addr {addr:?}: {e}"
        ))),
        Err(_) => Err(Status::unavailable(format!(
            "resolving kv.addr {addr:?} timed out"
        ))),
    }
}

#[tonic::async_trait]
impl DecodeService for DecodeNodeService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let ValidDecode {
            mut request,
            first_token,
            kv,
        } = self.validate(request.into_inner())?;
        // Dropped before the end (the call cancelled, the stream dropped): aborts the request.
        let guard = self.requests.begin(&request.id)?;
        request.guide = pd_node::guide::compile(&self.guides, &request.params).await?;
        if let Some((kv, secret)) = &kv {
            let imported = self.pull(&request, kv, *secret, first_token).await?;
            if guard.is_aborted() {
                return Err(Status::aborted(format!(
                    "request {} was aborted while its KV was pulled",
                    request.id
                )));
            }
            request.imported = Some(imported);
        }
        let events = forward_events(guard.submit(request));
        Ok(Response::new(DecodeStream::new(
            events,
            guard,
            Arc::clone(&self.metrics),
        )))
    }

    async fn abort(
        &self,
        request: Request<pb::NodeAbortRequest>,
    ) -> Result<Response<pb::NodeAbortResponse>, Status> {
        let id = request.into_inner().request_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        let aborted = self.requests.abort(&RequestId(id));
        Ok(Response::new(pb::NodeAbortResponse { aborted }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        Ok(Response::new(pd_node::info::node_info(
            &self.facts,
            &self.requests,
            Role::Decode,
            None,
            &self.metrics,
        )))
    }

    async fn set_kv_peers(
        &self,
        request: Request<pb::SetKvPeersRequest>,
    ) -> Result<Response<pb::SetKvPeersResponse>, Status> {
        let addrs = request.into_inner().kv_addrs;
        let n = self.peers.set(&addrs)?;
        tracing::info!(peers = ?addrs, "prefill nodes to pull KV from set");
        Ok(Response::new(pb::SetKvPeersResponse {
            num_peers: u32::try_from(n).unwrap_or(u32::MAX),
        }))
    }
}

/// A started decode node: model loaded, engine running, listener bound; not serving until
/// [`DecodeNode::run`].
#[derive(Debug)]
pub struct DecodeNode {
    ready: Ready,
    server: NodeServer,
    engine: EngineThread,
    stats: Arc<TransferStats>,
}

/// Load the model, start the engine and bind the gRPC listener.
pub async fn start(args: DecodeArgs) -> anyhow::Result<DecodeNode> {
    // `Mixed` takes requests with imported KV and, in the router's aggregated mode, requests
    // whose prompt is computed here. It holds no leases; the timeout is unused.
    // Before the model loads: unusable TLS flags or files, a non-loopback bind without mTLS,
    // and `--kv-transport rdma` without a device fail at once.
    let tls = pd_node::tls::NodeTls::load(&args.node)?;
    let rdma = pd_node::kv_transport::open_rdma(&args.node)?;
    let started = pd_node::start_engine(&args.node, Role::Mixed, Duration::from_secs(30)).await?;
    let (facts, engine) = (started.facts, started.thread);
    let (listener, grpc) =
        pd_node::server::bind(&args.node.host, args.node.port, "gRPC server").await?;
    let (metrics_listener, metrics_addr) =
        pd_node::server::bind(&args.node.host, args.node.metrics_port, "metrics server").await?;
    // Pulls land in place in blocks the engine reserves where its KV is host memory (and
    // RDMA reads too, once the reader registered that memory). Otherwise blocks arrive in
    // the engine's recycled buffers: it gives each back once the block is in KV storage, so
    // steady pulls do not fault in fresh pages.
    let importer = pd_node::kv_transport::importer(
        rdma.as_ref(),
        engine.handle().host_kv_memory().cloned(),
        facts.fingerprint,
        &args.node,
        tls.dial_grpc.clone(),
    )?
    .with_buffers(engine.handle().import_buffers().clone())
    .with_tls(tls.dial_kv.clone());
    let metrics = Arc::new(NodeMetrics::new(
        Role::Decode,
        &facts,
        engine.handle(),
        Arc::clone(importer.stats()),
        started.histograms,
    ));
    let requests = Requests::new(engine.handle(), args.node.max_open_requests());
    let stats = Arc::new(TransferStats::default());
    let ready = Ready {
        role: Role::Decode,
        grpc,
        kv: None,
        metrics_addr,
        model: facts.served_name.clone(),
        fingerprint: facts.fingerprint.to_string(),
    };
    let service = DecodeNodeService {
        requests: Arc::clone(&requests),
        facts,
        importer,
        stats: Arc::clone(&stats),
        metrics: Arc::clone(&metrics),
        guides: started.guides,
        peers: Arc::default(),
    };
    let server = NodeServer {
        listener,
        metrics_listener,
        metrics,
        routes: tonic::service::Routes::new(DecodeServiceServer::new(service)),
        service_name: <DecodeServiceServer<DecodeNodeService> as tonic::server::NamedService>::NAME,
        requests,
        drain_timeout: args.node.drain_timeout,
        also_idle: Box::new(|| true),
        tls,
    };
    Ok(DecodeNode {
        ready,
        server,
        engine,
        stats,
    })
}

impl DecodeNode {
    /// What the ready line says (address, model, fingerprint).
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// This node's KV-transfer counters (they keep counting while it runs).
    pub fn transfer_stats(&self) -> Arc<TransferStats> {
        Arc::clone(&self.stats)
    }

    /// Serve until `shutdown` resolves, drain, then stop the engine.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let DecodeNode { server, engine, .. } = self;
        let result = server.run(shutdown).await;
        // Joining the engine thread waits for its current step: off the async workers.
        let _ = tokio::task::spawn_blocking(move || drop(engine)).await;
        result
    }
}

impl pd_node::server::StartedNode for DecodeNode {
    fn ready(&self) -> &Ready {
        DecodeNode::ready(self)
    }

    fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> impl Future<Output = anyhow::Result<()>> + Send {
        DecodeNode::run(self, shutdown)
    }
}

/// Start, print the ready line, serve until `shutdown`, drain and stop
/// ([`pd_node::server::serve`]).
pub async fn serve(
    args: DecodeArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    pd_node::server::serve(start(args), shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_budget_follows_the_lease_within_bounds() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let ms = |d: Duration| (now + d).duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        assert_eq!(
            pull_budget(ms(Duration::from_secs(2)), now),
            Duration::from_secs(2)
        );
        assert_eq!(pull_budget(ms(Duration::from_secs(60)), now), MAX_PULL_TIME);
        assert_eq!(pull_budget(ms(Duration::ZERO) - 10_000, now), MIN_PULL_TIME);
        assert_eq!(pull_budget(0, now), MAX_PULL_TIME);
    }
}
