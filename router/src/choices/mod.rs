//! `n` choices of one request (`GenerateRequest.n`): the gRPC service the router serves wraps
//! the metered one and runs a request of `n > 1` as `n` requests of one choice each (ids
//! `ID-i`, seeds `seed + i`), started as [`start`] does and merged into one stream whose
//! chunks carry their choice's `index`. `ID` itself is held among the requests in flight
//! while the choices run (until the last choice's last chunk, or an error, goes out), so no
//! other request takes it; an `Abort` of it turns its switch, which every choice watches
//! ([`ChoiceOf`]): a choice that runs ends with finish reason ABORT, one that starts after it
//! ends so at once, without reaching a node (so every choice has its last chunk).
//! Every choice has the request's deadline, counted from its arrival. Each choice's text is
//! then read for reasoning and tool calls where the request asks (`crate::answer`).
//!
//! Not here: what one choice does (the metered service and the flow behind it), and the HTTP
//! API's `n`, which starts its generations with [`start`] itself (they are also its prompts).

pub(crate) mod start;

use std::pin::Pin;
use std::task::{Context, Poll};

use pd_proto::pb;
use pd_proto::pb::generation_server::Generation;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamMap};
use tonic::{Request, Response, Status};

use self::start::{Generations, start};
use crate::answer::{self, Chunks, Parse};
use crate::metrics::MeteredGeneration;
use crate::service::InflightEntry;
use crate::validation::{MAX_REQUEST_ID_BYTES, ValidationError, check_request_id};

/// Most choices one request may ask for (`n`), over gRPC and HTTP.
pub const MAX_N: u32 = 16;

type ChunkResult = Result<pb::GenerateResponse, Status>;

/// `pd.v1.Generation` with `n`: what the router serves over gRPC.
#[derive(Debug, Clone)]
pub(crate) struct ChoicesGeneration {
    inner: MeteredGeneration,
}

impl ChoicesGeneration {
    pub fn new(inner: MeteredGeneration) -> Self {
        Self { inner }
    }
}

/// What a generation started by [`start`] has from the request it belongs to, in its
/// request's extensions (read by the gRPC service before anything else).
#[derive(Debug, Clone, Default)]
pub(crate) struct ChoiceOf {
    /// The request's abort switch (on once an `Abort` names the request); none over HTTP,
    /// whose client cancels by going away.
    pub abort: Option<watch::Receiver<bool>>,
    /// The request's deadline, counted from its arrival: the generation's, if earlier than
    /// the one it would have counted from its own start.
    pub deadline: Option<Instant>,
    /// Whose request it is (its choices are the same tenant's).
    pub tenant: crate::tenant::Tenant,
    /// The client's usage counts each prompt once, with its first choice (the HTTP API, as
    /// OpenAI's); the gRPC API gives each choice its own usage, prompt included. The
    /// per-tenant metrics follow what the client is told.
    pub prompt_once: bool,
    /// What the request is charged to (its tenant limits), if anything limits it.
    pub account: Option<crate::limits::Account>,
}

/// The choices' requests: ids `base-i`, seeds `seed + i`, one choice each.
fn choice_requests(req: &pb::GenerateRequest, base: &str, n: u32) -> Vec<pb::GenerateRequest> {
    (0..n)
        .map(|i| {
            let mut choice = req.clone();
            choice.n = None;
            choice.request_id = Some(format!("{base}-{i}"));
            if let Some(sampling) = choice.sampling.as_mut()
                && let Some(seed) = sampling.seed
            {
                sampling.seed = Some(seed.wrapping_add(u64::from(i)));
            }
            choice
        })
        .collect()
}

