//! One request's life after validation: prefill, first token, decode, streaming, and the
//! release of everything it holds on the nodes however it ends.
//!
//! - **Prefill** on the node the policy picks (deadline: `--node-timeout`, enforced here; the
//!   request's deadline, the client's or `--request-timeout`, travels as grpc-timeout). A failure that is the node's, not the request's
//!   (unreachable, timeout, internal, out of blocks), is retried on another healthy
//!   prefill node (`--max-retries`, after a backoff, within the retry budget: [`retry`]):
//!   no token has reached the client yet. An engine panic is not retried: the request may
//!   have caused it, and would take the next node down too; the client gets INTERNAL. A node that refuses the request
//!   because its waiting queue is full (RESOURCE_EXHAUSTED) is no failure: the request goes
//!   to the next node (each tried once, without using up the retry, and none marked down);
//!   when every node refused, the client gets RESOURCE_EXHAUSTED. Decode nodes alike.
//! - The **first token** goes through the request's [`TextStream`] (incremental
//!   detokenization, stop strings) and to the client at once, with the prompt logprobs. If it
//!   already ends the request, the KV lease is released and no decode node is involved; a
//!   request with `max_tokens` 1 asks the prefill node for no lease at all
//!   (`PrefillRequest.skip_kv_lease`).
//! - **Decode** on a decode node of the prompt KV's layout (the least loaded or, with the
//!   prefix-aware policy, the one holding the prompt's earlier KV: [`crate::policy`]), with
//!   the KV handle and the request's whole `max_tokens` (the decode node counts the first
//!   token itself).
//!   The lease is released on the stream's first message, or when the request ends. A decode
//!   node that fails before its first message is replaced (as prefill nodes are) by another
//!   compatible one with the same handle (the lease is still held and the client has only
//!   seen the prefill node's token, which stays valid). One that fails after tokens went out
//!   has its stream **moved** (`--migration-limit` times at most): the prompt and the tokens
//!   sent but the last are prefilled again (mostly prefix-cache hits) under a new lease, and
//!   another decode node continues with the last token sent as its first and the others as
//!   output already made (`DecodeRequest.resumed_tokens`: max_tokens, penalties, structured
//!   output and the seeded draw go on where they were), so the client's stream has no gap and
//!   no repeat. Past the limit, or with no decode node left, the failure is UNAVAILABLE to the
//!   client. An engine panic is never moved (INTERNAL).
//! - A stop string that ends the text before the decode node finished drops the stream and
//!   calls the decode node's `Abort`.
//! - The client going away (its stream dropped), `Generation.Abort` or the deadline cancel the
//!   request: `Abort` on the prefill node if it was still prefilling, on the decode node if it
//!   was decoding, and `ReleaseKv` if a lease is held. Every node call has a deadline.
//!   A choice of a request of `n` (see [`crate::choices`]) is also cancelled by its parent's
//!   `Abort` (its switch), at once if that came before the choice started: nothing is sent to
//!   a node then.
//!
//! **Aggregated mode** (decode nodes only, see [`crate::registry`]): no prefill step. The
//! decode node is chosen by the routing policy (it computes the prompt, so prefix affinity
//! pays there), gets the request without a KV handle and streams every token, the first
//! included. A failure before its first message is retried on another decode node (the
//! client has seen nothing); after that the stream moves as above, the next decode node
//! computing the prompt and the tokens sent itself. The usage's cached tokens are then those
//! of the node that finished, within the prompt.
//!
//! The request's first chunk, whichever path sends it (the prefill node's first token, a
//! request that ends with it, aggregated mode's first decode message, an abort's last chunk),
//! carries `prompt_tokens`, the prompt's length as usage counts it; later chunks do not.
//!
//! Usage on the last chunk: the prompt's tokens, the tokens streamed to the client, and the
//! cached tokens **of the node that computed the prompt** (local + external): the computation
//! its prefix cache saved. In the cluster that is the prefill node; KV that the decode node
//! received from the prefill node was computed, not cached (ARCHITECTURE §3 rule 7). In
//! aggregated mode it is the decode node's own usage, which comes on its last message: when a
//! stop string ends the text first, the router aborts the node and waits (at most
//! [`release::CONTROL_TIMEOUT`]) for that message before it ends the client's stream.
//!
//! The client's stream ends as soon as its last chunk is sent; what the request still holds
//! on the nodes (a lease, a decode to abort) is given back after that, off the client's path.
//!
//! Parts: [`decode`] (the decode step), [`release`] (what a request holds and its release).

