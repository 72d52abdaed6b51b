//! The decode step of a request: a decode node chosen among the compatible ones, its stream
//! turned into the client's chunks, retries while the client cannot tell, and in aggregated
//! mode the node's own usage and prompt logprobs (see the parent module's doc).

use std::sync::Arc;

use pd_engine::text::TextStream;
use pd_proto::convert::{engine_finish_reason, wire_sampling};
use pd_proto::pb;
use tonic::Code;
use tonic::Status;

use super::release::{CONTROL_TIMEOUT, Lease, abort_decode, release_kv};
use super::retry::settle_failure;
use super::route::{Preferred, hit_tokens};
use super::{End, Job};
use crate::error::{NodeError, NodeFailure};
use crate::metrics::Predicted;
use crate::registry::{Layout, Node, Permit, Role};

/// How a decode attempt failed.
pub(super) enum DecodeEnd {
    End(End),
    Node {
        error: NodeError,
        /// The node had sent at least one message (the lease is released, tokens went out).
        streamed: bool,
    },
}

/// What a decode node is given in the cluster: the prefill node's KV and first token (for a
/// migrated stream: the KV of the prompt and the tokens sent but the last, and that last one).
/// None in aggregated mode (the decode node computes the prompt itself).
#[derive(Clone)]
pub(super) struct Handoff {
    pub kv: pb::KvHandle,
    pub first_token: u32,
}

impl Job {
    pub(super) async fn decode(
        &mut self,
        text: &mut TextStream<'_>,
        mut handoff: Option<Handoff>,
    ) -> Result<pb::GenerateResponse, End> {
        let mut excluded = Vec::new();
        let mut previous: Option<NodeError> = None;
        // Retries after failures so far (refusals of full nodes are not retries).
        let mut retries = 0;
        loop {
            let layout = handoff.as_ref().map(kv_layout);
            let candidates = match (self.shared.registry)
                .decode_candidates(layout.as_ref().map(|(l, a)| (l, *a)), &excluded)
            {
                Ok(c) => c,
                Err(e) => {
                    let code = match &previous {
                        None => e.code(),
                        Some(prev) => prev.client_code(),
                    };
                    let message = match &previous {
                        None => e.to_string(),
                        Some(prev) => format!("{prev}; no other decode node to retry on: {e}"),
                    };
                    return Err(self.failed(code, message));
                }
            };
            let preferred = Preferred::take(&mut self.preferred.decode, &candidates);
            let node = match (preferred, &handoff) {
                (Some(node), _) => node,
                (None, Some(_)) => self.shared.pick_decode(&self.req, &candidates),
                // The decode node computes the prompt: the policy's prefix affinity applies.
                (None, None) => self.shared.pick_by_policy(&self.req, &candidates),
            };
            let Some(permit) = node.begin() else {
                // Its breaker's one probe went to another request meanwhile.
                excluded.push(node.id);
                continue;
            };
            // Settled by the node's first message; else by the failure below.
            let mut permit = Some(permit);
            match self
                .decode_on(&node, text, handoff.as_ref(), &mut permit)
                .await
            {
                Ok(last) => return Ok(last),
                Err(DecodeEnd::End(end)) => return Err(end),
                Err(DecodeEnd::Node { error, streamed }) => {
                    if let Some((node, id)) = self.held.decoding.take() {
                        tokio::spawn(abort_decode(node, id));
                    }
                    if error.marks_node_down() {
                        node.mark_down(error.what.to_string());
                    }
                    if let Some(permit) = permit {
                        settle_failure(permit, &error);
                    }
                    if self.kv_gone(&error, &handoff) {
                        // The prefill node's KV could not be pulled (it died, or the lease
                        // expired) after the client saw the first token: another decode node
                        // would pull the same lease. Prefill again, on a live prefill node,
                        // and keep this decode node as a candidate.
                        self.migrations += 1;
                        self.shared.metrics.resilience.migrated();
                        tracing::warn!(request_id = %self.req.request_id, %error, "the prefill node's KV is gone; prefilling again");
                        if let Some((node, lease)) = self.held.lease.take() {
                            tokio::spawn(release_kv(node, lease));
                        }
                        handoff = Some(self.prefill_again().await?);
                        previous = Some(error);
                        continue;
                    }
                    excluded.push(node.id);
                    if streamed && self.may_migrate(&error) && self.can_move(&handoff, &excluded) {
                        self.migrations += 1;
                        self.shared.metrics.resilience.migrated();
                        tracing::warn!(request_id = %self.req.request_id, %error, sent = self.output.len(), "decode node failed mid-stream; resuming on another node");
                        if handoff.is_some() {
                            handoff = Some(self.prefill_again().await?);
                        }
                        previous = Some(error);
                        continue;
                    }
                    // Retried only while the client cannot tell: in the cluster the lease is
                    // still held, so another decode node can pull the same KV.
                    let resumable = handoff.is_none() || self.held.lease.is_some();
                    let refused = error.is_refusal();
                    if !streamed
                        && resumable
                        && (refused || self.retry_after(&error, &mut retries).await?)
                    {
                        if refused {
                            tracing::debug!(request_id = %self.req.request_id, %error, "decode node full; trying another");
                        } else {
                            tracing::warn!(request_id = %self.req.request_id, %error, "decode failed before its first token; retrying on another node");
                        }
                        previous = Some(error);
                        continue;
                    }
                    let code = error.client_code();
                    let message = match previous {
                        None => error.to_string(),
                        Some(prev) => format!("{prev}; retried: {error}"),
                    };
                    return Err(self.failed(code, message));
                }
            }
        }
    }

