//! The engine's typed errors. Each variant says what is wrong and where (file, tensor, field),
//! and maps to one stable [`ErrorKind`] that the gRPC layer turns into a status code.

use std::path::PathBuf;

use crate::sampling::SamplingError;
use crate::tokenizer::TokenizerError;

/// Coarse class of an error: decides the gRPC code and the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The caller sent something invalid (INVALID_ARGUMENT).
    InvalidArgument,
    /// A model directory or config that cannot be served (FAILED_PRECONDITION).
    FailedPrecondition,
    /// Out of KV blocks or queue space (RESOURCE_EXHAUSTED).
    ResourceExhausted,
    /// A bug or an I/O failure (INTERNAL).
    Internal,
    /// The engine thread panicked while the request was open (INTERNAL, marked as such on
    /// the wire): the request may be what made it panic, so it must not be retried on
    /// another node.
    EnginePanic,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("unknown synthetic model `{name}` (known: {known})")]
    UnknownSynthetic { name: String, known: String },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// `PD_CPU_ISA` names an instruction set this host (or build) cannot run.
    #[error(transparent)]
    CpuIsa(#[from] crate::backend::cpu::IsaError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("out of KV cache blocks: {0}")]
    OutOfBlocks(String),
    /// The device cannot hold what the node needs besides KV (weights, activations): the
    /// message names the memory figures and the flag to change.
    #[error("{0}")]
    DeviceMemory(String),
}

impl EngineError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::Io { .. } => ErrorKind::Internal,
            EngineError::Config { .. }
            | EngineError::Tensor { .. }
            | EngineError::Checkpoint { .. }
            | EngineError::UnknownSynthetic { .. } => ErrorKind::FailedPrecondition,
            EngineError::Tokenizer(_) | EngineError::CpuIsa(_) => ErrorKind::FailedPrecondition,
            EngineError::Sampling(_) | EngineError::InvalidRequest(_) => ErrorKind::InvalidArgument,
            EngineError::OutOfBlocks(_) | EngineError::DeviceMemory(_) => {
                ErrorKind::ResourceExhausted
            }
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}
