//! The router's typed errors, each with one gRPC code, and how a failed node call is judged
//! (retry elsewhere? route around the node?).

use pd_engine::EngineError;
use pd_proto::failure::FailureCause;
use tonic::{Code, Status};

use crate::registry::Role;
use crate::validation::ValidationError;

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Validation(#[from] ValidationError),
    #[error("cannot load the metadata of model `{model}`: {source}")]
    Model {
        model: String,
        #[source]
        source: EngineError,
    },
    #[error("invalid {role} node address `{addr}`: {message}")]
    BadAddress {
        role: Role,
        addr: String,
        message: String,
    },
    #[error(
        "at least one --decode node or --decode-dns name is needed (with --prefill nodes the \
         cluster disaggregates; without, decode nodes serve whole requests)"
    )]
    NoNodes,
    #[error("no healthy {role} node ({detail}); retry once the router's health reports SERVING")]
    NoHealthyNode { role: Role, detail: String },
    #[error(
        "no healthy prefill node shares a KV layout (fingerprint, block size and KV cache type) \
         with a healthy decode node: {detail}"
    )]
    IncompatibleLayouts { detail: String },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error(transparent)]
    Keys(#[from] crate::auth::KeysError),
    #[error(transparent)]
    Limits(#[from] crate::limits::LimitsError),
    /// The `--tls-*` files cannot be used.
    #[error("TLS: {0}")]
    Tls(#[from] pd_tls::TlsError),
    #[error("{0}")]
    Internal(String),
}

impl RouterError {
    pub fn code(&self) -> Code {
        match self {
            RouterError::Validation(_) => Code::InvalidArgument,
            RouterError::Model { source, .. } => match source.kind() {
                pd_engine::ErrorKind::Internal => Code::Internal,
                _ => Code::FailedPrecondition,
            },
            RouterError::BadAddress { .. }
            | RouterError::NoNodes
            | RouterError::Keys(_)
            | RouterError::Limits(_) => Code::InvalidArgument,
            RouterError::NoHealthyNode { .. } => Code::Unavailable,
            RouterError::IncompatibleLayouts { .. } | RouterError::Tls(_) => {
                Code::FailedPrecondition
            }
            RouterError::Node(e) => e.client_code(),
            RouterError::Serve(_) | RouterError::Internal(_) => Code::Internal,
        }
    }
}

impl From<RouterError> for Status {
    fn from(e: RouterError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

/// A call to a node that did not succeed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{role} node {addr}: {what}")]
pub struct NodeError {
    pub role: Role,
    pub addr: String,
    pub what: NodeFailure,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum NodeFailure {
    /// The node answered with an error status.
    #[error("{}: {}", code_name(.0.code()), .0.message())]
    Status(Status),
    /// No answer came back: the connection could not be made or broke during the call (the
    /// process died, the network failed). tonic reports it as a status too, but one made
    /// locally from the transport error.
    #[error("connection failed ({}): {}", code_name(.0.code()), .0.message())]
    Connection(Status),
    /// The node did not answer within the router's deadline for it.
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The node broke the protocol (e.g. a decode stream that ended without a finish reason).
    #[error("{0}")]
    Protocol(String),
}

impl NodeFailure {
    /// Classifies a failed call's status: one the node sent (`Status`), or one tonic made
    /// from a transport error (`Connection`). Only the latter carries an error source: a
    /// status decoded from the node's trailers never has one.
    pub fn from_status(status: Status) -> Self {
        if std::error::Error::source(&status).is_some() {
            NodeFailure::Connection(status)
        } else {
            NodeFailure::Status(status)
        }
    }
}

impl NodeError {
    /// The node's engine panicked while it held the request: the request may be what made
    /// it panic (a "poison" request), so it must not go to another node.
    pub fn is_engine_panic(&self) -> bool {
        matches!(&self.what,
            NodeFailure::Status(s) if FailureCause::of(s) == Some(FailureCause::EnginePanic))
    }

    /// A decode node could not pull the request's KV from its prefill node: the lease's KV is
    /// gone, the decode node is fine.
    pub fn is_kv_pull_failure(&self) -> bool {
        matches!(&self.what,
            NodeFailure::Status(s) if FailureCause::of(s) == Some(FailureCause::KvPull))
    }

    /// Worth trying another node: the node (or the path to it) failed, not the request, and
    /// not by a panic the request may have caused.
    pub fn is_retryable(&self) -> bool {
        if self.is_engine_panic() {
            return false;
        }
        match &self.what {
            NodeFailure::Timeout(_) | NodeFailure::Protocol(_) | NodeFailure::Connection(_) => true,
            NodeFailure::Status(s) => matches!(
                s.code(),
                Code::Unavailable
                    | Code::Unknown
                    | Code::Internal
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::Cancelled
                    | Code::DeadlineExceeded
            ),
        }
    }

    /// The node refused the request for want of room (its waiting queue full: RESOURCE_EXHAUSTED)
    /// before doing any work: any other node may take it, and the node is fine. Trying every
    /// node for it does not use up the one retry a failure gets.
    pub fn is_refusal(&self) -> bool {
        matches!(&self.what, NodeFailure::Status(s) if s.code() == Code::ResourceExhausted)
    }

    /// The node itself looks unreachable or stuck: route around it at once, until its next
    /// good health check, rather than sending it more requests until the next poll. A node
    /// that answered with a status is reachable; whether it is healthy is its `Info`'s call
    /// (a decode node's UNAVAILABLE may be its prefill peer's fault, not its own).
    /// A node whose engine panicked is down too: its engine is gone, and its own health
    /// turned NOT_SERVING before it answered.
    pub fn marks_node_down(&self) -> bool {
        if self.is_engine_panic() {
            return true;
        }
        match &self.what {
            NodeFailure::Timeout(_) | NodeFailure::Connection(_) => true,
            NodeFailure::Protocol(_) | NodeFailure::Status(_) => false,
        }
    }

    /// Whether the failure is the node's, for its circuit breaker
    /// ([`crate::registry::Breaker`]): no answer (timeout, broken connection), a broken
    /// protocol, or an internal error (a panic included). A full node's refusal, the
    /// request's own errors and an answered UNAVAILABLE (a draining node, a KV pull from a
    /// failed prefill node: health checks judge those) are not.
    pub fn counts_against_node(&self) -> bool {
        match &self.what {
            NodeFailure::Timeout(_) | NodeFailure::Protocol(_) | NodeFailure::Connection(_) => true,
            NodeFailure::Status(s) => {
                matches!(s.code(), Code::Internal | Code::Unknown | Code::DataLoss)
            }
        }
    }

    /// The code a client gets when this error ends its request before any token reached it:
    /// the node's own verdict on the request where it has one (INTERNAL for an engine
    /// panic), else UNAVAILABLE.
    pub fn client_code(&self) -> Code {
        if self.is_engine_panic() {
            return Code::Internal;
        }
        match &self.what {
            NodeFailure::Status(s) => match s.code() {
                c @ (Code::InvalidArgument
                | Code::FailedPrecondition
                | Code::ResourceExhausted
                | Code::OutOfRange) => c,
                _ => Code::Unavailable,
            },
            _ => Code::Unavailable,
        }
    }
}

fn code_name(code: Code) -> String {
    // `Code`'s Debug is the CamelCase variant; clients know the SCREAMING_CASE names.
    let camel = format!("{code:?}");
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names() {
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(code_name(Code::Unavailable), "UNAVAILABLE");
    }

    fn failure(what: NodeFailure) -> NodeError {
        NodeError {
            role: Role::Decode,
            addr: "127.0.0.1:1".into(),
            what,
        }
    }

    #[test]
    fn a_broken_connection_marks_the_node_down_an_answer_does_not() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let broken = NodeFailure::from_status(Status::from_error(Box::new(io)));
        assert!(matches!(broken, NodeFailure::Connection(_)), "{broken:?}");
        let broken = failure(broken);
        assert!(broken.marks_node_down() && broken.is_retryable());
        assert_eq!(broken.client_code(), Code::Unavailable);
        assert!(broken.to_string().contains("connection failed"), "{broken}");

        let answered = failure(NodeFailure::from_status(Status::unavailable("pull failed")));
        assert!(matches!(answered.what, NodeFailure::Status(_)));
        assert!(!answered.marks_node_down() && answered.is_retryable());
        let refused = failure(NodeFailure::from_status(Status::invalid_argument("bad")));
        assert!(!refused.is_retryable() && !refused.is_refusal());
        let full = failure(NodeFailure::from_status(Status::resource_exhausted("full")));
        assert!(full.is_refusal() && full.is_retryable() && !full.marks_node_down());
        assert_eq!(full.client_code(), Code::ResourceExhausted);
        assert_eq!(refused.client_code(), Code::InvalidArgument);
        assert!(!full.counts_against_node() && !refused.counts_against_node());
        assert!(!answered.counts_against_node() && broken.counts_against_node());
    }

    #[test]
    fn an_engine_panic_is_internal_never_retried_and_takes_the_node_out() {
        let status = FailureCause::EnginePanic.status(Code::Internal, "engine failure: boom");
        let panicked = failure(NodeFailure::from_status(status));
        assert!(panicked.is_engine_panic());
        assert!(!panicked.is_retryable());
        assert!(panicked.marks_node_down() && panicked.counts_against_node());
        assert_eq!(panicked.client_code(), Code::Internal);

        // Any other INTERNAL is the node's failure: retried elsewhere, UNAVAILABLE to the
        // client if no retry succeeds.
        let bug = failure(NodeFailure::from_status(Status::internal(
            "engine not running",
        )));
        assert!(!bug.is_engine_panic() && bug.is_retryable());
        assert_eq!(bug.client_code(), Code::Unavailable);
    }
}
