//! prefill-node: computes a prompt's KV cache and its first token, then leases the KV blocks
//! to a decode node, which pulls them from this node's KV export server.
//!
//! `pd.v1.PrefillService`:
//! - `Prefill`: the request is validated at the edge (INVALID_ARGUMENT with a message a
//!   person can act on), run with `max_tokens = 1` on an engine of role `Prefill` (which stops
//!   after the first token and keeps the prompt's blocks under a lease), and answered with the
//!   first token, usage (this node's prefix-cache hits) and a `KvHandle` naming the export
//!   server, the layout fingerprint and the lease. A request with `skip_kv_lease` (it ends
//!   with its first token) gets no lease and no `KvHandle`: nothing is held, copied or hashed
//!   for a pull that never comes. A call the client cancels aborts the engine request.
//! - `ReleaseKv`: frees a lease (the router calls it once the decode node pulled, or gave
//!   up); a lease nobody releases expires after `--kv-lease-timeout`. Only with the lease's
//!   secret: a wrong one releases nothing and answers `released=false`, as for an unknown id.
//!
//! Leases are sealed: each has a random id and a 128-bit secret (made by the engine from the
//! operating system's randomness), both in the `KvHandle`; the export server serves a pull,
//! and RDMA offers are made, for that pair only (`pd_transport::wire`).
//! - `RdmaConnect`: a decode node connects an RDMA queue pair to this node's (endpoint
//!   exchange). With `--kv-transport rdma|auto` and a device, every lease's blocks are also
//!   registered for one-sided RDMA reads and the `KvHandle` carries the offer
//!   (`pd_transport::rdma`; this node's side in rdma.rs); the TCP export server runs in every
//!   mode.
//! - `Abort`, `Info`.
//! - `CacheEvents`: what enters and leaves this node's prefix cache (`pd_node::cache_events`).
//!
//! Start-up, health, reflection, the ready line and draining are shared with decode-node
//! (crate `pd-node`). The drain also waits for leases handed out to be released or to
//! expire, so that decode nodes can finish pulling (leases.rs).

mod leases;
mod rdma;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use pd_engine::sampling::{GuideCache, PromptLogprob, SampledToken};
use pd_engine::serve::validate_prompt;
use pd_engine::serve::{
    EngineHandle, EngineRequest, EngineThread, Finished, RequestError, RequestEvent, RequestId,
    Role,
};
use pd_node::args::parse_seconds;
use pd_node::cache_events::CacheEvents;
use pd_node::requests::{engine_gone, engine_status};
use pd_node::{ModelFacts, NodeArgs, NodeMetrics, NodeServer, Ready, Requests};
use pd_proto::convert;
use pd_proto::pb;
use pd_proto::pb::prefill_service_server::{PrefillService, PrefillServiceServer};
use pd_transport::rdma::RdmaExporter;
use pd_transport::{ExportConfig, KvExportServer};
use tonic::{Request, Response, Status};

use leases::{LeaseGuard, Leases};

/// How long the KV export server lets transfers in flight finish once the node has drained.
const EXPORT_STOP_GRACE: Duration = Duration::from_secs(2);

/// The prefill node's flags (each also from a `PD_...` environment variable).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "prefill-node",
    version,
    about = "PD cluster prefill node: computes prompts' KV and first tokens, leases the KV to decode nodes"
)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub node: NodeArgs,
    /// Port of the KV export server decode nodes pull from (0: an ephemeral port, printed in
    /// the ready line).
    #[arg(
        long,
        env = "PD_KV_PORT",
        default_value_t = 0,
        help_heading = "KV transfer"
    )]
    pub kv_port: u16,
    /// Seconds a prompt's KV stays leased for a decode node to pull, unless released sooner.
    #[arg(long, env = "PD_KV_LEASE_TIMEOUT", value_name = "SECONDS", default_value = "30",
          value_parser = parse_seconds, help_heading = "KV transfer")]
    pub kv_lease_timeout: Duration,
}

/// How a prefill ended.
enum Outcome {
    /// The first token, the prompt's logprobs (empty unless asked for), the engine's result,
    /// and the lease (guarded until handed out; `None` when the request asked for none).
    Prefilled {
        first_token: SampledToken,
        prompt_logprobs: Vec<PromptLogprob>,
        finished: Box<Finished>,
        lease: Option<Box<LeaseGuard>>,
    },
    Aborted,
    Failed(RequestError),
    /// The engine's channel closed without a terminal event.
    EngineGone,
}