mod decode;
mod release;
mod retry;
mod route;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pd_engine::sampling::FinishReason;
use pd_engine::text::TextStream;
use pd_proto::convert::{finish_reason, stop_reason, wire_sampling};
use pd_proto::pb;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tonic::Status;

use self::decode::Handoff;
use self::release::{Held, Lease, abort_prefill};
use self::retry::settle_failure;
use self::route::{Preferred, hit_tokens};
use crate::disagg::Path;
use crate::error::{NodeError, NodeFailure};
use crate::registry::{Node, Role};
use crate::service::{InflightEntry, Shared};
use crate::validation::ValidRequest;

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

/// Waits until `switch` is on (at once if it is); forever if it never will be.
async fn switched_on(switch: Option<watch::Receiver<bool>>) {
    if let Some(mut switch) = switch
        && switch.wait_for(|on| *on).await.is_ok()
    {
        return;
    }
    std::future::pending::<()>().await;
}

/// Races a request's steps against its cancellation.
struct Watch {
    cancel: watch::Receiver<bool>,
    /// The switch of the request this one is a choice of: an `Abort` of that request.
    parent: Option<watch::Receiver<bool>>,
    tx: ChunkTx,
    deadline: Option<Instant>,
}

impl Watch {
    /// Whether the request, or the one it is a choice of, is aborted already.
    fn aborted(&self) -> bool {
        *self.cancel.borrow() || self.parent.as_ref().is_some_and(|p| *p.borrow())
    }

    async fn run<F: Future>(&self, fut: F) -> Result<F::Output, End> {
        let aborted = switched_on(Some(self.cancel.clone()));
        let parent_aborted = switched_on(self.parent.clone());
        let deadline = async {
            match self.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = aborted => Err(End::Aborted),
            () = parent_aborted => Err(End::Aborted),
            _ = self.tx.closed() => Err(End::ClientGone),
            _ = deadline => Err(End::Deadline),
            out = fut => Ok(out),
        }
    }
}

/// A successful Prefill.
struct Prefilled {
    node: Arc<Node>,
    first: pb::Logprob,
    /// `None` when the request ends with its first token (no lease was asked for).
    kv: Option<pb::KvHandle>,
    /// The prefill node's view: what its prefix cache saved.
    usage: pb::Usage,
    prompt_logprobs: Vec<pb::Logprob>,
}

struct Job {
    shared: Arc<Shared>,
    req: ValidRequest,
    watch: Watch,
    held: Held,
    /// The usage of the node that computed the prompt (its cached tokens reach the client).
    compute_usage: pb::Usage,
    completion_tokens: u32,
    /// The tokens sent to the client so far (a migrated stream resumes after them).
    output: Vec<u32>,
    /// Times the stream moved to another decode node (`--migration-limit`).
    migrations: u32,
    /// The request's first chunk went out (or is going: it carries `prompt_tokens`).
    started: bool,
    /// The nodes the disaggregation decision settled on.
    preferred: Preferred,
    /// The cache index's predictions for the prompt, by node id ([`Job::predict`]).
    predictions: Vec<(usize, Option<crate::metrics::Predicted>)>,
}

