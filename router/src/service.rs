//! The client API, `pd.v1.Generation`, and the state its requests share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_proto::pb;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::choices::ChoiceOf;
use crate::flow;

/// One message of a `Generate` stream.
type ChunkResult = Result<pb::GenerateResponse, Status>;
use crate::auth::Auth;
use crate::metrics::Predicted;
use crate::policy::{Candidate, RouteInput, RoutingPolicy};
use crate::registry::{Node, Registry};
use crate::tenant::{Tenancy, Tenant};
use crate::validation::{ModelMeta, ValidRequest, ValidationError, Validator};

/// Chunks buffered per request between the request task and the client.
const STREAM_BUFFER: usize = 16;

/// What every request of one router shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub model: Arc<ModelMeta>,
    pub validator: Validator,
    pub registry: Arc<Registry>,
    pub metrics: Arc<crate::metrics::RouterMetrics>,
    pub policy: Box<dyn RoutingPolicy>,
    /// Decode nodes in the cluster ([`crate::policy::build_decode`]).
    pub decode_policy: Box<dyn RoutingPolicy>,
    /// The nodes' (and the router's) `--prefix-caching-hash-algo`.
    pub hash_algo: pd_engine::kv::prefix::hash::HashAlgo,
    /// `--disagg` and the measurements it decides with.
    pub disagg: crate::disagg::Disagg,
    pub inflight: Arc<InflightTable>,
    pub ids: IdGen,
    pub node_timeout: Duration,
    pub request_timeout: Option<Duration>,
    /// Client authentication (`--api-keys`).
    pub auth: Auth,
    /// How tenants separate their cached KV.
    pub tenancy: Tenancy,
    /// `--max-inflight` / `--max-queue`: both APIs' requests take their slots here.
    pub admission: Arc<crate::admission::Admission>,
    /// `--tenant-limits` (also checked by `admission`); here for its reload task.
    pub limits: Option<Arc<crate::limits::TenantLimits>>,
    /// `--max-retries`, the retry backoff and the retry budget.
    pub retries: crate::retry::Retries,
    /// `--migration-limit`.
    pub migration_limit: u32,
}

impl Shared {
    fn candidates(nodes: &[Arc<Node>]) -> Vec<Candidate> {
        nodes
            .iter()
            .map(|n| Candidate {
                node: n.id,
                load: n.load(),
                block_size: n.block_size(),
                epoch: n.epoch(),
            })
            .collect()
    }

    /// The routing policy's choice among `nodes` (never empty): the nodes that compute the
    /// prompt (prefill nodes; decode nodes in aggregated mode).
    pub fn pick_by_policy(&self, req: &ValidRequest, nodes: &[Arc<Node>]) -> Arc<Node> {
        let input = RouteInput {
            tokens: &req.prompt,
            cache_salt: req.cache_salt.as_deref(),
        };
        let index = self.policy.choose(&input, &Self::candidates(nodes));
        nodes[index].clone()
    }

    /// What the cache index predicts `node` reuses of `req`'s prompt, per tier; `None` while
    /// the node's cache events are not in sync (the policy guessed).
    pub fn predict(&self, req: &ValidRequest, node: &Node) -> Option<Predicted> {
        let block_size = node.block_size();
        let index = self.registry.cache_index();
        if !index.in_sync(node.id) {
            // Spares the hashing when there is nothing to look up.
            return None;
        }
        let hashes = pd_engine::kv::prefix::hash::block_hashes_with(
            &req.prompt,
            block_size,
            req.cache_salt.as_deref(),
            self.hash_algo,
        );
        let m = index.lookup(node.id, &hashes)?;
        let (device, host) = m.tokens(block_size, req.prompt.len());
        Some(Predicted { device, host })
    }

    /// The decode node of a request in the cluster among `nodes` (never empty): by the
    /// decode policy (least loaded, or the one holding the prompt's earlier KV).
    pub fn pick_decode(&self, req: &ValidRequest, nodes: &[Arc<Node>]) -> Arc<Node> {
        let input = RouteInput {
            tokens: &req.prompt,
            cache_salt: req.cache_salt.as_deref(),
        };
        let index = self.decode_policy.choose(&input, &Self::candidates(nodes));
        nodes[index].clone()
    }
}

/// Request ids: the ones the router makes, and the per-attempt ids the nodes see (unique
/// across routers, tenants and retries, and still showing the client's id and tenant in node
/// logs).
///
/// Ids the router makes for requests without one are 128 random bits from the operating
/// system's CSPRNG (through `rand`'s thread generator, seeded from it): nobody can guess
/// another client's id to abort it (and ids are scoped by tenant anyway).
#[derive(Debug)]
pub(crate) struct IdGen {
    /// Random per router process: node ids of two routers never collide.
    nonce: u64,
    seq: AtomicU64,
}

impl IdGen {
    pub fn new() -> Self {
        Self {
            nonce: rand::random(),
            seq: AtomicU64::new(1),
        }
    }

    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    pub fn request_id(&self) -> String {
        format!("req-{:032x}", rand::random::<u128>())
    }

