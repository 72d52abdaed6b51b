//! Structured outputs on a node: a request's regex, choices or JSON schema compiled into its
//! guide (through the node's [`GuideCache`]) before the engine sees it, on tokio's blocking
//! pool (a large schema takes seconds over Qwen3's vocabulary). What a guide does is
//! `pd_engine::sampling::structured`'s business.

use std::sync::Arc;

use pd_engine::sampling::{Guide, GuideCache, SamplingParams};
use tonic::Status;

/// The guide of `params.structured_output`, or `None` without one; INVALID_ARGUMENT when it
/// cannot be compiled over this model's vocabulary.
pub async fn compile(
    guides: &Arc<GuideCache>,
    params: &SamplingParams,
) -> Result<Option<Arc<Guide>>, Status> {
    let Some(spec) = params.structured_output.clone() else {
        return Ok(None);
    };
    let guides = Arc::clone(guides);
    tokio::task::spawn_blocking(move || guides.get(&spec))
        .await
        .map_err(|e| Status::internal(format!("compiling the structured output failed: {e}")))?
        .map(Some)
        .map_err(|e| Status::invalid_argument(e.to_string()))
}