    /// Whether a stream whose decode node failed after tokens went out moves to another one:
    /// the node failed (not the request, not by a panic it may have caused), and the
    /// request has moves left.
    fn may_migrate(&self, error: &NodeError) -> bool {
        self.migrations < self.shared.migration_limit
            && error.is_retryable()
            && !error.is_refusal()
            && !self.output.is_empty()
    }

    /// Whether a decode node's failure to pull the stream's KV moves the stream to KV
    /// prefilled again: the client has seen tokens (so the failure cannot stay silent), and
    /// the request has moves left.
    fn kv_gone(&self, error: &NodeError, handoff: &Option<Handoff>) -> bool {
        error.is_kv_pull_failure()
            && handoff.is_some()
            && !self.output.is_empty()
            && self.migrations < self.shared.migration_limit
    }

    /// Whether a decode node is there to take the stream (before its KV is prefilled again
    /// for nothing).
    fn can_move(&self, handoff: &Option<Handoff>, excluded: &[usize]) -> bool {
        let layout = handoff.as_ref().map(kv_layout);
        (self.shared.registry)
            .decode_candidates(layout.as_ref().map(|(l, a)| (l, *a)), excluded)
            .is_ok()
    }

    /// A moved stream's KV in the cluster: the prompt and the tokens sent but the last
    /// prefilled again (the prefill node's prefix cache makes most of it a hit), leased for
    /// the next decode node, which is given the last token sent as its first.
    async fn prefill_again(&mut self) -> Result<Handoff, End> {
        let (&last, sent) = self
            .output
            .split_last()
            .expect("may_migrate: tokens were sent");
        let sent = sent.to_vec();
        let prefilled = self.prefill(Some(&sent)).await?;
        let Some(kv) = prefilled.kv else {
            return Err(End::Failed(Status::internal(
                "the prefill node answered a resumed stream's prefill without a KV handle",
            )));
        };
        self.held.lease = Some((prefilled.node, Lease::of(&kv)));
        Ok(Handoff {
            kv,
            first_token: last,
        })
    }

