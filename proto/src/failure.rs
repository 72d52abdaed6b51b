//! Why a node call failed, where the gRPC code alone cannot say: a typed marker that a node
//! puts in an error status's metadata (sent as a trailer) and the router reads back.
//!
//! - An engine panic: INTERNAL, like any other bug, but the request may be what made the
//!   engine panic (a "poison" request), so the router must not retry it on another node,
//!   where it would take a second engine down.
//! - A failed KV pull: a decode node's UNAVAILABLE because the prefill node's KV could not be
//!   pulled (that node died, or the lease expired). The decode node is fine and another
//!   decode node would fail the same way on the same lease: the router prefills again.

use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};

/// The metadata key of the marker (lower case, as gRPC metadata keys are).
pub const KEY: &str = "pd-failure-cause";

/// A failure cause a status can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// The node's engine thread panicked while the request was open.
    EnginePanic,
    /// A decode node could not pull the request's KV from its prefill node.
    KvPull,
}

impl FailureCause {
    pub const ALL: [FailureCause; 2] = [FailureCause::EnginePanic, FailureCause::KvPull];

    /// The marker's value on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::EnginePanic => "engine-panic",
            FailureCause::KvPull => "kv-pull",
        }
    }

    /// A status of `code` carrying this cause.
    pub fn status(self, code: Code, message: impl Into<String>) -> Status {
        let mut metadata = MetadataMap::new();
        metadata.insert(KEY, MetadataValue::from_static(self.as_str()));
        Status::with_metadata(code, message, metadata)
    }

    /// The cause `status` carries, if any (an unknown value is none).
    pub fn of(status: &Status) -> Option<Self> {
        let value = status.metadata().get(KEY)?.to_str().ok()?;
        Self::ALL.into_iter().find(|c| c.as_str() == value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_survives_the_trip_through_trailers() {
        let sent = FailureCause::EnginePanic.status(Code::Internal, "engine failure");
        // What a client decodes from the trailers the server writes.
        let mut trailers = tonic::codegen::http::HeaderMap::new();
        sent.add_header(&mut trailers).unwrap();
        let received = Status::from_header_map(&trailers).unwrap();
        assert_eq!(received.code(), Code::Internal);
        assert_eq!(FailureCause::of(&received), Some(FailureCause::EnginePanic));
        assert_eq!(FailureCause::of(&Status::internal("other bug")), None);
        let pull = FailureCause::KvPull.status(Code::Unavailable, "lease gone");
        let mut trailers = tonic::codegen::http::HeaderMap::new();
        pull.add_header(&mut trailers).unwrap();
        let received = Status::from_header_map(&trailers).unwrap();
        assert_eq!(FailureCause::of(&received), Some(FailureCause::KvPull));
    }
}
