//! Node caller authentication: with mTLS on, every gRPC call except `grpc.health.v1.Health`
//! (left open for probes and load balancers) must come over a connection whose client
//! presented a certificate the cluster CA signed; anything else is answered UNAUTHENTICATED
//! before the service sees it. The check reads the [`PeerInfo`] tonic puts in each
//! request's extensions (from [`crate::Conn`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::codegen::http;

use crate::conn::PeerInfo;

/// The gRPC paths left open to callers without a cluster certificate.
const OPEN_PREFIX: &str = "/grpc.health.v1.Health/";

/// A tower layer putting [`ClusterOnly`] in front of a gRPC server's services. With
/// `required == false` it lets everything through.
#[derive(Debug, Clone, Copy)]
pub struct ClusterOnlyLayer {
    required: bool,
}

impl ClusterOnlyLayer {
    pub fn new(required: bool) -> Self {
        Self { required }
    }
}

impl<S> tower::Layer<S> for ClusterOnlyLayer {
    type Service = ClusterOnly<S>;

    fn layer(&self, inner: S) -> ClusterOnly<S> {
        ClusterOnly {
            inner,
            required: self.required,
        }
    }
}

/// See [`ClusterOnlyLayer`].
#[derive(Debug, Clone)]
pub struct ClusterOnly<S> {
    inner: S,
    required: bool,
}

/// Whether a request is let through.
pub fn allowed(path: &str, peer: Option<&PeerInfo>, required: bool) -> bool {
    !required || path.starts_with(OPEN_PREFIX) || peer.is_some_and(|p| p.client_verified)
}

impl<S, B> tower::Service<http::Request<B>> for ClusterOnly<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let peer = request.extensions().get::<PeerInfo>();
        if allowed(request.uri().path(), peer, self.required) {
            return Box::pin(self.inner.call(request));
        }
        let status = tonic::Status::unauthenticated(
            "this node serves only the cluster: connect with a client certificate signed by \
             the cluster CA",
        );
        Box::pin(std::future::ready(Ok(status.into_http())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(client_verified: bool) -> PeerInfo {
        PeerInfo {
            remote_addr: None,
            tls: true,
            client_verified,
        }
    }

    #[test]
    fn only_health_is_open_without_a_cluster_certificate() {
        let open = "/grpc.health.v1.Health/Check";
        let closed = [
            "/pd.v1.PrefillService/Prefill",
            "/pd.v1.DecodeService/Decode",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ];
        assert!(allowed(open, None, true));
        assert!(allowed(open, Some(&peer(false)), true));
        for path in closed {
            assert!(!allowed(path, None, true), "{path}");
            assert!(!allowed(path, Some(&peer(false)), true), "{path}");
            assert!(allowed(path, Some(&peer(true)), true), "{path}");
            assert!(allowed(path, None, false), "{path}");
        }
    }
}