/// Wait (blocking) for the prefill's first token and terminal event; `lease_kv`: whether the
/// request asked for a lease.
fn collect(engine: EngineHandle, rx: mpsc::Receiver<RequestEvent>, lease_kv: bool) -> Outcome {
    let mut first_token = None;
    let mut prompt_logprobs = Vec::new();
    loop {
        match rx.recv() {
            Ok(RequestEvent::PromptLogprobs(scores)) => prompt_logprobs = scores,
            Ok(RequestEvent::Token(t)) => {
                first_token.get_or_insert(t);
            }
            Ok(RequestEvent::Finished(mut finished)) => {
                let lease = finished.lease.take().map(|l| {
                    Box::new(LeaseGuard {
                        engine: engine.clone(),
                        lease: Some(l),
                    })
                });
                return match (first_token, lease) {
                    (Some(first_token), lease) if lease.is_some() == lease_kv => {
                        Outcome::Prefilled {
                            first_token,
                            prompt_logprobs,
                            finished,
                            lease,
                        }
                    }
                    _ => Outcome::Aborted,
                };
            }
            Ok(RequestEvent::Failed(e)) => return Outcome::Failed(e),
            Err(mpsc::RecvError) => return Outcome::EngineGone,
        }
    }
}

/// `pd.v1.PrefillService` over an engine of role `Prefill`.
#[derive(Debug)]
struct PrefillNodeService {
    requests: Arc<Requests>,
    facts: ModelFacts,
    kv_addr: SocketAddr,
    lease_timeout: Duration,
    leases: Arc<Leases>,
    metrics: Arc<NodeMetrics>,
    /// Leases registered for RDMA reads (`--kv-transport rdma|auto` with a device).
    rdma: Option<Arc<RdmaExporter>>,
    guides: Arc<GuideCache>,
    /// `CacheEvents` streams.
    cache_events: CacheEvents,
}

impl PrefillNodeService {
    fn engine(&self) -> &EngineHandle {
        self.requests.engine()
    }

    /// Hand a prefill's lease out: tracked for the drain, offered for RDMA reads where this
    /// node runs RDMA, described in the handle a decode node pulls with.
    async fn hand_out(
        &self,
        lease: LeaseGuard,
        submitted: SystemTime,
        finished: &Finished,
    ) -> pb::KvHandle {
        let lease = lease.keep();
        let deadline = submitted + finished.timings.end_to_end + self.lease_timeout;
        let lease_end = Instant::now() + self.lease_timeout;
        self.leases.insert(lease.lease_id, lease_end);
        let rdma = self
            .offer_rdma(lease.lease_id, lease.secret, lease.blocks.len(), lease_end)
            .await;
        let f = &self.facts;
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        pb::KvHandle {
            addr: self.kv_addr.to_string(),
            layout_fingerprint: f.fingerprint.to_string(),
            block_size: n(f.block_size()),
            num_tokens: n(lease.num_tokens),
            lease_id: lease.lease_id,
            lease_deadline_unix_ms: unix_ms(deadline),
            block_bytes: f.block_bytes() as u64,
            num_blocks: n(lease.blocks.len()),
            rdma,
            lease_secret: convert::wire_lease_secret(&lease.secret),
        }
    }

