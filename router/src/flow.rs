//! One request's life after validation: prefill, first token, decode, streaming, and the
//! release of everything it holds on the nodes however it ends.
//!
//! - **Prefill** on the node the policy picks (deadline: `--node-timeout`, and the client's
//!   deadline travels as grpc-timeout). A failure that is the node's, not the request's
//!   (unreachable, timeout, internal, out of blocks), is retried once on another healthy
//!   prefill node: no token has reached the client yet.
//! - The **first token** goes through the request's [`TextStream`] (incremental
//!   detokenization, stop strings) and to the client at once, with the prompt logprobs. If it
//!   already ends the request, the KV lease is released and no decode node is involved.
//! - **Decode** on the least loaded decode node of the prompt KV's layout, with the KV handle
//!   and the request's whole `max_tokens` (the decode node counts the first token itself).
//!   The lease is released on the stream's first message, or when the request ends. A decode
//!   node that fails before its first message is replaced once by another compatible one with
//!   the same handle (the lease is still held and the client has only seen the prefill node's
//!   token, which stays valid); after that, a failure is UNAVAILABLE to the client.
//! - A stop string that ends the text before the decode node finished drops the stream and
//!   calls the decode node's `Abort`.
//! - The client going away (its stream dropped), `Generation.Abort` or the deadline cancel the
//!   request: `Abort` on the prefill node if it was still prefilling, on the decode node if it
//!   was decoding, and `ReleaseKv` if a lease is held. Every node call has a deadline.
//!
//! Usage on the last chunk: the prompt's tokens, the tokens streamed to the client, and the
//! cached tokens **of the prefill node** (local + external): the prefill computation saved.
//! KV that the decode node received from the prefill node was computed, not cached
//! (ARCHITECTURE §3 rule 7).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pd_engine::sampling::FinishReason;
use pd_engine::text::TextStream;
use pd_proto::convert::{engine_finish_reason, finish_reason, wire_sampling};
use pd_proto::pb;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tonic::{Code, Status};

use crate::error::{NodeError, NodeFailure};
use crate::registry::{Layout, Node, NodeRole};
use crate::service::{InflightEntry, Shared};
use crate::validation::ValidRequest;

/// Deadline of the calls that clean up after a request (`Abort`, `ReleaseKv`).
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) type ChunkTx = mpsc::Sender<Result<pb::GenerateResponse, Status>>;

/// Why a request stopped early.
enum End {
    /// The client dropped its response stream: nobody to tell.
    ClientGone,
    /// `Generation.Abort`: the stream ends with a chunk of finish reason ABORT.
    Aborted,
    /// The request's deadline passed.
    Deadline,
    Failed(Status),
}

/// Races a request's steps against its cancellation.
struct Watch {
    cancel: watch::Receiver<bool>,
    tx: ChunkTx,
    deadline: Option<Instant>,
}

