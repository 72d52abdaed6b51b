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
//!   transport's reason; pull.rs), and the request runs on the engine with the pulled KV. Each
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
//! - `CacheEvents`: what enters and leaves this node's prefix cache (`pd_node::cache_events`).
//!
//! Start-up, health, reflection, the ready line and draining are shared with prefill-node
//! (crate `pd-node`); the response stream is [`DecodeStream`] (stream.rs).

mod peers;
mod pull;
mod stream;

pub use peers::{KvPeers, MAX_KV_PEERS};
pub use pull::{MAX_PULL_TIME, MIN_PULL_TIME, TransferCounts, TransferStats};
pub use stream::DecodeStream;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pd_engine::sampling::GuideCache;
use pd_engine::serve::{
    EngineRequest, EngineThread, LeaseSecret, RequestId, Role, validate_prompt,
};
use pd_node::cache_events::CacheEvents;
use pd_node::requests::forward_events;
use pd_node::{ModelFacts, NodeArgs, NodeMetrics, NodeServer, Ready, Requests};
use pd_proto::convert;
use pd_proto::pb;
use pd_proto::pb::decode_service_server::{DecodeService, DecodeServiceServer};
use pd_transport::{KvImporter, LayoutFingerprint};
use tonic::{Request, Response, Status};

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
    /// `CacheEvents` streams.
    cache_events: CacheEvents,
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

    type CacheEventsStream = pd_node::cache_events::CacheEventsStream;

    async fn cache_events(
        &self,
        _request: Request<pb::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        self.cache_events.subscribe().map(Response::new)
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
        cache_events: CacheEvents::new(Arc::clone(&requests)),
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

    /// The requests this node holds open (also those still pulling their KV).
    pub fn requests(&self) -> Arc<Requests> {
        Arc::clone(&self.server.requests)
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