    /// A decode failure's end: `code` while the client has seen no token (aggregated mode),
    /// else UNAVAILABLE, for a stream that cannot be resumed; but INTERNAL stays INTERNAL
    /// (an engine panic: trying the request again is no cure).
    fn failed(&self, code: Code, cause: String) -> End {
        if self.completion_tokens == 0 {
            return End::Failed(Status::new(code, cause));
        }
        let code = match code {
            Code::Internal => Code::Internal,
            _ => Code::Unavailable,
        };
        End::Failed(Status::new(
            code,
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
        handoff: Option<&Handoff>,
        permit: &mut Option<Permit>,
    ) -> Result<pb::GenerateResponse, DecodeEnd> {
        let node_request_id =
            (self.shared.ids).node_request_id(&self.req.tenant, &self.req.request_id);
        // Tokens already sent that the node takes as output: all of them in aggregated mode,
        // all but the last (its first token) with a KV handle. None on a first attempt.
        let resumed = self.output.len() - usize::from(handoff.is_some() && !self.output.is_empty());
        // What the cache index expects the node to reuse of the prompt (a resumed stream's
        // prompt is longer: not compared).
        let predicted = match resumed {
            0 => self.predict(node),
            _ => None,
        };
        let params = &self.req.params;
        let mut sampling = wire_sampling(params);
        if resumed > 0 {
            // Scored on the stream's first attempt already.
            sampling.prompt_logprobs = None;
        }
        let mut request = tonic::Request::new(pb::DecodeRequest {
            request_id: node_request_id.clone(),
            prompt_token_ids: [self.req.prompt.as_slice(), &self.output[..resumed]].concat(),
            first_token: handoff.map_or(0, |h| h.first_token),
            sampling: Some(sampling),
            max_tokens: params.max_tokens,
            stop_token_ids: params.stop_token_ids.clone(),
            ignore_eos: params.ignore_eos,
            cache_salt: self.req.cache_salt.clone(),
            kv: handoff.map(|h| h.kv.clone()),
            resumed_tokens: u32::try_from(resumed).unwrap_or(u32::MAX),
        });
        if let Some(remaining) = self.remaining() {
            request.set_timeout(remaining);
        }
        self.held.decoding = Some((node.clone(), node_request_id));
        tracing::debug!(request_id = %self.req.request_id, node = %node.addr, "decode");
        // `--disagg auto` learns from first attempts: the decode node's own prefill rate, or
        // the transfer rate from the prefill node holding the lease; and every stream's steps.
        let measuring = self.shared.disagg.measuring();
        let mut queued = (measuring && resumed == 0 && handoff.is_none()).then(|| {
            let computed = u64::from(self.prompt_tokens()).saturating_sub(hit_tokens(predicted));
            self.shared.disagg.costs.queue(node.id, computed)
        });
        // A pull in flight slows the node's other streams: their steps are filed apart.
        let mut pulling = (measuring && resumed == 0 && handoff.is_some())
            .then(|| self.shared.disagg.costs.pull(node.id));
        let pulled_from = self.held.lease.as_ref().map(|(n, _)| n.clone());
        let sent = tokio::time::Instant::now();
        let mut last_message = sent;
        let _load = node.track();
        let mut client = node.decode_client();
        let timeout = self.shared.node_timeout;
        let node_error = |what: NodeFailure, streamed: bool| DecodeEnd::Node {
            error: NodeError {
                role: Role::Decode,
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
            let mut message = match next {
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
            if measuring {
                let now = tokio::time::Instant::now();
                if !streamed && resumed == 0 {
                    let kv = handoff.map(|h| &h.kv);
                    let from_kv = pulled_from.as_deref().zip(kv);
                    let ahead = queued.take().map_or(0, |q| q.ahead);
                    drop(pulling.take());
                    self.measured_first_message(node, from_kv, predicted, ahead, now - sent);
                } else if streamed && !message.tokens.is_empty() {
                    let gap = (now - last_message).as_secs_f64() / message.tokens.len() as f64;
                    self.shared.disagg.costs.stepped(node.id, gap);
                }
                last_message = now;
            }
            if !streamed {
                streamed = true;
                // The node serves: its breaker hears so (a later failure of this stream
                // marks it down if the node broke, see `NodeError::marks_node_down`).
                if let Some(permit) = permit.take() {
                    permit.succeeded();
                }
                // The decode node has the KV now (or its own copy of the prefix).
                if let Some((node, lease)) = self.held.lease.take() {
                    tokio::spawn(release_kv(node, lease));
                }
            }
            let mut chunk = self.chunk();
            // Aggregated mode: the node computed the prompt, and its logprobs come with the
            // first token.
            chunk.prompt_logprobs = std::mem::take(&mut message.prompt_logprobs);
            let ours = self
                .feed(text, &mut chunk, &message.tokens, Role::Decode)
                .map_err(DecodeEnd::End)?;
            let theirs = engine_finish_reason(message.finish_reason());
            let mut last = (theirs.is_some()).then_some(message);
            match (ours, theirs) {
                (Some((reason, all_consumed)), _) => {
                    if theirs.is_some() && all_consumed {
                        // The node finished at the same token: nothing to abort.
                        self.held.decoding = None;
                    } else if handoff.is_none() {
                        last = self.abort_for_last_message(&mut stream).await;
                    } else if theirs.is_none() {
                        // PD: the node's last message (ending by itself, or after the abort
                        // the release sends) carries its counters; take them as soon as they
                        // come, without holding the client's end for them.
                        tokio::spawn(observe_last_report(
                            self.shared.metrics.clone(),
                            node.clone(),
                            stream,
                            predicted,
                        ));
                    }
                    observe_prediction(&self.shared.metrics, node, predicted, last.as_ref());
                    self.take_compute_usage(handoff, last);
                    return Ok(self.finish(chunk, reason));
                }
                (None, Some(reason)) => {
                    // The node ended it (context length, its own abort): flush held-back text.
                    chunk.text.push_str(&text.flush());
                    self.held.decoding = None;
                    observe_prediction(&self.shared.metrics, node, predicted, last.as_ref());
                    self.take_compute_usage(handoff, last);
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

    /// Aggregated mode, the text ended before the node did: aborts the node's request and
    /// waits (at most [`CONTROL_TIMEOUT`]) for its last message, which carries its usage.
    async fn abort_for_last_message(
        &mut self,
        stream: &mut tonic::Streaming<pb::DecodeResponse>,
    ) -> Option<pb::DecodeResponse> {
        let (node, id) = self.held.decoding.take()?;
        abort_decode(node.clone(), id).await;
        let metrics = &self.shared.metrics;
        let last = async {
            while let Ok(Some(message)) = stream.message().await {
                metrics.observe_report(&node, message.counters.as_ref());
                if message.finish_reason() != pb::FinishReason::Unspecified {
                    return Some(message);
                }
            }
            None
        };
        tokio::time::timeout(CONTROL_TIMEOUT, last)
            .await
            .ok()
            .flatten()
    }

    /// Aggregated mode: the decode node computed the prompt, so its last message's usage is
    /// the one the client gets.
    fn take_compute_usage(&mut self, handoff: Option<&Handoff>, last: Option<pb::DecodeResponse>) {
        if handoff.is_some() {
            return;
        }
        let Some(last) = last else {
            tracing::warn!(request_id = %self.req.request_id, "the decode node's usage did not arrive; cached tokens reported as 0");
            return;
        };
        let mut usage = last.usage.unwrap_or_default();
        if self.migrations > 0 {
            // The node that finished computed the prompt followed by the tokens sent before
            // it took over; the client's prompt is the part of its hits (a prefix) that the
            // prompt covers. The first node's own usage died with it.
            let prompt = self.prompt_tokens();
            usage.local_cached_tokens = usage.local_cached_tokens.min(prompt);
            usage.external_cached_tokens =
                (usage.external_cached_tokens).min(prompt - usage.local_cached_tokens);
            // The split by source keeps summing to the external hits: the host tier's
            // restore continues the device prefix, so it is kept first.
            let external = usage.external_cached_tokens;
            usage.external_host_cached_tokens = usage.external_host_cached_tokens.min(external);
            usage.external_peer_cached_tokens = (usage.external_peer_cached_tokens)
                .min(external - usage.external_host_cached_tokens);
        }
        self.compute_usage = usage;
    }
}

/// The KV layout a decode node must have to take `h`, and the prefill node it pulls from.
fn kv_layout(h: &Handoff) -> (Layout, &str) {
    let layout = Layout {
        fingerprint: h.kv.layout_fingerprint.clone(),
        block_size: h.kv.block_size,
    };
    (layout, h.kv.addr.as_str())
}

/// Counts what the index predicted `node` would reuse next to what its last message's usage
/// says it reused ([`crate::metrics`]' predictions), when there was a prediction and a usage.
fn observe_prediction(
    metrics: &crate::metrics::RouterMetrics,
    node: &Node,
    predicted: Option<Predicted>,
    last: Option<&pb::DecodeResponse>,
) {
    if let (Some(predicted), Some(usage)) = (predicted, last.and_then(|m| m.usage.as_ref())) {
        metrics.prediction.observe(node, predicted, usage);
    }
}

/// Reads a decode stream the client no longer needs up to its last message (at most
/// [`CONTROL_TIMEOUT`]) so the node's final counter report (and its usage, next to the
/// index's prediction) reaches the metrics at once rather than with the next `Info` poll.
async fn observe_last_report(
    metrics: Arc<crate::metrics::RouterMetrics>,
    node: Arc<Node>,
    mut stream: tonic::Streaming<pb::DecodeResponse>,
    predicted: Option<Predicted>,
) {
    let last = async {
        while let Ok(Some(message)) = stream.message().await {
            metrics.observe_report(&node, message.counters.as_ref());
            if message.finish_reason() != pb::FinishReason::Unspecified {
                observe_prediction(&metrics, &node, predicted, Some(&message));
                return;
            }
        }
    };
    let _ = tokio::time::timeout(CONTROL_TIMEOUT, last).await;
}
