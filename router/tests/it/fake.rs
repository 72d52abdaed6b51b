//! Scripted, in-process fake prefill and decode nodes (real tonic servers on 127.0.0.1:0),
//! and a harness that runs the real router in front of them.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::decode_service_server::{DecodeService, DecodeServiceServer};
use pd_proto::pb::generation_client::GenerationClient;
use pd_proto::pb::prefill_service_server::{PrefillService, PrefillServiceServer};
use pd_router::registry::Registry;
use pd_router::{Router, RouterConfig, RouterError};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub const FINGERPRINT: &str = "f00dcafe";
pub const LOCAL_CACHED: u32 = 16;
pub const EXTERNAL_CACHED: u32 = 32;

/// How a scripted decode stream ends after its messages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum End {
    /// The last message carries this finish reason (and the node's usage).
    Finish(pb::FinishReason),
    /// The stream stays open, sending nothing, until the router drops it.
    Hang,
    /// The stream ends with this error status.
    Fail(Code),
}

#[derive(Debug, Clone)]
pub struct Script {
    /// Tokens of each message.
    pub messages: Vec<Vec<u32>>,
    pub end: End,
    /// Pause before each message.
    pub delay: Duration,
}

impl Default for Script {
    fn default() -> Self {
        Self {
            messages: vec![vec![101, 102]],
            end: End::Finish(pb::FinishReason::Length),
            delay: Duration::ZERO,
        }
    }
}

/// Everything a fake node is told and everything it saw.
#[derive(Debug)]
pub struct FakeState {
    pub role: pb::Role,
    pub fingerprint: Mutex<String>,
    pub block_size: AtomicU32,
    /// `NodeInfo.kv_cache_dtype`.
    pub kv_cache_dtype: Mutex<String>,
    /// Reported as `num_waiting`.
    pub load: AtomicU32,
    pub max_model_len: AtomicU32,
    pub unhealthy: AtomicBool,
    /// The next N Prefill / Decode calls fail with `fail_code`.
    pub fail_next: AtomicUsize,
    pub fail_code: Mutex<Code>,
    pub first_token: AtomicU32,
    pub prefill_delay: Mutex<Duration>,
    pub script: Mutex<Script>,
    next_lease: AtomicU64,
    pub prefills: Mutex<Vec<pb::PrefillRequest>>,
    /// Each Prefill's `grpc-timeout` header, as received.
    pub prefill_timeouts: Mutex<Vec<Option<String>>>,
    pub decodes: Mutex<Vec<pb::DecodeRequest>>,
    pub leases: Mutex<Vec<u64>>,
    pub released: Mutex<Vec<u64>>,
    pub aborted: Mutex<Vec<String>>,
    /// Decode streams the router dropped before they ended.
    pub streams_cancelled: AtomicUsize,
}

impl FakeState {
    pub fn new(role: pb::Role) -> Arc<Self> {
        Arc::new(Self {
            role,
            fingerprint: Mutex::new(FINGERPRINT.into()),
            block_size: AtomicU32::new(16),
            kv_cache_dtype: Mutex::new("float32".into()),
            load: AtomicU32::new(0),
            max_model_len: AtomicU32::new(4096),
            unhealthy: AtomicBool::new(false),
            fail_next: AtomicUsize::new(0),
            fail_code: Mutex::new(Code::Unavailable),
            first_token: AtomicU32::new(100),
            prefill_delay: Mutex::new(Duration::ZERO),
            script: Mutex::new(Script::default()),
            next_lease: AtomicU64::new(1000),
            prefills: Mutex::default(),
            prefill_timeouts: Mutex::default(),
            decodes: Mutex::default(),
            leases: Mutex::default(),
            released: Mutex::default(),
            aborted: Mutex::default(),
            streams_cancelled: AtomicUsize::new(0),
        })
    }

