//! `n` choices of one request (`GenerateRequest.n`): the gRPC service the router serves wraps
//! the metered one and runs a request of `n > 1` as `n` requests of one choice each (ids
//! `ID-i`, seeds `seed + i`), started as [`start`] does and merged into one stream whose
//! chunks carry their choice's `index`. An `Abort` of `ID` aborts every choice.
//!
//! Not here: what one choice does (the metered service and the flow behind it), and the HTTP
//! API's `n`, which starts its generations with [`start`] itself (they are also its prompts).

pub(crate) mod start;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use pd_proto::pb;
use pd_proto::pb::generation_server::Generation;
use tokio_stream::{Stream, StreamMap};
use tonic::{Request, Response, Status};

use self::start::{Generations, start};
use crate::metrics::MeteredGeneration;
use crate::validation::{MAX_REQUEST_ID_BYTES, ValidationError};

/// Most choices one request may ask for (`n`), over gRPC and HTTP.
pub const MAX_N: u32 = 16;

type ChunkResult = Result<pb::GenerateResponse, Status>;

/// `pd.v1.Generation` with `n`: what the router serves over gRPC.
#[derive(Debug, Clone)]
pub(crate) struct ChoicesGeneration {
    inner: MeteredGeneration,
    /// Requests of several choices in flight: their id and `n`.
    open: Arc<Mutex<HashMap<String, u32>>>,
}

impl ChoicesGeneration {
    pub fn new(inner: MeteredGeneration) -> Self {
        Self {
            inner,
            open: Arc::default(),
        }
    }

    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
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
        let base = req
            .request_id
            .clone()
            .unwrap_or_else(|| self.inner.request_id());
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
        let open = Open::register(self.open.clone(), &base, n)?;
        let requests = choice_requests(&req, &base, n);
        let streams = start(&self.inner, requests, n as usize, metadata).await?;
        let mut merged = StreamMap::with_capacity(streams.len());
        for (i, stream) in streams.into_iter().enumerate() {
            merged.insert(i as u32, stream);
        }
        Ok(Response::new(Box::pin(Choices {
            merged,
            failed: false,
            _open: open,
        })))
    }

    async fn abort(
        &self,
        request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        let id = &request.get_ref().request_id;
        let n = self.open().get(id).copied();
        let Some(n) = n else {
            return self.inner.abort(request).await;
        };
        let mut aborted = false;
        for i in 0..n {
            let choice = Request::new(pb::AbortRequest {
                request_id: format!("{id}-{i}"),
            });
            aborted |= self.inner.abort(choice).await?.into_inner().aborted;
        }
        Ok(Response::new(pb::AbortResponse { aborted }))
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

/// A request of several choices in [`ChoicesGeneration::open`]; removed on drop.
struct Open {
    table: Arc<Mutex<HashMap<String, u32>>>,
    id: String,
}

impl Open {
    fn register(table: Arc<Mutex<HashMap<String, u32>>>, id: &str, n: u32) -> Result<Self, Status> {
        {
            let mut map = table.lock().unwrap_or_else(PoisonError::into_inner);
            if map.contains_key(id) {
                return Err(ValidationError::DuplicateRequestId(id.to_string()).into());
            }
            map.insert(id.to_string(), n);
        }
        Ok(Self {
            table,
            id: id.to_string(),
        })
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let mut map = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        map.remove(&self.id);
    }
}

/// The choices' chunks as they come, each with its `index`; after an error, nothing more
/// (dropping the rest cancels them).
struct Choices {
    merged: StreamMap<u32, Generations>,
    failed: bool,
    _open: Open,
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

    #[test]
    fn an_open_request_id_is_taken_until_its_choices_end() {
        let table = Arc::default();
        let open = Open::register(Arc::clone(&table), "a", 2).unwrap();
        assert!(Open::register(Arc::clone(&table), "a", 3).is_err());
        drop(open);
        assert!(table.lock().unwrap().is_empty());
        assert!(Open::register(table, "a", 3).is_ok());
    }
}