    /// A wire request into an engine request, or INVALID_ARGUMENT.
    fn validate(&self, req: pb::PrefillRequest) -> Result<EngineRequest, Status> {
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument(
                "request_id is required (the router's id for this request)",
            ));
        }
        let f = &self.facts;
        validate_prompt(&req.token_ids, f.vocab_size, f.max_model_len, 1)
            .map_err(|e| convert::status(e.kind(), e.to_string()))?;
        // A prefill node samples exactly one token: max_tokens is 1 whatever the request
        // would decode later, and min_tokens at most 1 (the first token is then neither EOS
        // nor a stop token id; the decode node keeps the rest of the minimum).
        let mut params = convert::sampling_params(
            req.sampling.as_ref(),
            1,
            vec![],
            req.stop_token_ids,
            req.ignore_eos,
            // Text is the router's: stop strings and special tokens' text do not reach nodes.
            false,
            true,
        );
        params.min_tokens = params.min_tokens.min(1);
        params
            .validate(f.vocab_size, f.max_model_len as u32)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(EngineRequest {
            id: RequestId(req.request_id),
            prompt: req.token_ids,
            params,
            cache_salt: req.cache_salt,
            imported: None,
            lease_kv: !req.skip_kv_lease,
            guide: None,
            resumed: 0,
        })
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[tonic::async_trait]
impl PrefillService for PrefillNodeService {
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let mut req = self.validate(request.into_inner())?;
        req.guide = pd_node::guide::compile(&self.guides, &req.params).await?;
        let id = req.id.clone();
        let lease_kv = req.lease_kv;
        // Dropped before the end (the client cancelled the call): aborts the engine request.
        let guard = self.requests.begin(&id)?;
        // Taken before the engine sees the request, so the deadline reported is never later
        // than the engine's.
        let submitted = SystemTime::now();
        let rx = guard.submit(req);
        let engine = self.engine().clone();
        let outcome = tokio::task::spawn_blocking(move || collect(engine, rx, lease_kv))
            .await
            .map_err(|e| Status::internal(format!("prefill task failed: {e}")))?;
        guard.finished();
        let (first_token, prompt_logprobs, finished, lease) = match outcome {
            Outcome::Prefilled {
                first_token,
                prompt_logprobs,
                finished,
                lease,
            } => (first_token, prompt_logprobs, finished, lease),
            Outcome::Aborted => {
                return Err(Status::aborted(format!("request {id} was aborted")));
            }
            Outcome::Failed(e) => return Err(engine_status(&e)),
            Outcome::EngineGone => return Err(engine_gone()),
        };
        let kv = match lease {
            Some(lease) => Some(self.hand_out(*lease, submitted, &finished).await),
            None => None,
        };
        tracing::debug!(
            request_id = %id,
            lease_id = kv.as_ref().map(|kv| kv.lease_id),
            prompt_tokens = finished.usage.prompt_tokens,
            cached_tokens = finished.usage.cached_tokens(),
            "prefilled"
        );
        Ok(Response::new(pb::PrefillResponse {
            first_token: Some(convert::logprob(&first_token)),
            usage: Some(convert::usage(&finished.usage)),
            kv,
            prompt_logprobs: prompt_logprobs
                .iter()
                .map(convert::prompt_logprob)
                .collect(),
            // Taken after the engine delivered the end, which it publishes the counters
            // before: this request's counts are in.
            counters: Some(self.metrics.counter_report()),
        }))
    }

    async fn release_kv(
        &self,
        request: Request<pb::ReleaseKvRequest>,
    ) -> Result<Response<pb::ReleaseKvResponse>, Status> {
        let req = request.into_inner();
        let lease_id = req.lease_id;
        let secret = convert::lease_secret("lease_secret", &req.lease_secret)?;
        let engine = self.engine().clone();
        let released = tokio::task::spawn_blocking(move || engine.release_lease(lease_id, secret))
            .await
            .map_err(|e| Status::internal(format!("release task failed: {e}")))?;
        // A wrong secret released nothing: the lease stays tracked and offered.
        if released {
            self.leases.remove(lease_id);
            if let Some(rdma) = &self.rdma {
                // Deregisters the lease's regions: a late RDMA reader gets a remote access
                // error.
                rdma.retire(lease_id);
            }
        }
        tracing::debug!(lease_id, released, "lease released");
        Ok(Response::new(pb::ReleaseKvResponse { released }))
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
            Role::Prefill,
            Some(self.kv_addr),
            &self.metrics,
        )))
    }

    async fn rdma_connect(
        &self,
        request: Request<pb::RdmaConnectRequest>,
    ) -> Result<Response<pb::RdmaConnectResponse>, Status> {
        self.connect_rdma(request.into_inner())
            .await
            .map(Response::new)
    }

    type CacheEventsStream = pd_node::cache_events::CacheEventsStream;

    async fn cache_events(
        &self,
        _request: Request<pb::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        self.cache_events.subscribe().map(Response::new)
    }
}

/// A started prefill node: model loaded, engine running, listeners bound; not serving until
/// [`PrefillNode::run`].
#[derive(Debug)]
pub struct PrefillNode {
    ready: Ready,
    server: NodeServer,
    export: KvExportServer,
    engine: EngineThread,
}