    fn info(&self) -> pb::NodeInfo {
        pb::NodeInfo {
            model: "synthetic:tiny".into(),
            role: self.role as i32,
            layout_fingerprint: self.fingerprint.lock().unwrap().clone(),
            block_size: self.block_size.load(Ordering::SeqCst),
            num_blocks: 1000,
            free_blocks: 1000,
            num_running: 0,
            num_waiting: self.load.load(Ordering::SeqCst),
            kv_transport_addr: "127.0.0.1:9".into(),
            vocab_size: 151_936,
            max_model_len: self.max_model_len.load(Ordering::SeqCst),
            healthy: !self.unhealthy.load(Ordering::SeqCst),
            counters: None,
            kv_cache_dtype: self.kv_cache_dtype.lock().unwrap().clone(),
        }
    }

    fn scripted_failure(&self) -> Option<Status> {
        let failing = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        failing.then(|| Status::new(*self.fail_code.lock().unwrap(), "scripted failure"))
    }

    pub fn prefill_count(&self) -> usize {
        self.prefills.lock().unwrap().len()
    }

    pub fn decode_count(&self) -> usize {
        self.decodes.lock().unwrap().len()
    }

    pub fn released(&self) -> Vec<u64> {
        self.released.lock().unwrap().clone()
    }

    pub fn aborted(&self) -> Vec<String> {
        self.aborted.lock().unwrap().clone()
    }
}

#[derive(Debug, Clone)]
struct Fake(Arc<FakeState>);

fn logprob(token_id: u32) -> pb::Logprob {
    pb::Logprob {
        token_id,
        logprob: -0.5,
        top: vec![pb::TokenLogprob {
            token_id,
            logprob: -0.5,
        }],
    }
}