    /// The id a node sees for one attempt of `tenant`'s request `request_id`: unique
    /// whatever ids tenants choose (the sequence number alone is unique in this router).
    pub fn node_request_id(&self, tenant: &Tenant, request_id: &str) -> String {
        format!("{request_id}@{tenant}/{:016x}.{}", self.nonce, self.next())
    }
}

/// A request's key among those in flight: its tenant and its id (ids are the tenant's own).
type InflightKey = (Tenant, String);

/// Requests in flight by tenant and client request id, each with its cancel switch.
#[derive(Debug, Default)]
pub(crate) struct InflightTable {
    map: Mutex<HashMap<InflightKey, watch::Sender<bool>>>,
}

impl InflightTable {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<InflightKey, watch::Sender<bool>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `tenant`'s request `id`; refused if the tenant has it in flight already.
    pub fn register(
        self: &Arc<Self>,
        tenant: &Tenant,
        id: &str,
    ) -> Result<(InflightEntry, watch::Receiver<bool>), ValidationError> {
        let key = (tenant.clone(), id.to_string());
        let mut map = self.map();
        if map.contains_key(&key) {
            return Err(ValidationError::DuplicateRequestId(id.to_string()));
        }
        let (tx, rx) = watch::channel(false);
        map.insert(key.clone(), tx);
        Ok((
            InflightEntry {
                table: self.clone(),
                key,
            },
            rx,
        ))
    }

    /// Cancels `tenant`'s request `id`; false if the tenant has no such request in flight
    /// (another tenant's request of that id is not touched).
    pub fn abort(&self, tenant: &Tenant, id: &str) -> bool {
        match self.map().get(&(tenant.clone(), id.to_string())) {
            Some(cancel) => {
                cancel.send_replace(true);
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }
}

/// A request's place in the [`InflightTable`]; removed on drop.
#[derive(Debug)]
pub(crate) struct InflightEntry {
    table: Arc<InflightTable>,
    key: InflightKey,
}

impl Drop for InflightEntry {
    fn drop(&mut self) {
        self.table.map().remove(&self.key);
    }
}

/// The tenant a request's extensions carry (put there by `crate::auth`); `default` when
/// none does (no API keys).
pub(crate) fn tenant_of(extensions: &tonic::Extensions) -> Tenant {
    extensions.get::<Tenant>().cloned().unwrap_or_default()
}

/// `grpc-timeout` of a request (the client's deadline), if it sent a valid one.
pub fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A request's future, spawned as a task of its own when dropped unfinished.
struct SpawnOnDrop(Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>);

impl Drop for SpawnOnDrop {
    fn drop(&mut self) {
        if let Some(rest) = self.0.take() {
            // Handlers run on the runtime; outside it (never) the request is dropped as is.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(rest);
            }
        }
    }
}

/// `pd.v1.Generation`.
#[derive(Debug, Clone)]
pub struct GenerationService {
    shared: Arc<Shared>,
}

impl GenerationService {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// A new request id, as one a request without its own gets.
    pub(crate) fn request_id(&self) -> String {
        self.shared.ids.request_id()
    }

    /// Holds `tenant`'s `id` among the requests in flight (refused if a request of the
    /// tenant holds it) until the entry drops; the receiver turns true when the tenant's
    /// `Abort` names it.
    pub(crate) fn hold_id(
        &self,
        tenant: &Tenant,
        id: &str,
    ) -> Result<(InflightEntry, watch::Receiver<bool>), ValidationError> {
        self.shared.inflight.register(tenant, id)
    }

