//! Client-perceived request metrics, measured where the client sees them: on the response
//! stream as tonic takes each chunk to send it.
//!
//! [`MeteredGeneration`] wraps the `pd.v1.Generation` service: a `Generate` call counts as in
//! flight from its arrival until its stream ends; the first chunk carrying a token observes
//! time to first token; every later token observes inter-token latency (a chunk of n tokens
//! after a gap observes gap / n, n times, so the histogram's count is the tokens after the
//! first); the end observes the request duration and counts the outcome: the finish reason
//! of the last chunk, the gRPC code of an error (a request refused before its stream started,
//! e.g. `invalid_argument`, counts too, without a duration), or `cancelled` when the client
//! went away before the end. Each request's usage and outcome also count for its tenant
//! (`super::tenants`), and a request with tenant limits is charged here (its
//! [`Account`]): each chunk's tokens as it goes out, its prompt with its usage.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pd_proto::pb;
use pd_proto::pb::generation_server::Generation;
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status};

use super::RouterMetrics;
use super::ids::Outcome;
use crate::limits::Account;
use crate::service::GenerationService;
use crate::tenant::Tenant;

/// In a generation's extensions: its client's usage counts its prompt with another
/// generation's (an HTTP request's later choices of a prompt: OpenAI's usage counts each
/// prompt once), so its tenant is not counted its prompt tokens again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PromptCountedElsewhere;

/// `pd.v1.Generation` with the router's request metrics.
#[derive(Debug, Clone)]
pub(crate) struct MeteredGeneration {
    inner: GenerationService,
    metrics: Arc<RouterMetrics>,
}

impl MeteredGeneration {
    pub fn new(inner: GenerationService, metrics: Arc<RouterMetrics>) -> Self {
        Self { inner, metrics }
    }

    /// A new request id, as one a request without its own gets.
    pub(crate) fn request_id(&self) -> String {
        self.inner.request_id()
    }

    /// See [`GenerationService::hold_id`].
    pub(crate) fn hold_id(
        &self,
        tenant: &crate::tenant::Tenant,
        id: &str,
    ) -> Result<
        (
            crate::service::InflightEntry,
            tokio::sync::watch::Receiver<bool>,
        ),
        crate::validation::ValidationError,
    > {
        self.inner.hold_id(tenant, id)
    }

    /// See [`GenerationService::deadline`].
    pub(crate) fn deadline(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        arrival: Instant,
    ) -> Option<Instant> {
        self.inner.deadline(metadata, arrival)
    }
}

#[tonic::async_trait]
impl Generation for MeteredGeneration {
    type GenerateStream = MeteredStream<<GenerationService as Generation>::GenerateStream>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let tenant = crate::service::tenant_of(request.extensions());
        let prompt = request
            .extensions()
            .get::<PromptCountedElsewhere>()
            .is_none();
        let account = request.extensions().get::<Account>().cloned();
        let mut timer = RequestTimer::start(self.metrics.clone(), tenant, prompt, account);
        match self.inner.generate(request).await {
            Ok(response) => Ok(response.map(|inner| MeteredStream { inner, timer })),
            Err(status) => {
                timer.refused(status.code());
                Err(status)
            }
        }
    }

    async fn abort(
        &self,
        request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        self.inner.abort(request).await
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        self.inner.tokenize(request).await
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.inner.list_models(request).await
    }
}

/// One request's timing; records its outcome exactly once (at the end, or on drop).
#[derive(Debug)]
struct RequestTimer {
    metrics: Arc<RouterMetrics>,
    /// Whose request it is (its usage and outcome count for the tenant too).
    tenant: Tenant,
    /// Whether its prompt tokens count for the tenant (see [`PromptCountedElsewhere`]).
    counts_prompt: bool,
    arrival: Instant,
    /// When the last token went out (None before the first).
    last_token: Option<Instant>,
    /// What the request is charged to (its tenant's limits), if anything limits it.
    account: Option<Account>,
    /// Tokens charged to `account` so far.
    charged_tokens: u64,
    /// The prompt's length, from the first chunk (`prompt_tokens`), until its usage charged
    /// it: a client that goes away before then is charged it as computed.
    prompt_uncharged: Option<u32>,
    done: bool,
}

impl RequestTimer {
    fn start(
        metrics: Arc<RouterMetrics>,
        tenant: Tenant,
        counts_prompt: bool,
        account: Option<Account>,
    ) -> Self {
        metrics.model.in_flight.increment(1.0);
        Self {
            metrics,
            tenant,
            counts_prompt,
            arrival: Instant::now(),
            last_token: None,
            account,
            charged_tokens: 0,
            prompt_uncharged: None,
            done: false,
        }
    }