/// Load the model, start the engine and bind the gRPC and KV export listeners.
pub async fn start(args: PrefillArgs) -> anyhow::Result<PrefillNode> {
    anyhow::ensure!(
        !args.kv_lease_timeout.is_zero(),
        "--kv-lease-timeout must be more than 0 seconds: decode nodes need time to pull the KV"
    );
    // Before the model loads: unusable TLS flags or files, a non-loopback bind without mTLS,
    // and `--kv-transport rdma` without a device fail at once.
    let tls = pd_node::tls::NodeTls::load(&args.node)?;
    let rdma_device = pd_node::kv_transport::open_rdma(&args.node)?;
    let started = pd_node::start_engine(&args.node, Role::Prefill, args.kv_lease_timeout).await?;
    let (facts, engine) = (started.facts, started.thread);
    let handle = engine.handle();
    let (listener, grpc) =
        pd_node::server::bind(&args.node.host, args.node.port, "gRPC server").await?;
    let kv_bind = tokio::net::lookup_host((args.node.host.as_str(), args.kv_port))
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .with_context(|| format!("resolving --host {}", args.node.host))?;
    let export_config = ExportConfig {
        tls: tls.kv.clone(),
        ..ExportConfig::default()
    };
    let (export, kv_addr) = KvExportServer::bind_with(
        kv_bind,
        facts.fingerprint,
        Arc::new(handle.clone()),
        export_config,
    )
    .await
    .with_context(|| format!("binding the KV export server on {kv_bind}"))?;
    // What decode nodes dial: the advertised IP when the bind address is a wildcard.
    let kv_addr = args
        .node
        .advertise_host
        .map_or(kv_addr, |ip| SocketAddr::new(ip, kv_addr.port()));
    if kv_addr.ip().is_unspecified() {
        tracing::warn!(
            %kv_addr,
            "the KV address handed to decode nodes is a wildcard: set --advertise-host to \
             this node's IP when decode nodes run on other hosts"
        );
    }
    let (metrics_listener, metrics_addr) =
        pd_node::server::bind(&args.node.host, args.node.metrics_port, "metrics server").await?;
    let metrics = Arc::new(NodeMetrics::new(
        Role::Prefill,
        &facts,
        handle.clone(),
        export.transfer_stats(),
        started.histograms,
    ));
    // Decode nodes call RdmaConnect on the gRPC address, advertised like the KV address.
    let connect_addr = args
        .node
        .advertise_host
        .map_or(grpc, |ip| SocketAddr::new(ip, grpc.port()));
    let rdma = match &rdma_device {
        Some(device) => {
            // Leases are offered where the engine keeps them when its KV is host memory
            // (registered once here); otherwise each lease is staged in registered memory.
            let exporter = RdmaExporter::new(device, connect_addr.to_string())?
                .with_host_kv(handle.host_kv_memory().cloned());
            let exporter = Arc::new(exporter);
            rdma::spawn_rdma_sweeper(Arc::downgrade(&exporter));
            Some(exporter)
        }
        None => None,
    };
    let requests = Requests::new(handle, args.node.max_open_requests());
    let leases = Arc::new(Leases::default());
    let ready = Ready {
        role: Role::Prefill,
        grpc,
        kv: Some(kv_addr),
        metrics_addr,
        model: facts.served_name.clone(),
        fingerprint: facts.fingerprint.to_string(),
    };
    let service = PrefillNodeService {
        requests: Arc::clone(&requests),
        facts,
        kv_addr,
        lease_timeout: args.kv_lease_timeout,
        leases: Arc::clone(&leases),
        metrics: Arc::clone(&metrics),
        rdma,
        guides: started.guides,
        cache_events: CacheEvents::new(Arc::clone(&requests)),
    };
    let server = NodeServer {
        listener,
        metrics_listener,
        metrics,
        routes: tonic::service::Routes::new(PrefillServiceServer::new(service)),
        service_name:
            <PrefillServiceServer<PrefillNodeService> as tonic::server::NamedService>::NAME,
        requests,
        drain_timeout: args.node.drain_timeout,
        also_idle: Box::new(move || leases.is_empty()),
        tls,
    };
    Ok(PrefillNode {
        ready,
        server,
        export,
        engine,
    })
}

impl PrefillNode {
    /// What the ready line says (addresses, model, fingerprint).
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// Serve until `shutdown` resolves, drain, then stop the export server and the engine.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let PrefillNode {
            server,
            export,
            engine,
            ..
        } = self;
        let result = server.run(shutdown).await;
        export.shutdown(EXPORT_STOP_GRACE).await;
        // Joining the engine thread waits for its current step: off the async workers.
        let _ = tokio::task::spawn_blocking(move || drop(engine)).await;
        result
    }
}

impl pd_node::server::StartedNode for PrefillNode {
    fn ready(&self) -> &Ready {
        PrefillNode::ready(self)
    }

    fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> impl Future<Output = anyhow::Result<()>> + Send {
        PrefillNode::run(self, shutdown)
    }
}

/// Start, print the ready line, serve until `shutdown`, drain and stop
/// ([`pd_node::server::serve`]).
pub async fn serve(
    args: PrefillArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    pd_node::server::serve(start(args), shutdown).await
}
