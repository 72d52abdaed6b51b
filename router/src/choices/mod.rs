//! `n` choices of one request (`GenerateRequest.n`): the gRPC service the router serves wraps
//! the metered one and runs a request of `n > 1` as `n` requests of one choice each (ids
//! `ID-i`, seeds `seed + i`), started as [`start`] does and merged into one stream whose
//! chunks carry their choice's `index`. `ID` itself is held among the requests in flight
//! while the choices run, so no other request takes it and an `Abort` of it aborts every
//! choice.
//!
//! Not here: what one choice does (the metered service and the flow behind it), and the HTTP
//! API's `n`, which starts its generations with [`start`] itself (they are also its prompts).

pub(crate) mod start;

use std::pin::Pin;
use std::task::{Context, Poll};

use pd_proto::pb;
use pd_proto::pb::generation_server::Generation;
use tokio_stream::{Stream, StreamMap};
use tonic::{Request, Response, Status};

use self::start::{Generations, start};
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

/// Aborts each of `ids` that is in flight.
async fn abort_all(generation: &MeteredGeneration, ids: &[String]) -> Result<(), Status> {
    for id in ids {
        let abort = Request::new(pb::AbortRequest {
            request_id: id.clone(),
        });
        generation.abort(abort).await?;
    }
    Ok(())
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

#[tonic::async_trait]
impl Generation for ChoicesGeneration {
    type GenerateStream = Pin<Box<dyn Stream<Item = ChunkResult> + Send>>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let n = request.get_ref().n.unwrap_or(1);
        if n == 1 {
            let response = self.inner.generate(request).await?;
            return Ok(response.map(|s| Box::pin(s) as Self::GenerateStream));
        }
        if n == 0 || n > MAX_N {
            return Err(ValidationError::Choices(n).into());
        }
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
        let (held, mut aborted) = self.inner.hold_id(&base)?;
        let requests = choice_requests(&req, &base, n);
        let ids: Vec<String> = requests
            .iter()
            .filter_map(|r| r.request_id.clone())
            .collect();
        // An Abort of the request's id aborts the choices in flight then; it ends when the
        // request does (the held id's switch is dropped).
        let (generation, choice_ids, mut switch) =
            (self.inner.clone(), ids.clone(), aborted.clone());
        tokio::spawn(async move {
            if switch.wait_for(|&a| a).await.is_ok() {
                let _ = abort_all(&generation, &choice_ids).await;
            }
        });
        let streams = start(&self.inner, requests, n as usize, metadata).await?;
        // Choices that started after an Abort came are aborted now.
        if *aborted.borrow_and_update() {
            abort_all(&self.inner, &ids).await?;
        }
        let mut merged = StreamMap::with_capacity(streams.len());
        for (i, stream) in streams.into_iter().enumerate() {
            merged.insert(i as u32, stream);
        }
        Ok(Response::new(Box::pin(Choices {
            merged,
            failed: false,
            _held: held,
        })))
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
    failed: bool,
    /// The request's own id, held while its choices run.
    _held: InflightEntry,
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
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some((_, Err(status)))) => {
                self.failed = true;
                self.merged.clear();
                Poll::Ready(Some(Err(status)))
            }
            other => other.map(|_| None),
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
