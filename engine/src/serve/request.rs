//! What goes into the serving engine and what comes out of it, per request.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::ErrorKind;
use crate::kv::hash::BlockHash;
use crate::kv::host_buffer::HostBuffer;
use crate::kv::reservation::ReservedBlocks;
use crate::sampling::{FinishReason, Guide, PromptLogprob, SampledToken, SamplingParams};
use crate::serve::lease_secret::LeaseSecret;

/// A request's id, unique among the engine's open requests (the router's request id).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub String);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        RequestId(s.to_string())
    }
}

/// A request as the engine takes it: token ids only (the router owns text, stop strings
/// included); stop token ids, EOS and max_tokens are applied here.
#[derive(Debug)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Tenant isolation for the prefix cache: requests share cached blocks only when their
    /// salts are equal.
    pub cache_salt: Option<String>,
    /// Decode role: the prompt's KV computed elsewhere, and the first token sampled there.
    pub imported: Option<ImportedKv>,
    /// Prefill role: keep the prompt's KV under a lease for a decode node when the request
    /// ends (false: nobody will pull it; its blocks are freed, their full ones staying in the
    /// prefix cache). Ignored by the other roles.
    pub lease_kv: bool,
    /// `params.structured_output` compiled over the model's vocabulary (a [`GuideCache`]
    /// does it, off the engine's thread: it may take seconds); `None` without one.
    ///
    /// [`GuideCache`]: crate::sampling::GuideCache
    pub guide: Option<Arc<Guide>>,
}

/// KV of a prompt computed by another node (a prefill node), already pulled, plus the first
/// token it sampled. The pull happens outside the engine (no network I/O on the engine
/// thread): the puller first asks which leading blocks this node already caches and pulls
/// only the rest, either into blocks the engine reserved
/// ([`crate::serve::EngineHandle::reserve_import`]: in place in host memory, or copied in
/// by the puller on a GPU) or into buffers
/// ([`crate::serve::EngineHandle::cached_prefix_blocks`]).
#[derive(Debug)]
pub struct ImportedKv {
    /// Logical index of the first pulled block: the blocks before it were cached here.
    pub first_block: usize,
    /// Consecutive logical blocks up to the end of the prompt.
    pub blocks: ImportedBlocks,
    /// The token the prefill node sampled after the prompt.
    pub first_token: u32,
}

/// Where imported blocks are.
#[derive(Debug)]
pub enum ImportedBlocks {
    /// In buffers, each in [`crate::backend::Backend::read_block`]'s layout; copied into KV
    /// storage at admission, on the engine thread (the pool had no room to reserve when the
    /// pull started).
    Buffers(Vec<HostBuffer>),
    /// Already in this engine's KV storage, in the reserved blocks (held until admission,
    /// given back if the request ends before).
    Placed(ReservedBlocks),
}

impl ImportedBlocks {
    /// Blocks pulled.
    pub fn len(&self) -> usize {
        match self {
            Self::Buffers(b) => b.len(),
            Self::Placed(r) => r.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Token counts of a finished (or aborted) request, as the client sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens found in this node's device cache.
    pub local_cached_tokens: usize,
    /// Prompt tokens restored from another tier (host memory, a peer).
    pub external_cached_tokens: usize,
}

impl Usage {
    /// The prefill computation saved: local plus external.
    pub fn cached_tokens(&self) -> usize {
        self.local_cached_tokens + self.external_cached_tokens
    }
}

/// Per-request timings, for the latency histograms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestTimings {
    /// Arrival until first scheduled.
    pub queue: Duration,
    /// First scheduled until the first token.
    pub prefill: Duration,
    /// First token until the end.
    pub decode: Duration,
    /// Arrival until the first token (None when none was produced).
    pub time_to_first_token: Option<Duration>,
    /// Arrival until the end.
    pub end_to_end: Duration,
    /// Gaps between consecutive generated tokens.
    pub inter_token: Vec<Duration>,
}

/// The prefill role's result: the blocks holding the prompt's KV, kept under a lease until
/// released or expired.
#[derive(Debug, Clone, PartialEq)]
pub struct KvLease {
    /// Random and nonzero ([`crate::serve::lease_secret::random_lease_id`]).
    pub lease_id: u64,
    /// What every reader and the releaser must present with the id.
    pub secret: LeaseSecret,
    /// Physical blocks in logical order, covering the prompt.
    pub blocks: Vec<u32>,
    /// Hashes of the prompt's full blocks (the salt applied).
    pub block_hashes: Vec<BlockHash>,
    pub num_tokens: usize,
}

/// Why the engine failed a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// One update of a request's stream. Every request gets exactly one terminal event:
/// `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// The prompt's logprobs (`params.prompt_logprobs`), once all of the prompt is computed:
    /// right before the first token, in the same step.
    PromptLogprobs(Vec<PromptLogprob>),
    /// One new token.
    Token(SampledToken),
    /// The request ended (normally, or aborted with reason `Abort`).
    Finished(Box<Finished>),
    /// The engine could not serve the request.
    Failed(RequestError),
}

impl RequestEvent {
    /// `Finished` or `Failed`: the request's last event.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::Finished(_) | Self::Failed(_))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: RequestTimings,
    /// Set on a prefill-role node: the KV stays allocated under this lease.
    pub lease: Option<KvLease>,
    /// The request's `max_tokens` as this engine was given it (1 on a prefill node).
    pub max_tokens: u32,
    /// Tokens this engine sampled for the request: `usage.completion_tokens` less, on a
    /// decode node, the first token the prefill node sampled.
    pub sampled_tokens: usize,
}