impl Watch {
    async fn run<F: Future>(&self, fut: F) -> Result<F::Output, End> {
        let mut cancel = self.cancel.clone();
        let aborted = async move {
            if cancel.wait_for(|c| *c).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let deadline = async {
            match self.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = aborted => Err(End::Aborted),
            _ = self.tx.closed() => Err(End::ClientGone),
            _ = deadline => Err(End::Deadline),
            out = fut => Ok(out),
        }
    }
}

/// What the request holds on the nodes right now; released by [`Job::release_all`].
#[derive(Default)]
struct Held {
    /// A Prefill call in progress: (node, node request id).
    prefilling: Option<(Arc<Node>, String)>,
    /// A KV lease on a prefill node.
    lease: Option<(Arc<Node>, u64)>,
    /// A decode in progress: (node, node request id).
    decoding: Option<(Arc<Node>, String)>,
}

/// A successful Prefill.
struct Prefilled {
    node: Arc<Node>,
    first: pb::Logprob,
    kv: pb::KvHandle,
    /// The prefill node's view: what its prefix cache saved.
    usage: pb::Usage,
    prompt_logprobs: Vec<pb::Logprob>,
}

/// How a decode attempt failed.
enum DecodeEnd {
    End(End),
    Node {
        error: NodeError,
        /// The node had sent at least one message (the lease is released, tokens went out).
        streamed: bool,
    },
}

struct Job {
    shared: Arc<Shared>,
    req: ValidRequest,
    watch: Watch,
    held: Held,
    prefill_usage: pb::Usage,
    completion_tokens: u32,
}

/// Runs one request to its end and releases what it held. The in-flight entry is dropped
/// before the last message goes out, so the client may reuse its request id right away.
pub(crate) async fn run(
    shared: Arc<Shared>,
    req: ValidRequest,
    entry: InflightEntry,
    cancel: watch::Receiver<bool>,
    tx: ChunkTx,
    deadline: Option<Instant>,
) {
    let tokenizer = shared.model.tokenizer().clone();
    let mut text = TextStream::new(&tokenizer, &req.params, shared.model.eos_token_ids.clone());
    let mut job = Job {
        shared,
        req,
        watch: Watch {
            cancel,
            tx: tx.clone(),
            deadline,
        },
        held: Held::default(),
        prefill_usage: pb::Usage::default(),
        completion_tokens: 0,
    };
    let outcome = job.drive(&mut text).await;
    let last = match outcome {
        Ok(chunk) => Some(Ok(chunk)),
        Err(End::ClientGone) => {
            tracing::info!(request_id = %job.req.request_id, "client went away; request cancelled");
            None
        }
        Err(End::Aborted) => {
            tracing::info!(request_id = %job.req.request_id, "request aborted by the client");
            let mut chunk = job.chunk();
            chunk.text = text.flush();
            Some(Ok(job.finish(chunk, FinishReason::Abort)))
        }
        Err(End::Deadline) => Some(Err(Status::deadline_exceeded(format!(
            "the request's deadline (the client's grpc-timeout, or the router's \
                 --request-timeout) passed after {} generated tokens",
            job.completion_tokens
        )))),
        Err(End::Failed(status)) => {
            tracing::warn!(request_id = %job.req.request_id, code = ?status.code(), message = status.message(), "request failed");
            Some(Err(status))
        }
    };
    drop(entry);
    let send = async {
        if let Some(last) = last {
            // Fails only when the client is gone, which is fine now.
            let _ = tx.send(last).await;
        }
    };
    tokio::join!(send, job.release_all());
}

impl Job {
    async fn drive(&mut self, text: &mut TextStream<'_>) -> Result<pb::GenerateResponse, End> {
        let Prefilled {
            node,
            first,
            kv,
            usage,
            prompt_logprobs,
        } = self.prefill().await?;
        self.prefill_usage = usage;
        self.held.lease = Some((node, kv.lease_id));

        let mut chunk = self.chunk();
        chunk.prompt_logprobs = prompt_logprobs;
        if let Some((reason, _)) = self.feed(
            text,
            &mut chunk,
            std::slice::from_ref(&first),
            NodeRole::Prefill,
        )? {
            return Ok(self.finish(chunk, reason));
        }
        self.send(chunk).await?;
        self.decode(text, &kv, first.token_id).await
    }

    /// An empty chunk of this request.
    fn chunk(&self) -> pb::GenerateResponse {
        pb::GenerateResponse {
            request_id: self.req.request_id.clone(),
            ..Default::default()
        }
    }

    /// Marks `chunk` as the last one.
    fn finish(
        &self,
        mut chunk: pb::GenerateResponse,
        reason: FinishReason,
    ) -> pb::GenerateResponse {
        let prompt_tokens = u32::try_from(self.req.prompt.len()).unwrap_or(u32::MAX);
        let local = self.prefill_usage.local_cached_tokens;
        let external = self.prefill_usage.external_cached_tokens;
        chunk.finish_reason = finish_reason(reason) as i32;
        chunk.usage = Some(pb::Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: local.saturating_add(external),
            local_cached_tokens: local,
            external_cached_tokens: external,
        });
        chunk
    }

    async fn send(&self, chunk: pb::GenerateResponse) -> Result<(), End> {
        self.watch
            .run(self.watch.tx.send(Ok(chunk)))
            .await?
            .map_err(|_| End::ClientGone)
    }

