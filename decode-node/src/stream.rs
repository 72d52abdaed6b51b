//! The response stream of one `Decode`: the engine's events for the request turned into
//! `DecodeResponse` messages (tokens batched when several are waiting, the prompt's logprobs
//! with the first token, the finish reason, usage and the node's counters on the last), an
//! engine failure reported after the tokens before it. Validating and admitting the request
//! is the service's (lib.rs).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pd_engine::serve::RequestEvent;
use pd_node::requests::{engine_gone, engine_status};
use pd_node::{NodeMetrics, RequestGuard};
use pd_proto::convert;
use pd_proto::pb;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::Stream;
use tonic::Status;

/// The response stream of one `Decode`: engine events into messages. Dropping it before the
/// end (the client went away) aborts the engine request.
pub struct DecodeStream {
    events: UnboundedReceiver<RequestEvent>,
    guard: RequestGuard,
    /// For the counters on the last message.
    metrics: Arc<NodeMetrics>,
    /// An engine failure to report after the tokens that came before it.
    pending_error: Option<Status>,
    /// The prompt's logprobs, held for the message of the first token (the engine sends them
    /// just before it).
    prompt_logprobs: Vec<pb::Logprob>,
    done: bool,
}

impl DecodeStream {
    /// The stream of the request `guard` holds, fed by `events`.
    pub(crate) fn new(
        events: UnboundedReceiver<RequestEvent>,
        guard: RequestGuard,
        metrics: Arc<NodeMetrics>,
    ) -> Self {
        Self {
            events,
            guard,
            metrics,
            pending_error: None,
            prompt_logprobs: Vec::new(),
            done: false,
        }
    }
}

impl std::fmt::Debug for DecodeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStream")
            .field("request_id", self.guard.id())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Stream for DecodeStream {
    type Item = Result<pb::DecodeResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(e) = this.pending_error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let mut event = loop {
            let Some(event) = std::task::ready!(this.events.poll_recv(cx)) else {
                this.done = true;
                this.guard.finished();
                return Poll::Ready(Some(Err(engine_gone())));
            };
            match event {
                RequestEvent::PromptLogprobs(scores) => {
                    this.prompt_logprobs = scores.iter().map(convert::prompt_logprob).collect();
                }
                event => break event,
            }
        };
        let mut msg = pb::DecodeResponse {
            // Only a prompt computed here (no KV handle) has them.
            prompt_logprobs: std::mem::take(&mut this.prompt_logprobs),
            ..Default::default()
        };
        // Events already queued travel in one message; none is waited for.
        loop {
            match event {
                RequestEvent::Token(t) => msg.tokens.push(convert::logprob(&t)),
                // Before any token: only the first event can be these (taken above).
                RequestEvent::PromptLogprobs(scores) => {
                    this.prompt_logprobs = scores.iter().map(convert::prompt_logprob).collect();
                    break;
                }
                RequestEvent::Finished(f) => {
                    msg.finish_reason = convert::finish_reason(f.reason) as i32;
                    msg.usage = Some(convert::usage(&f.usage));
                    // The engine publishes its counters before delivering the end: this
                    // request's counts are in.
                    msg.counters = Some(this.metrics.counter_report());
                    this.done = true;
                    this.guard.finished();
                    break;
                }
                RequestEvent::Failed(e) => {
                    this.done = true;
                    this.guard.finished();
                    if msg.tokens.is_empty() {
                        return Poll::Ready(Some(Err(engine_status(&e))));
                    }
                    this.pending_error = Some(engine_status(&e));
                    break;
                }
            }
            match this.events.try_recv() {
                Ok(next) => event = next,
                Err(_) => break,
            }
        }
        Poll::Ready(Some(Ok(msg)))
    }
}