    /// The deadline of a request that arrived at `arrival` with `metadata`: the earlier of
    /// the client's `grpc-timeout` and the router's `--request-timeout`, if either is set.
    pub(crate) fn deadline(&self, metadata: &MetadataMap, arrival: Instant) -> Option<Instant> {
        let budget = match (grpc_timeout(metadata), self.shared.request_timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        budget.map(|b| arrival + b)
    }
}

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    type GenerateStream =
        tokio_stream::adapters::Chain<tokio_stream::Once<ChunkResult>, ReceiverStream<ChunkResult>>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrival = Instant::now();
        let own = self.deadline(request.metadata(), arrival);
        // A choice of a request of `n`: that request's Abort and deadline hold for it too.
        let (parent, deadline) = match request.extensions().get::<ChoiceOf>() {
            Some(of) => (
                of.abort.clone(),
                match (own, of.deadline) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                },
            ),
            None => (None, own),
        };
        let tenant = tenant_of(request.extensions());
        let req = request.into_inner();
        let shared = self.shared.clone();
        let context = shared
            .registry
            .context_len(shared.model.max_position_embeddings());
        let valid = if matches!(req.input, Some(pb::generate_request::Input::TokenIds(_))) {
            // Token ids are checked in one pass: cheaper here than a hop to the blocking pool,
            // which costs a thread wake-up on every request.
            (shared.validator).validate(req, context, || shared.ids.request_id())?
        } else {
            // Tokenizing and rendering templates is CPU work: off the async threads.
            tokio::task::spawn_blocking(move || {
                shared
                    .validator
                    .validate(req, context, || shared.ids.request_id())
            })
            .await
            .map_err(|e| Status::internal(format!("request validation panicked: {e}")))??
        };
        let mut valid = valid;
        valid.cache_salt = (self.shared.tenancy).cache_salt(&tenant, valid.cache_salt.take());
        valid.tenant = tenant;
        let (entry, cancel) = (self.shared.inflight).register(&valid.tenant, &valid.request_id)?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tracing::debug!(request_id = %valid.request_id, tenant = %valid.tenant, prompt_tokens = valid.prompt.len(), max_tokens = valid.params.max_tokens, "generate");
        // This handler drives the request itself until its first message (for a 1-token
        // request, to its end), then leaves the rest to a task of its own: a task per request
        // from the start costs every request a hand-off and a wake-up. A client that goes
        // away meanwhile drops this future: the guard then spawns the request, which sees
        // the client gone and gives back what it holds on the nodes.
        let mut request = SpawnOnDrop(Some(Box::pin(flow::run(
            self.shared.clone(),
            valid,
            entry,
            cancel,
            parent,
            tx,
            deadline,
        ))));
        // The response goes out with its first message: headers alone would be one more
        // write, and one more wake-up of the client, while the prefill node computes (on
        // shared cores that slows the prefill itself), and for a 1-token request the headers,
        // the chunk and the trailers then leave in one write.
        let mut rx = rx;
        let mut first = None;
        if let Some(running) = request.0.as_mut() {
            tokio::select! {
                biased;
                message = rx.recv() => first = Some(message),
                () = running => {}
            }
        }
        let first = match first {
            Some(message) => message,
            None => {
                // The request ended: everything it sent is queued.
                request.0 = None;
                rx.recv().await
            }
        };
        drop(request);
        let first = first.unwrap_or_else(|| {
            Err(Status::internal(
                "the request ended without a response (router bug)",
            ))
        });
        Ok(Response::new(tokio_stream::StreamExt::chain(
            tokio_stream::once(first),
            ReceiverStream::new(rx),
        )))
    }

    async fn abort(
        &self,
        request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        let tenant = tenant_of(request.extensions());
        let aborted = (self.shared.inflight).abort(&tenant, &request.get_ref().request_id);
        Ok(Response::new(pb::AbortResponse { aborted }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let req = request.into_inner();
        self.shared.validator.check_model(&req.model)?;
        let shared = self.shared.clone();
        let ids = tokio::task::spawn_blocking(move || shared.validator.tokenize(&req.text))
            .await
            .map_err(|e| Status::internal(format!("tokenization panicked: {e}")))??;
        Ok(Response::new(pb::TokenizeResponse { ids }))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let model = &self.shared.model;
        let context = self
            .shared
            .registry
            .context_len(model.max_position_embeddings());
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelCard {
                name: model.name.clone(),
                max_model_len: u32::try_from(context).unwrap_or(u32::MAX),
                vocab_size: u32::try_from(model.vocab_size()).unwrap_or(u32::MAX),
            }],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts() {
        let mut m = MetadataMap::new();
        assert_eq!(grpc_timeout(&m), None);
        for (v, d) in [
            ("100m", Duration::from_millis(100)),
            ("5S", Duration::from_secs(5)),
            ("2M", Duration::from_secs(120)),
            ("1H", Duration::from_secs(3600)),
            ("7u", Duration::from_micros(7)),
        ] {
            m.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(grpc_timeout(&m), Some(d), "{v}");
        }
        m.insert("grpc-timeout", "12x".parse().unwrap());
        assert_eq!(grpc_timeout(&m), None);
    }

    #[test]
    fn ids_are_unique_and_inflight_ids_too() {
        let ids = IdGen::new();
        let id = ids.request_id();
        assert_ne!(id, ids.request_id());
        assert_eq!(id.len(), "req-".len() + 32, "{id}");
        let (a, b) = (Tenant::new("a").unwrap(), Tenant::new("b").unwrap());
        let node_id = ids.node_request_id(&a, "abc");
        assert!(node_id.starts_with("abc@a/"), "{node_id}");
        assert_ne!(node_id, ids.node_request_id(&b, "abc"));
        let table = Arc::new(InflightTable::default());
        let (entry, mut cancel) = table.register(&a, "x").unwrap();
        assert!(matches!(
            table.register(&a, "x"),
            Err(ValidationError::DuplicateRequestId(_))
        ));
        // Ids are the tenant's own: b may use x too, and cannot abort a's.
        let (other, other_cancel) = table.register(&b, "x").unwrap();
        assert!(!table.abort(&a, "y"));
        assert!(table.abort(&a, "x"));
        assert!(*cancel.borrow_and_update());
        assert!(!*other_cancel.borrow());
        drop((entry, other));
        assert_eq!(table.len(), 0);
        assert!(table.register(&a, "x").is_ok());
    }
}
