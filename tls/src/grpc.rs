//! The one gRPC server of every part of the cluster (the router and both node roles): the
//! part's own API plus `grpc.health.v1.Health` and server reflection (v1 and v1alpha), under
//! [`GrpcLimits`] and [`ClusterOnlyLayer`], on a [`Listener`].
//!
//! Reflection lists only what the part serves: its own API, health and reflection itself, not
//! every service of the descriptor sets it was given (the `pd.v1` set describes the router's
//! and both nodes' services; a node advertising the router's API would send a client that
//! reads the list to the wrong door). TCP options are the listener's (it sets `TCP_NODELAY` on
//! each accepted connection: the builder's `tcp_nodelay` does not reach sockets it did not
//! accept itself).

use tonic::service::Routes;
use tonic_health::server::HealthReporter;

use crate::{ClusterOnlyLayer, GrpcLimits, Listener};

/// Building the reflection service failed: a descriptor set that does not decode (a bug).
#[derive(Debug, thiserror::Error)]
#[error("server reflection: {0}")]
pub struct ReflectionError(#[from] tonic_reflection::server::Error);

/// A part's gRPC server, ready to serve.
#[derive(Debug)]
pub struct GrpcServer {
    routes: Routes,
    limits: GrpcLimits,
    requires_client_certs: bool,
}

/// What [`GrpcServer::new`] serves besides health and reflection.
#[derive(Debug, Clone, Copy)]
pub struct Api<'a> {
    /// The full gRPC name of the part's service (`pd.v1.Generation`).
    pub service: &'a str,
    /// The encoded file descriptor set describing it.
    pub descriptor_set: &'static [u8],
}

impl GrpcServer {
    /// `routes` (the part's service, `api`) with health and reflection; the health reporter
    /// starts with nothing set (the part reports its own status). With
    /// `requires_client_certs`, calls without a cluster certificate are UNAUTHENTICATED
    /// (health stays open).
    pub fn new(
        routes: Routes,
        api: Api<'_>,
        limits: GrpcLimits,
        requires_client_certs: bool,
    ) -> Result<(Self, HealthReporter), ReflectionError> {
        let (reporter, health) = tonic_health::server::health_reporter();
        let reflection = |own: &str| {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(api.descriptor_set)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .with_service_name(api.service)
                .with_service_name(tonic_health::pb::health_server::SERVICE_NAME)
                .with_service_name(own)
        };
        let v1 = reflection(tonic_reflection::pb::v1::server_reflection_server::SERVICE_NAME)
            .build_v1()?;
        let v1alpha =
            reflection(tonic_reflection::pb::v1alpha::server_reflection_server::SERVICE_NAME)
                .build_v1alpha()?;
        let routes = routes
            .add_service(health)
            .add_service(v1)
            .add_service(v1alpha);
        let server = Self {
            routes,
            limits,
            requires_client_certs,
        };
        Ok((server, reporter))
    }

    /// Serves on `incoming` until `shutdown` resolves, then lets open calls finish.
    pub async fn serve(
        self,
        incoming: Listener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        self.limits
            .apply(tonic::transport::Server::builder())
            .layer(ClusterOnlyLayer::new(self.requires_client_certs))
            .add_routes(self.routes)
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }
}

#[cfg(test)]
mod tests {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    use super::*;

    /// The services a server built for `service` lists over a real reflection call.
    async fn listed(service: &str) -> Vec<String> {
        let api = Api {
            service,
            descriptor_set: pd_proto::FILE_DESCRIPTOR_SET,
        };
        let (server, _health) =
            GrpcServer::new(Routes::default(), api, GrpcLimits::default(), false).unwrap();
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.serve(Listener::new(tcp, None).unwrap(), async {
            let _ = stopped.await;
        }));
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = ServerReflectionClient::new(channel)
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .unwrap()
            .into_inner();
        let response = responses.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
            panic!("{response:?}")
        };
        let _ = stop.send(());
        serving.await.unwrap().unwrap();
        let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn reflection_lists_only_the_served_api_health_and_itself() {
        let common = [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
        ];
        for (served, others) in [
            (
                "pd.v1.PrefillService",
                ["pd.v1.Generation", "pd.v1.DecodeService"],
            ),
            (
                "pd.v1.DecodeService",
                ["pd.v1.Generation", "pd.v1.PrefillService"],
            ),
            (
                "pd.v1.Generation",
                ["pd.v1.PrefillService", "pd.v1.DecodeService"],
            ),
        ] {
            let names = listed(served).await;
            let mut want: Vec<String> = (common.iter().chain([&served]))
                .map(|s| s.to_string())
                .collect();
            want.sort();
            assert_eq!(names, want, "{served}");
            for other in others {
                assert!(!names.iter().any(|n| n == other), "{served}: {names:?}");
            }
        }
    }
}