/// Runs one request to its end and releases what it held. The in-flight entry is dropped
/// before the last message goes out, so the client may reuse its request id right away, and
/// the client's stream ends before the release (a 1-token request does not wait for
/// `ReleaseKv`). `parent` is the switch of the request this one is a choice of, if any;
/// `deadline` is the earlier of this request's and that request's.
pub(crate) async fn run(
    shared: Arc<Shared>,
    req: ValidRequest,
    entry: InflightEntry,
    cancel: watch::Receiver<bool>,
    parent: Option<watch::Receiver<bool>>,
    tx: ChunkTx,
    deadline: Option<Instant>,
) {
    // Every request adds to the retry budget, whether or not it fails.
    shared.retries.request(std::time::Instant::now());
    let tokenizer = shared.model.tokenizer().clone();
    let mut text = TextStream::new(&tokenizer, &req.params, shared.model.eos_token_ids.clone());
    let mut job = Job {
        shared,
        req,
        watch: Watch {
            cancel,
            parent,
            tx: tx.clone(),
            deadline,
        },
        held: Held::default(),
        compute_usage: pb::Usage::default(),
        completion_tokens: 0,
        output: Vec::new(),
        migrations: 0,
        started: false,
        preferred: Preferred::default(),
        predictions: Vec::new(),
    };
    let outcome = job.drive(&mut text).await;
    let last = match outcome {
        Ok(mut chunk) => {
            chunk.stop_reason = text.stop_reason().map(stop_reason);
            job.mark_first(&mut chunk);
            Some(Ok(chunk))
        }
        Err(End::ClientGone) => {
            tracing::info!(request_id = %job.req.request_id, "client went away; request cancelled");
            None
        }
        Err(End::Aborted) => {
            tracing::info!(request_id = %job.req.request_id, "request aborted by the client");
            let mut chunk = job.chunk();
            chunk.text = text.flush();
            job.mark_first(&mut chunk);
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
    let held = std::mem::take(&mut job.held);
    // The job's watch holds a sender too: the stream ends once it and `tx` are gone.
    drop(job);
    if let Some(last) = last {
        // Fails only when the client is gone, which is fine now.
        let _ = tx.send(last).await;
    }
    drop(tx);
    held.release().await;
}

impl Job {
    async fn drive(&mut self, text: &mut TextStream<'_>) -> Result<pb::GenerateResponse, End> {
        // A choice started after its request's `Abort` (or one aborted meanwhile): nothing
        // goes to a node.
        if self.watch.aborted() {
            return Err(End::Aborted);
        }
        // Aggregated mode (no prefill nodes), or a prompt the decode node computes itself.
        if self.shared.registry.aggregated() || self.route() == Path::Local {
            return self.decode(text, None).await;
        }
        let Prefilled {
            node,
            first,
            kv,
            usage,
            prompt_logprobs,
        } = self.prefill(None).await?;
        self.compute_usage = usage;
        if let Some(kv) = &kv {
            self.held.lease = Some((node, Lease::of(kv)));
        }

        let mut chunk = self.chunk();
        chunk.prompt_logprobs = prompt_logprobs;
        if let Some((reason, _)) = self.feed(
            text,
            &mut chunk,
            std::slice::from_ref(&first),
            Role::Prefill,
        )? {
            return Ok(self.finish(chunk, reason));
        }
        let Some(kv) = kv else {
            // Not reached: a request without a lease has max_tokens 1, so the first token
            // ended it above.
            return Err(End::Failed(Status::internal(
                "the request did not end with its first token, and no KV was leased to decode \
                 the rest",
            )));
        };
        self.send(chunk).await?;
        let handoff = Handoff {
            kv,
            first_token: first.token_id,
        };
        self.decode(text, Some(handoff)).await
    }

    /// Whether the prefill node's first token ends the request whatever it is
    /// (`max_tokens` 1), so that no decode node is involved and no KV is leased.
    fn ends_with_first_token(&self) -> bool {
        self.req.params.max_tokens == 1
    }

    /// An empty chunk of this request.
    fn chunk(&self) -> pb::GenerateResponse {
        pb::GenerateResponse {
            request_id: self.req.request_id.clone(),
            ..Default::default()
        }
    }

    /// The prompt's length in tokens (after `truncate_prompt_tokens`), as usage counts it.
    fn prompt_tokens(&self) -> u32 {
        u32::try_from(self.req.prompt.len()).unwrap_or(u32::MAX)
    }

    /// Gives `chunk` the prompt's length if it is the request's first: every chunk the
    /// client gets passes here before it goes out ([`Job::send`], and [`run`] for the last).
    fn mark_first(&mut self, chunk: &mut pb::GenerateResponse) {
        if !self.started {
            self.started = true;
            chunk.prompt_tokens = Some(self.prompt_tokens());
        }
    }

    /// Marks `chunk` as the last one.
    fn finish(
        &self,
        mut chunk: pb::GenerateResponse,
        reason: FinishReason,
    ) -> pb::GenerateResponse {
        let prompt_tokens = self.prompt_tokens();
        let local = self.compute_usage.local_cached_tokens;
        let external = self.compute_usage.external_cached_tokens;
        chunk.finish_reason = finish_reason(reason) as i32;
        chunk.usage = Some(pb::Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: local.saturating_add(external),
            local_cached_tokens: local,
            external_cached_tokens: external,
            external_host_cached_tokens: self.compute_usage.external_host_cached_tokens,
            external_peer_cached_tokens: self.compute_usage.external_peer_cached_tokens,
        });
        chunk
    }

    async fn send(&mut self, mut chunk: pb::GenerateResponse) -> Result<(), End> {
        self.mark_first(&mut chunk);
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
        from: Role,
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
            self.output.push(token.token_id);
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

    /// The prompt's prefill; with `resume`, that of the prompt followed by these tokens
    /// already sent, for a stream that moves to another decode node: its first token is not
    /// used (the decode node is given the next token sent), so it is sampled greedily and
    /// without the request's constraints, and a lease is always made.
    async fn prefill(&mut self, resume: Option<&[u32]>) -> Result<Prefilled, End> {
        let mut excluded = Vec::new();
        let mut previous: Option<NodeError> = None;
        // Retries after failures so far (refusals of full nodes are not retries).
        let mut retries = 0;
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
            let node = match Preferred::take(&mut self.preferred.prefill, &candidates) {
                Some(node) => node,
                None => self.shared.pick_by_policy(&self.req, &candidates),
            };
            // What the cache index expects the node to reuse (a resumed stream's prompt is
            // longer: not compared).
            let predicted = match resume {
                None => self.predict(&node),
                Some(_) => None,
            };
            // `--disagg auto` learns the node's prefill rate from first prefills.
            let queued = (resume.is_none() && self.shared.disagg.measuring()).then(|| {
                let computed =
                    u64::from(self.prompt_tokens()).saturating_sub(hit_tokens(predicted));
                self.shared.disagg.costs.queue(node.id, computed)
            });
            let Some(permit) = node.begin() else {
                // Its breaker's one probe went to another request meanwhile.
                excluded.push(node.id);
                continue;
            };
            let node_request_id =
                (self.shared.ids).node_request_id(&self.req.tenant, &self.req.request_id);
            let mut request = tonic::Request::new(match resume {
                None => pb::PrefillRequest {
                    request_id: node_request_id.clone(),
                    token_ids: self.req.prompt.clone(),
                    sampling: Some(wire_sampling(&self.req.params)),
                    cache_salt: self.req.cache_salt.clone(),
                    // The first token ends the request: no decode node will pull its KV.
                    skip_kv_lease: self.ends_with_first_token(),
                    stop_token_ids: self.req.params.stop_token_ids.clone(),
                    ignore_eos: self.req.params.ignore_eos,
                },
                Some(sent) => pb::PrefillRequest {
                    request_id: node_request_id.clone(),
                    token_ids: [self.req.prompt.as_slice(), sent].concat(),
                    sampling: Some(pb::SamplingParams {
                        temperature: Some(0.0),
                        ..Default::default()
                    }),
                    cache_salt: self.req.cache_salt.clone(),
                    skip_kv_lease: false,
                    stop_token_ids: Vec::new(),
                    ignore_eos: true,
                },
            });
            // The request's deadline travels to the node when it is sooner than
            // --node-timeout. Otherwise the node is told none: the router enforces
            // --node-timeout itself (and aborts the node when it passes), which spares the
            // node a timer per request (the default --request-timeout is longer).
            if self
                .remaining()
                .is_some_and(|r| r < self.shared.node_timeout)
            {
                request.set_timeout(self.propagated_timeout());
            }
            self.held.prefilling = Some((node.clone(), node_request_id));
            tracing::debug!(request_id = %self.req.request_id, node = %node.addr, "prefill");
            let load = node.track();
            let mut client = node.prefill_client();
            let timeout = self.shared.node_timeout;
            let sent = Instant::now();
            let result = self
                .watch
                .run(tokio::time::timeout(timeout, client.prefill(request)))
                .await?;
            drop(load);
            let elapsed = sent.elapsed();
            let what = match result {
                Ok(Ok(response)) => {
                    self.held.prefilling = None;
                    let response = response.into_inner();
                    (self.shared.metrics).observe_report(&node, response.counters.as_ref());
                    // A node that leased anyway (one older than `skip_kv_lease`) is fine: the
                    // lease is released when the request ends, as it always was.
                    let skipped = resume.is_none() && self.ends_with_first_token();
                    match (response.first_token, response.kv) {
                        (Some(first), kv) if kv.is_some() || skipped => {
                            permit.succeeded();
                            let usage = response.usage.unwrap_or_default();
                            if let Some(predicted) = predicted {
                                (self.shared.metrics.prediction).observe(&node, predicted, &usage);
                            }
                            if let Some(queued) = queued {
                                let cached = u64::from(usage.local_cached_tokens)
                                    + u64::from(usage.external_cached_tokens);
                                let computed =
                                    u64::from(self.prompt_tokens()).saturating_sub(cached);
                                let block_bytes = kv.as_ref().map_or(0, |k| k.block_bytes);
                                self.measured_prefill(
                                    &node,
                                    computed,
                                    queued.ahead,
                                    elapsed,
                                    block_bytes,
                                );
                            }
                            return Ok(Prefilled {
                                node,
                                first,
                                kv,
                                usage,
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
                role: Role::Prefill,
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
            settle_failure(permit, &error);
            let refused = error.is_refusal();
            if refused || self.retry_after(&error, &mut retries).await? {
                if refused {
                    tracing::debug!(request_id = %self.req.request_id, %error, "prefill node full; trying another");
                } else {
                    tracing::warn!(request_id = %self.req.request_id, %error, "prefill failed; retrying on another node");
                }
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
}
