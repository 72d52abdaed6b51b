//! Structured outputs on a node: a request's regex, choices or JSON schema compiled into its
//! guide (through the node's [`GuideCache`]) before the engine sees it, on tokio's blocking
//! pool (a large schema takes seconds over Qwen3's vocabulary). What a guide does is
//! `pd_engine::sampling::structured`'s business.
//!
//! Compiles are bounded: at most [`compile_slots`] run at once (a burst of large schemas
//! cannot take every core from the engine), and a request whose guide is not ready within
//! [`COMPILE_BUDGET`] (waiting for a slot included) fails with DEADLINE_EXCEEDED. A compile
//! that outlives the budget still finishes, holding its slot, and lands in the cache: the
//! client's retry finds it there.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pd_engine::sampling::{Guide, GuideCache, SamplingParams};
use tokio::sync::Semaphore;
use tonic::Status;

/// The longest a request waits for its guide: a slot and the compile.
pub const COMPILE_BUDGET: Duration = Duration::from_secs(30);

/// Compiles that may run at once: half the CPU cores, at least one.
pub fn compile_slots() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 2).max(1)
}

/// The process's compile slots.
fn slots() -> &'static Arc<Semaphore> {
    static SLOTS: OnceLock<Arc<Semaphore>> = OnceLock::new();
    SLOTS.get_or_init(|| Arc::new(Semaphore::new(compile_slots())))
}

/// The guide of `params.structured_output`, or `None` without one; INVALID_ARGUMENT when it
/// cannot be compiled over this model's vocabulary, DEADLINE_EXCEEDED when it is not ready
/// within [`COMPILE_BUDGET`].
pub async fn compile(
    guides: &Arc<GuideCache>,
    params: &SamplingParams,
) -> Result<Option<Arc<Guide>>, Status> {
    let Some(spec) = params.structured_output.clone() else {
        return Ok(None);
    };
    let guides = Arc::clone(guides);
    let work = async move {
        let slot = slots()
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Status::internal("the structured-output compile slots are closed"))?;
        tokio::task::spawn_blocking(move || {
            // Held until the compile ends, even if the request stopped waiting for it.
            let _slot = slot;
            guides.get(&spec)
        })
        .await
        .map_err(|e| Status::internal(format!("compiling the structured output failed: {e}")))?
        .map(Some)
        .map_err(|e| Status::invalid_argument(e.to_string()))
    };
    tokio::time::timeout(COMPILE_BUDGET, work)
        .await
        .unwrap_or_else(|_| {
            Err(Status::deadline_exceeded(format!(
                "the structured output was not compiled within {} s (a very large schema, or \
                 many at once); the compile goes on, and a retry finds it cached",
                COMPILE_BUDGET.as_secs()
            )))
        })
}
