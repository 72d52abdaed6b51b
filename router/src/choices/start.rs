//! Starting a request's generations through the gRPC service: prompts at once, a prompt's
//! other choices once its first choice's first token is out, each stream's first message
//! looked at before the response starts. Used by the HTTP API (prompts × `n`) and by the
//! gRPC API's `n`. Each generation's request carries a [`ChoiceOf`]: the abort switch of the
//! request it belongs to (the gRPC API's) and that request's deadline, counted from its
//! arrival, so that a later choice has no more time than the first.

use pd_proto::pb;
use pd_proto::pb::generation_server::Generation;
use tokio::task::JoinSet;
use tokio_stream::StreamExt;
use tokio_stream::adapters::Peekable;
use tonic::Status;
use tonic::metadata::MetadataMap;

use super::ChoiceOf;
use crate::metrics::{MeteredGeneration, PromptCountedElsewhere};

/// One generation's chunks, as the gRPC service streams them; its first already looked at.
pub(crate) type Generations = Peekable<<MeteredGeneration as Generation>::GenerateStream>;

/// A started generation's stream, or the error its first message is: a request that fails
/// before its first token (no healthy node, out of capacity, its deadline) answers with that
/// error's status, streamed or not, as when it is refused outright.
async fn opened(
    response: Result<tonic::Response<<MeteredGeneration as Generation>::GenerateStream>, Status>,
) -> Result<Generations, Status> {
    let mut stream = response?.into_inner().peekable();
    if let Some(Err(status)) = stream.peek().await {
        return Err(status.clone());
    }
    Ok(stream)
}

/// Starts the generations and returns their streams in order, or the first refusal. Each
/// goes with `metadata` and `parent` (its abort switch and deadline).
/// Prompts start at once; a prompt's first choice goes alone, and its other `n - 1` start
/// when its first token is out: the prompt's KV is then in the prefix cache, so they compute
/// only its last, partial block, where starting together could put them in one engine step
/// that computes the whole prompt `n` times. Dropping this future, or returning an error,
/// cancels those already started. Once `parent` is aborted, a prompt's other choices still
/// start, and end with finish reason ABORT at once without reaching a node (the flow looks at
/// the switch first), so that every choice has its last chunk.
pub(crate) async fn start(
    generation: &MeteredGeneration,
    requests: Vec<pb::GenerateRequest>,
    n: usize,
    metadata: MetadataMap,
    parent: ChoiceOf,
) -> Result<Vec<Generations>, Status> {
    let count = requests.len();
    let mut prompts = JoinSet::new();
    let mut requests = requests.into_iter().enumerate().peekable();
    while requests.peek().is_some() {
        let choices: Vec<_> = requests.by_ref().take(n.max(1)).collect();
        let generation = generation.clone();
        let (metadata, parent) = (metadata.clone(), parent.clone());
        prompts.spawn(async move { start_prompt(generation, choices, metadata, parent).await });
    }
    let mut streams: Vec<Option<Generations>> = (0..count).map(|_| None).collect();
    while let Some(joined) = prompts.join_next().await {
        let started =
            joined.map_err(|e| Status::internal(format!("a generation task failed: {e}")))??;
        for (i, stream) in started {
            streams[i] = Some(stream);
        }
    }
    Ok(streams.into_iter().flatten().collect())
}

/// One prompt's choices: the first, then the rest together once its first token is out.
async fn start_prompt(
    generation: MeteredGeneration,
    choices: Vec<(usize, pb::GenerateRequest)>,
    metadata: MetadataMap,
    parent: ChoiceOf,
) -> Result<Vec<(usize, Generations)>, Status> {
    let request = |req, first: bool| {
        let mut extensions = tonic::Extensions::new();
        extensions.insert(parent.tenant.clone());
        if let Some(account) = &parent.account {
            extensions.insert(account.clone());
        }
        if parent.prompt_once && !first {
            extensions.insert(PromptCountedElsewhere);
        }
        extensions.insert(parent.clone());
        tonic::Request::from_parts(metadata.clone(), extensions, req)
    };
    let mut choices = choices.into_iter();
    let Some((first, req)) = choices.next() else {
        return Ok(Vec::new());
    };
    let stream = opened(generation.generate(request(req, true)).await).await?;
    let mut started = vec![(first, stream)];
    let mut rest = JoinSet::new();
    for (i, req) in choices {
        let generation = generation.clone();
        let req = request(req, false);
        rest.spawn(async move {
            let response = generation.generate(req).await;
            (i, opened(response).await)
        });
    }
    while let Some(joined) = rest.join_next().await {
        match joined {
            Ok((i, Ok(stream))) => started.push((i, stream)),
            Ok((_, Err(status))) => return Err(status),
            Err(e) => return Err(Status::internal(format!("a generation task failed: {e}"))),
        }
    }
    Ok(started)
}
