//! The fake prefill and decode gRPC services over a [`FakeState`], and [`FakeNode`], which
//! serves one on a real socket and can stop and restart on the same port.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::decode_service_server::{DecodeService, DecodeServiceServer};
use pd_proto::pb::prefill_service_server::{PrefillService, PrefillServiceServer};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status};

use crate::fake::{End, FakeState};

#[derive(Debug, Clone)]
struct Fake(Arc<FakeState>);

type CacheEventsStreamOf =
    Pin<Box<dyn Stream<Item = Result<pb::CacheEventsMessage, Status>> + Send>>;

impl FakeState {
    /// A `CacheEvents` answer: UNIMPLEMENTED unless the test scripted the node's cache events
    /// ([`FakeState::cache_events`]), else those messages and whatever is published later.
    fn cache_events_stream(&self) -> Result<Response<CacheEventsStreamOf>, Status> {
        let Some(first) = self.cache_events.lock().unwrap().clone() else {
            return Err(Status::unimplemented("the fake node has no cache events"));
        };
        let (tx, rx) = mpsc::unbounded_channel();
        for m in first {
            let _ = tx.send(Ok(m));
        }
        self.cache_streams.lock().unwrap().push(tx);
        self.cache_subscriptions.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        )))
    }

    /// An `Abort` answer, the same for either role: notes the request id and says it aborted.
    fn abort_answer(
        &self,
        request: Request<pb::NodeAbortRequest>,
    ) -> Result<Response<pb::NodeAbortResponse>, Status> {
        self.aborted
            .lock()
            .unwrap()
            .push(request.into_inner().request_id);
        Ok(Response::new(pb::NodeAbortResponse { aborted: true }))
    }
}

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
        let (local, external) = self.0.cached_for(&req.request_id);
        let host = self.0.host_cached.load(Ordering::SeqCst).min(external);
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
                cached_tokens: local + external,
                local_cached_tokens: local,
                external_cached_tokens: external,
                external_host_cached_tokens: host,
                external_peer_cached_tokens: external - host,
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
                lease_secret: vec![7; 16],
            }),
            prompt_logprobs: if wants_prompt_logprobs {
                req.token_ids[1..].iter().map(|&t| logprob(t)).collect()
            } else {
                vec![]
            },
            counters: self.0.counters.lock().unwrap().clone(),
        }))
    }

    async fn release_kv(
        &self,
        request: Request<pb::ReleaseKvRequest>,
    ) -> Result<Response<pb::ReleaseKvResponse>, Status> {
        // Only with the secret the handle carried (as a real prefill node).
        if request.get_ref().lease_secret != [7; 16] {
            return Ok(Response::new(pb::ReleaseKvResponse { released: false }));
        }
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
        self.0.abort_answer(request)
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

    type CacheEventsStream = CacheEventsStreamOf;

    async fn cache_events(
        &self,
        _request: Request<pb::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        self.0.cache_events_stream()
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
        let req = request.into_inner();
        let script = self.0.script_for(&req.request_id);
        self.0.decodes.lock().unwrap().push(req);
        if let Some(status) = self.0.scripted_failure() {
            return Err(status);
        }
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
                        external_host_cached_tokens: 0,
                        external_peer_cached_tokens: 499,
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
        self.0.abort_answer(request)
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        Ok(Response::new(self.0.info()))
    }

    async fn set_kv_peers(
        &self,
        request: Request<pb::SetKvPeersRequest>,
    ) -> Result<Response<pb::SetKvPeersResponse>, Status> {
        let failing = self
            .0
            .fail_kv_peers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(Status::unavailable("scripted SetKvPeers failure"));
        }
        let addrs = request.into_inner().kv_addrs;
        let num_peers = addrs.len() as u32;
        self.0.kv_peers.lock().unwrap().push(addrs);
        Ok(Response::new(pb::SetKvPeersResponse { num_peers }))
    }

    type CacheEventsStream = CacheEventsStreamOf;

    async fn cache_events(
        &self,
        _request: Request<pb::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        self.0.cache_events_stream()
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