    fn chunk(&mut self, chunk: &pb::GenerateResponse) {
        // Only a request's last chunk carries usage: what its client is told it used.
        if let Some(usage) = &chunk.usage {
            (self.metrics.tenants).usage(&self.tenant, usage, self.counts_prompt);
        }
        let tokens = chunk.token_ids.len();
        self.charge(chunk, tokens);
        if tokens > 0 {
            let now = Instant::now();
            match self.last_token {
                None => {
                    let ttft = now.duration_since(self.arrival).as_secs_f64();
                    self.metrics.model.ttft.record(ttft);
                    // The other tokens of the first chunk came at the same moment.
                    self.observe_gaps(0.0, tokens - 1);
                }
                Some(last) => {
                    let gap = now.duration_since(last).as_secs_f64() / tokens as f64;
                    self.observe_gaps(gap, tokens);
                }
            }
            self.last_token = Some(now);
        }
        let outcome = match chunk.finish_reason() {
            pb::FinishReason::Unspecified => return,
            pb::FinishReason::Stop => Outcome::Stop,
            pb::FinishReason::Length => Outcome::Length,
            pb::FinishReason::Abort => Outcome::Abort,
        };
        self.end(outcome, true);
    }

    /// Charges the request's account: the chunk's tokens; with its usage, the prompt (if it
    /// counts here) and any generated tokens the chunks did not carry.
    fn charge(&mut self, chunk: &pb::GenerateResponse, tokens: usize) {
        let Some(account) = &self.account else {
            return;
        };
        if self.counts_prompt && chunk.prompt_tokens.is_some() {
            self.prompt_uncharged = chunk.prompt_tokens;
        }
        let mut generated = tokens as u64;
        if let Some(usage) = &chunk.usage {
            let total = u64::from(usage.completion_tokens);
            generated = generated.max(total.saturating_sub(self.charged_tokens));
            if self.counts_prompt {
                account.prompt(usage);
            }
            self.prompt_uncharged = None;
        }
        if generated > 0 {
            account.generated(generated);
            self.charged_tokens += generated;
        }
    }

    fn observe_gaps(&self, gap: f64, n: usize) {
        let itl = &self.metrics.model.itl;
        for _ in 0..n {
            itl.record(gap);
        }
    }

    /// Refused before a stream existed (bad input, duplicate id): counted, no duration.
    fn refused(&mut self, code: Code) {
        self.end(Outcome::Error(code), false);
    }

    fn end(&mut self, outcome: Outcome, timed: bool) {
        if self.done {
            return;
        }
        self.done = true;
        // The client went away after its prompt was computed, before its usage: the prompt
        // is charged as computed (what was cached is not known).
        if outcome == Outcome::Error(Code::Cancelled)
            && let (Some(account), Some(prompt)) = (&self.account, self.prompt_uncharged.take())
        {
            account.prompt_computed(prompt);
        }
        self.metrics.tenants.ended(&self.tenant, outcome);
        match self.metrics.model.ended(outcome) {
            Some(counter) => counter.increment(1),
            None => self
                .metrics
                .requests
                .with_label_values(&[self.metrics.model_name(), outcome.as_str()])
                .increment(1),
        }
        if timed {
            let seconds = self.arrival.elapsed().as_secs_f64();
            self.metrics.model.duration.record(seconds);
        }
        self.metrics.model.in_flight.decrement(1.0);
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        // The stream was dropped before its last chunk: the client went away.
        self.end(Outcome::Error(Code::Cancelled), true);
    }
}

/// A response stream that reports each chunk to its [`RequestTimer`].
#[derive(Debug)]
pub(crate) struct MeteredStream<S> {
    inner: S,
    timer: RequestTimer,
}

impl<S> Stream for MeteredStream<S>
where
    S: Stream<Item = Result<pb::GenerateResponse, Status>> + Unpin,
{
    type Item = Result<pb::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let item = Pin::new(&mut this.inner).poll_next(cx);
        match &item {
            Poll::Ready(Some(Ok(chunk))) => this.timer.chunk(chunk),
            Poll::Ready(Some(Err(status))) => this.timer.end(Outcome::Error(status.code()), true),
            Poll::Ready(None) => {
                // Ended without a finish reason or error: the request task gave up because
                // the client went away.
                this.timer.end(Outcome::Error(Code::Cancelled), true);
            }
            Poll::Pending => {}
        }
        item
    }
}