#[tonic::async_trait]
impl PrefillService for Fake {
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        self.0.prefill_timeouts.lock().unwrap().push(timeout);
        let req = request.into_inner();
        self.0.prefills.lock().unwrap().push(req.clone());
        let delay = *self.0.prefill_delay.lock().unwrap();
        tokio::time::sleep(delay).await;
        if let Some(status) = self.0.scripted_failure() {
            return Err(status);
        }
        let n = req.token_ids.len() as u32;
        let lease_id = self.0.next_lease.fetch_add(1, Ordering::SeqCst);
        self.0.leases.lock().unwrap().push(lease_id);
        let block_size = self.0.block_size.load(Ordering::SeqCst);
        let wants_prompt_logprobs = req
            .sampling
            .as_ref()
            .is_some_and(|s| s.prompt_logprobs.is_some());
        Ok(Response::new(pb::PrefillResponse {
            first_token: Some(logprob(self.0.first_token.load(Ordering::SeqCst))),
            usage: Some(pb::Usage {
                prompt_tokens: n,
                completion_tokens: 1,
                cached_tokens: LOCAL_CACHED + EXTERNAL_CACHED,
                local_cached_tokens: LOCAL_CACHED,
                external_cached_tokens: EXTERNAL_CACHED,
            }),
            kv: Some(pb::KvHandle {
                addr: "127.0.0.1:9".into(),
                layout_fingerprint: self.0.fingerprint.lock().unwrap().clone(),
                block_size,
                num_tokens: n,
                lease_id,
                lease_deadline_unix_ms: 0,
                block_bytes: 4,
                num_blocks: n.div_ceil(block_size.max(1)),
                rdma: vec![],
            }),
            prompt_logprobs: if wants_prompt_logprobs {
                req.token_ids[1..].iter().map(|&t| logprob(t)).collect()
            } else {
                vec![]
            },
            counters: None,
        }))
    }

    async fn release_kv(
        &self,
        request: Request<pb::ReleaseKvRequest>,
    ) -> Result<Response<pb::ReleaseKvResponse>, Status> {
        self.0
            .released
            .lock()
            .unwrap()
            .push(request.get_ref().lease_id);
        Ok(Response::new(pb::ReleaseKvResponse { released: true }))
    }

    async fn abort(
        &self,
        request: Request<pb::NodeAbortRequest>,
    ) -> Result<Response<pb::NodeAbortResponse>, Status> {
        self.0
            .aborted
            .lock()
            .unwrap()
            .push(request.into_inner().request_id);
        Ok(Response::new(pb::NodeAbortResponse { aborted: true }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        Ok(Response::new(self.0.info()))
    }

    async fn rdma_connect(
        &self,
        _request: Request<pb::RdmaConnectRequest>,
    ) -> Result<Response<pb::RdmaConnectResponse>, Status> {
        Err(Status::failed_precondition(
            "the fake prefill node has no RDMA",
        ))
    }
}

/// A decode stream that notes when the router drops it before its end.
struct Watched {
    inner: ReceiverStream<Result<pb::DecodeResponse, Status>>,
    done: bool,
    state: Arc<FakeState>,
}

impl Stream for Watched {
    type Item = Result<pb::DecodeResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let poll = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(None) = poll {
            self.done = true;
        }
        poll
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if !self.done {
            self.state.streams_cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

type DecodeStreamOf = Pin<Box<dyn Stream<Item = Result<pb::DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeService for Fake {
    type DecodeStream = DecodeStreamOf;

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        self.0.decodes.lock().unwrap().push(request.into_inner());
        if let Some(status) = self.0.scripted_failure() {
            return Err(status);
        }
        let script = self.0.script.lock().unwrap().clone();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let n = script.messages.len();
            for (i, tokens) in script.messages.iter().enumerate() {
                tokio::time::sleep(script.delay).await;
                let finish = match script.end {
                    End::Finish(reason) if i + 1 == n => Some(reason),
                    _ => None,
                };
                let message = pb::DecodeResponse {
                    tokens: tokens.iter().map(|&t| logprob(t)).collect(),
                    finish_reason: finish.map_or(0, |r| r as i32),
                    // The decode node's own view: must never reach the client.
                    usage: finish.map(|_| pb::Usage {
                        prompt_tokens: 1,
                        completion_tokens: 1,
                        cached_tokens: 999,
                        local_cached_tokens: 500,
                        external_cached_tokens: 499,
                    }),
                    counters: None,
                    prompt_logprobs: vec![],
                };
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
            }
            match script.end {
                End::Finish(_) => {}
                End::Hang => tx.closed().await,
                End::Fail(code) => {
                    let _ = tx
                        .send(Err(Status::new(code, "scripted decode failure")))
                        .await;
                }
            }
        });
        Ok(Response::new(Box::pin(Watched {
            inner: ReceiverStream::new(rx),
            done: false,
            state: self.0.clone(),
        })))
    }

    async fn abort(
        &self,
        request: Request<pb::NodeAbortRequest>,
    ) -> Result<Response<pb::NodeAbortResponse>, Status> {
        self.0
            .aborted
            .lock()
            .unwrap()
            .push(request.into_inner().request_id);
        Ok(Response::new(pb::NodeAbortResponse { aborted: true }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        Ok(Response::new(self.0.info()))
    }
}

/// A fake node serving on a real socket; can be stopped and restarted on the same port.
pub struct FakeNode {
    pub addr: SocketAddr,
    pub state: Arc<FakeState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl FakeNode {
    pub async fn prefill() -> Self {
        Self::start(FakeState::new(pb::Role::Prefill), "127.0.0.1:0").await
    }

    pub async fn decode() -> Self {
        Self::start(FakeState::new(pb::Role::Decode), "127.0.0.1:0").await
    }

    async fn start(state: Arc<FakeState>, addr: &str) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind a fake node");
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let fake = Fake(state.clone());
        let incoming = TcpListenerStream::new(listener);
        let shutdown = async {
            let _ = stopped.await;
        };
        let task = match state.role {
            pb::Role::Prefill => tokio::spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(PrefillServiceServer::new(fake))
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await;
            }),
            _ => tokio::spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(DecodeServiceServer::new(fake))
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await;
            }),
        };
        Self {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Stops serving: the port refuses connections until [`FakeNode::restart`].
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }

    /// Serves again on the same port, with the same state.
    pub async fn restart(&mut self) {
        self.stop().await;
        let mut again = None;
        for _ in 0..50 {
            match TcpListener::bind(self.addr).await {
                Ok(l) => {
                    drop(l);
                    again = Some(Self::start(self.state.clone(), &self.addr.to_string()).await);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let again = again.expect("the fake node's port is free again");
        *self = again;
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A router configuration over fake nodes, with fast health checks.
pub fn config(prefill: &[&FakeNode], decode: &[&FakeNode]) -> RouterConfig {
    let mut config = RouterConfig::new(
        "synthetic:tiny",
        prefill.iter().map(|n| n.address()).collect(),
        decode.iter().map(|n| n.address()).collect(),
    );
    config.health_interval = Duration::from_millis(50);
    config.health_timeout = Duration::from_millis(500);
    config.node_timeout = Duration::from_secs(10);
    config
}

/// The real router, in process, on an ephemeral port.
pub struct RouterUnderTest {
    pub addr: SocketAddr,
    pub client: GenerationClient<Channel>,
    pub registry: Arc<Registry>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), RouterError>>>,
}

impl RouterUnderTest {
    /// Starts the router and waits until its health is SERVING.
    pub async fn start(config: RouterConfig) -> Self {
        let this = Self::start_unchecked(config).await;
        this.wait_health(ServingStatus::Serving).await;
        this
    }

    /// Starts the router without waiting for any node.
    pub async fn start_unchecked(config: RouterConfig) -> Self {
        let router = tokio::task::spawn_blocking(move || Router::new(config))
            .await
            .unwrap()
            .expect("router starts");
        let registry = router.registry().clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(router.serve(listener, async {
            let _ = stopped.await;
        }));
        let client = GenerationClient::connect(format!("http://{addr}"))
            .await
            .expect("connect to the router");
        Self {
            addr,
            client,
            registry,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn client(&self) -> GenerationClient<Channel> {
        self.client.clone()
    }

    pub async fn health(&self) -> ServingStatus {
        let mut health = HealthClient::new(channel(&self.addr.to_string()).await);
        let response = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "pd.v1.Generation".into(),
            })
            .await
            .unwrap();
        response.into_inner().status()
    }

    pub async fn wait_health(&self, want: ServingStatus) {
        for _ in 0..200 {
            if self.health().await == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("router health never became {want:?}");
    }

    /// Graceful shutdown; returns the serve result.
    pub async fn shutdown(mut self) -> Result<(), RouterError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("router drains and stops")
            .unwrap()
    }
}

impl Drop for RouterUnderTest {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A connected channel to `host:port`.
pub async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// Polls `cond` until it holds (5 s at most).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// The built-in Qwen3 tokenizer (the one `synthetic:tiny` uses).
pub fn tokenizer() -> pd_engine::tokenizer::Tokenizer {
    pd_engine::tokenizer::Tokenizer::qwen3().unwrap()
}

pub fn text_request(text: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Text(text.into())),
        max_tokens: Some(64),
        ..Default::default()
    }
}

/// Every chunk of a stream until it ends: `(chunks, Err(status) if it ended with one)`.
pub async fn collect(
    client: &mut GenerationClient<Channel>,
    request: pb::GenerateRequest,
) -> Result<(Vec<pb::GenerateResponse>, Option<Status>), Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut chunks = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => chunks.push(chunk),
            Ok(None) => return Ok((chunks, None)),
            Err(status) => return Ok((chunks, Some(status))),
        }
    }
}

pub fn all_text(chunks: &[pb::GenerateResponse]) -> String {
    chunks.iter().map(|c| c.text.as_str()).collect()
}

pub fn all_ids(chunks: &[pb::GenerateResponse]) -> Vec<u32> {
    chunks.iter().flat_map(|c| c.token_ids.clone()).collect()
}