    /// The time left before the request's deadline.
    fn remaining(&self) -> Option<Duration> {
        self.watch
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// grpc-timeout for a node call: the node timeout, or less if the request ends sooner.
    fn propagated_timeout(&self) -> Duration {
        let node = self.shared.node_timeout;
        self.remaining().map_or(node, |r| r.min(node))
    }

    /// Feeds tokens to the text stream into `chunk`; `Some((reason, all_consumed))` once the
    /// request is finished (tokens after the finishing one are dropped).
    fn feed(
        &mut self,
        text: &mut TextStream<'_>,
        chunk: &mut pb::GenerateResponse,
        tokens: &[pb::Logprob],
        from: NodeRole,
    ) -> Result<Option<(FinishReason, bool)>, End> {
        let logprobs = self.req.wants_logprobs();
        for (i, token) in tokens.iter().enumerate() {
            let decision = text.push(token.token_id).map_err(|e| {
                End::Failed(Status::internal(format!(
                    "the {from} node produced token id {}, which has no text: {e}",
                    token.token_id
                )))
            })?;
            chunk.token_ids.push(token.token_id);
            if logprobs {
                chunk.logprobs.push(token.clone());
            }
            chunk.text.push_str(&decision.text);
            self.completion_tokens += 1;
            if let Some(reason) = decision.finished {
                return Ok(Some((reason, i + 1 == tokens.len())));
            }
        }
        Ok(None)
    }

    // ---- prefill -------------------------------------------------------------------------

    async fn prefill(&mut self) -> Result<Prefilled, End> {
        let mut excluded = Vec::new();
        let mut previous: Option<NodeError> = None;
        loop {
            let candidates = match self.shared.registry.prefill_candidates(&excluded) {
                Ok(c) => c,
                Err(e) => {
                    return Err(End::Failed(match previous {
                        None => e.into(),
                        Some(prev) => Status::new(
                            prev.client_code(),
                            format!("{prev}; no other prefill node to retry on: {e}"),
                        ),
                    }));
                }
            };
            let node = self.shared.pick_prefill(&self.req, &candidates);
            let node_request_id = self.shared.ids.node_request_id(&self.req.request_id);
            let mut request = tonic::Request::new(pb::PrefillRequest {
                request_id: node_request_id.clone(),
                token_ids: self.req.prompt.clone(),
                sampling: Some(wire_sampling(&self.req.params)),
                cache_salt: self.req.cache_salt.clone(),
            });
            request.set_timeout(self.propagated_timeout());
            self.held.prefilling = Some((node.clone(), node_request_id));
            tracing::debug!(request_id = %self.req.request_id, node = %node.addr, "prefill");
            let load = node.track();
            let mut client = node.prefill_client();
            let timeout = self.shared.node_timeout;
            let result = self
                .watch
                .run(tokio::time::timeout(timeout, client.prefill(request)))
                .await?;
            drop(load);
            let what = match result {
                Ok(Ok(response)) => {
                    self.held.prefilling = None;
                    let response = response.into_inner();
                    (self.shared.metrics).observe_report(&node, response.counters.as_ref());
                    match (response.first_token, response.kv) {
                        (Some(first), Some(kv)) => {
                            return Ok(Prefilled {
                                node,
                                first,
                                kv,
                                usage: response.usage.unwrap_or_default(),
                                prompt_logprobs: response.prompt_logprobs,
                            });
                        }
                        _ => NodeFailure::Protocol(
                            "Prefill answered without a first token or KV handle".into(),
                        ),
                    }
                }
                Ok(Err(status)) => NodeFailure::from_status(status),
                Err(_) => NodeFailure::Timeout(timeout),
            };
            let error = NodeError {
                role: NodeRole::Prefill,
                addr: node.addr.clone(),
                what,
            };
            // It may still run there (a timeout), or hold a lease we never saw.
            if let Some((node, id)) = self.held.prefilling.take() {
                tokio::spawn(abort_prefill(node, id));
            }
            if error.marks_node_down() {
                node.mark_down(error.what.to_string());
            }
            if previous.is_none() && error.is_retryable() {
                tracing::warn!(request_id = %self.req.request_id, %error, "prefill failed; retrying on another node");
                excluded.push(node.id);
                previous = Some(error);
                continue;
            }
            let message = match previous {
                None => error.to_string(),
                Some(prev) => format!("{prev}; retried: {error}"),
            };
            return Err(End::Failed(Status::new(error.client_code(), message)));
        }
    }

    // ---- decode --------------------------------------------------------------------------

    async fn decode(
        &mut self,
        text: &mut TextStream<'_>,
        kv: &pb::KvHandle,
        first_token: u32,
    ) -> Result<pb::GenerateResponse, End> {
        let layout = Layout {
            fingerprint: kv.layout_fingerprint.clone(),
            block_size: kv.block_size,
        };
        let mut excluded = Vec::new();
        let mut previous: Option<NodeError> = None;
        loop {
            let candidates = match self.shared.registry.decode_candidates(&layout, &excluded) {
                Ok(c) => c,
                Err(e) => {
                    let message = match &previous {
                        None => e.to_string(),
                        Some(prev) => format!("{prev}; no other decode node to retry on: {e}"),
                    };
                    return Err(self.failed_after_tokens(message));
                }
            };
            let node = self.shared.pick_decode(&self.req, &candidates);
            match self.decode_on(&node, text, kv, first_token).await {
                Ok(last) => return Ok(last),
                Err(DecodeEnd::End(end)) => return Err(end),
                Err(DecodeEnd::Node { error, streamed }) => {
                    if let Some((node, id)) = self.held.decoding.take() {
                        tokio::spawn(abort_decode(node, id));
                    }
                    if error.marks_node_down() {
                        node.mark_down(error.what.to_string());
                    }
                    let lease_held = self.held.lease.is_some();
                    if !streamed && lease_held && previous.is_none() && error.is_retryable() {
                        tracing::warn!(request_id = %self.req.request_id, %error, "decode failed before its first token; retrying on another node");
                        excluded.push(node.id);
                        previous = Some(error);
                        continue;
                    }
                    let message = match previous {
                        None => error.to_string(),
                        Some(prev) => format!("{prev}; retried: {error}"),
                    };
                    return Err(self.failed_after_tokens(message));
                }
            }
        }
    }

    fn failed_after_tokens(&self, cause: String) -> End {
        End::Failed(Status::new(
            Code::Unavailable,
            format!(
                "the request failed after {} tokens were streamed and cannot be resumed: {cause}",
                self.completion_tokens
            ),
        ))
    }

    async fn decode_on(
        &mut self,
        node: &Arc<Node>,
        text: &mut TextStream<'_>,
        kv: &pb::KvHandle,
        first_token: u32,
    ) -> Result<pb::GenerateResponse, DecodeEnd> {
        let params = &self.req.params;
        let node_request_id = self.shared.ids.node_request_id(&self.req.request_id);
        let mut request = tonic::Request::new(pb::DecodeRequest {
            request_id: node_request_id.clone(),
            prompt_token_ids: self.req.prompt.clone(),
            first_token,
            sampling: Some(wire_sampling(params)),
            max_tokens: params.max_tokens,
            stop_token_ids: params.stop_token_ids.clone(),
            ignore_eos: params.ignore_eos,
            cache_salt: self.req.cache_salt.clone(),
            kv: Some(kv.clone()),
        });
        if let Some(remaining) = self.remaining() {
            request.set_timeout(remaining);
        }
        self.held.decoding = Some((node.clone(), node_request_id));
        tracing::debug!(request_id = %self.req.request_id, node = %node.addr, "decode");
        let _load = node.track();
        let mut client = node.decode_client();
        let timeout = self.shared.node_timeout;
        let node_error = |what: NodeFailure, streamed: bool| DecodeEnd::Node {
            error: NodeError {
                role: NodeRole::Decode,
                addr: node.addr.clone(),
                what,
            },
            streamed,
        };
        let opened = self
            .watch
            .run(tokio::time::timeout(timeout, client.decode(request)))
            .await
            .map_err(DecodeEnd::End)?;
        let mut stream = match opened {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => return Err(node_error(NodeFailure::from_status(status), false)),
            Err(_) => return Err(node_error(NodeFailure::Timeout(timeout), false)),
        };
        let mut streamed = false;
        loop {
            let next = self
                .watch
                .run(tokio::time::timeout(timeout, stream.message()))
                .await
                .map_err(DecodeEnd::End)?;
            let message = match next {
                Ok(Ok(Some(m))) => m,
                Ok(Ok(None)) => {
                    return Err(node_error(
                        NodeFailure::Protocol(
                            "the decode stream ended without a finish reason".into(),
                        ),
                        streamed,
                    ));
                }
                Ok(Err(status)) => {
                    return Err(node_error(NodeFailure::from_status(status), streamed));
                }
                Err(_) => return Err(node_error(NodeFailure::Timeout(timeout), streamed)),
            };
            (self.shared.metrics).observe_report(node, message.counters.as_ref());
            if !streamed {
                streamed = true;
                // The decode node has the KV now (or its own copy of the prefix).
                if let Some((node, lease)) = self.held.lease.take() {
                    tokio::spawn(release_kv(node, lease));
                }
            }
            let mut chunk = self.chunk();
            let ours = self
                .feed(text, &mut chunk, &message.tokens, NodeRole::Decode)
                .map_err(DecodeEnd::End)?;
            let theirs = engine_finish_reason(message.finish_reason());
            match (ours, theirs) {
                (Some((reason, all_consumed)), _) => {
                    if theirs.is_some() && all_consumed {
                        // The node finished at the same token: nothing to abort.
                        self.held.decoding = None;
                    }
                    return Ok(self.finish(chunk, reason));
                }
                (None, Some(reason)) => {
                    // The node ended it (context length, its own abort): flush held-back text.
                    chunk.text.push_str(&text.flush());
                    self.held.decoding = None;
                    return Ok(self.finish(chunk, reason));
                }
                (None, None) => {
                    if !chunk.token_ids.is_empty() {
                        self.send(chunk).await.map_err(DecodeEnd::End)?;
                    }
                }
            }
        }
    }

    // ---- cleanup -------------------------------------------------------------------------

    /// Aborts what still runs on the nodes and releases the lease, concurrently.
    async fn release_all(&mut self) {
        let held = std::mem::take(&mut self.held);
        let prefill = async {
            if let Some((node, id)) = held.prefilling {
                abort_prefill(node, id).await;
            }
        };
        let decode = async {
            if let Some((node, id)) = held.decoding {
                abort_decode(node, id).await;
            }
        };
        let lease = async {
            if let Some((node, lease)) = held.lease {
                release_kv(node, lease).await;
            }
        };
        tokio::join!(prefill, decode, lease);
    }
}

async fn control<T>(
    what: &str,
    node: &Node,
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) {
    match tokio::time::timeout(CONTROL_TIMEOUT, call).await {
        Ok(Ok(_)) => {}
        Ok(Err(status)) => {
            tracing::warn!(node = %node.addr, role = %node.role, code = ?status.code(), message = status.message(), "{what} failed")
        }
        Err(_) => {
            tracing::warn!(node = %node.addr, role = %node.role, "{what} did not answer within {CONTROL_TIMEOUT:?}")
        }
    }
}

fn control_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CONTROL_TIMEOUT);
    request
}

async fn abort_prefill(node: Arc<Node>, request_id: String) {
    let mut client = node.prefill_client();
    let request = control_request(pb::NodeAbortRequest { request_id });
    control("Abort", &node, client.abort(request)).await;
}

async fn abort_decode(node: Arc<Node>, request_id: String) {
    let mut client = node.decode_client();
    let request = control_request(pb::NodeAbortRequest { request_id });
    control("Abort", &node, client.abort(request)).await;
}

async fn release_kv(node: Arc<Node>, lease_id: u64) {
    let mut client = node.prefill_client();
    let request = control_request(pb::ReleaseKvRequest { lease_id });
    control("ReleaseKv", &node, client.release_kv(request)).await;
}