impl ChoicesGeneration {
    /// The request's choices' chunks, merged (its one choice's, for `n = 1`).
    async fn choices(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Chunks>, Status> {
        let arrival = Instant::now();
        let n = request.get_ref().n.unwrap_or(1);
        if n == 1 {
            let response = self.inner.generate(request).await?;
            return Ok(response.map(|s| Box::pin(s) as Chunks));
        }
        if n == 0 || n > MAX_N {
            return Err(ValidationError::Choices(n).into());
        }
        let deadline = self.inner.deadline(request.metadata(), arrival);
        let tenant = crate::service::tenant_of(request.extensions());
        let account = request
            .extensions()
            .get::<crate::limits::Account>()
            .cloned();
        let (metadata, _, req) = request.into_parts();
        let base = match &req.request_id {
            Some(id) => {
                check_request_id(id)?;
                id.clone()
            }
            None => self.inner.request_id(),
        };
        // The choices' ids must pass the request id's checks too.
        let max = MAX_REQUEST_ID_BYTES - 1 - (n - 1).to_string().len();
        if base.len() > max {
            return Err(ValidationError::ChoicesRequestId {
                n,
                max,
                len: base.len(),
            }
            .into());
        }
        let (held, abort) = self.inner.hold_id(&tenant, &base)?;
        let requests = choice_requests(&req, &base, n);
        let parent = ChoiceOf {
            abort: Some(abort),
            deadline,
            tenant,
            prompt_once: false,
            account,
        };
        let streams = start(&self.inner, requests, n as usize, metadata, parent).await?;
        let mut merged = StreamMap::with_capacity(streams.len());
        for (i, stream) in streams.into_iter().enumerate() {
            merged.insert(i as u32, stream);
        }
        Ok(Response::new(Box::pin(Choices {
            running: merged.len(),
            merged,
            failed: false,
            held: Some(held),
        })))
    }
}

#[tonic::async_trait]
impl Generation for ChoicesGeneration {
    type GenerateStream = Chunks;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        // Each choice's text read for reasoning and tool calls, when the request asks.
        let parse = Parse::of(request.get_ref())?;
        let response = self.choices(request).await?;
        Ok(response.map(|chunks| answer::parsed(chunks, parse)))
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

/// The choices' chunks as they come, each with its `index`; after an error, nothing more
/// (dropping the rest cancels them).
struct Choices {
    merged: StreamMap<u32, Generations>,
    /// Choices whose last chunk has not come yet.
    running: usize,
    failed: bool,
    /// The request's own id, held while its choices run: given back before the last choice's
    /// last chunk or an error goes out (each choice gave back its own already), so that the
    /// client may reuse it as soon as it sees the end, as with a request of one choice.
    held: Option<InflightEntry>,
}

impl Stream for Choices {
    type Item = ChunkResult;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ChunkResult>> {
        if self.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.merged).poll_next(cx) {
            Poll::Ready(Some((index, Ok(mut chunk)))) => {
                chunk.index = index;
                if chunk.finish_reason != 0 {
                    self.running = self.running.saturating_sub(1);
                    if self.running == 0 {
                        self.held = None;
                    }
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some((_, Err(status)))) => {
                self.failed = true;
                self.merged.clear();
                self.held = None;
                Poll::Ready(Some(Err(status)))
            }
            Poll::Ready(None) => {
                self.held = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_choice_is_a_request_of_its_own() {
        let req = pb::GenerateRequest {
            n: Some(3),
            request_id: Some("r".into()),
            sampling: Some(pb::SamplingParams {
                seed: Some(u64::MAX),
                ..Default::default()
            }),
            ..Default::default()
        };
        let choices = choice_requests(&req, "r", 3);
        let ids: Vec<_> = choices
            .iter()
            .map(|c| c.request_id.clone().unwrap())
            .collect();
        assert_eq!(ids, ["r-0", "r-1", "r-2"]);
        let seeds: Vec<_> = choices
            .iter()
            .map(|c| c.sampling.as_ref().unwrap().seed)
            .collect();
        assert_eq!(seeds, [Some(u64::MAX), Some(0), Some(1)]);
        assert!(choices.iter().all(|c| c.n.is_none()));
        // Without a seed, each choice samples on its own.
        let unseeded = pb::GenerateRequest::default();
        assert!(
            choice_requests(&unseeded, "x", 2)
                .iter()
                .all(|c| c.sampling.is_none())
        );
    }
}
