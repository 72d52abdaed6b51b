//! Waiting for a gRPC server to report SERVING on `grpc.health.v1`: what `pdctl up` and the
//! tests do before sending a router work. Does not own the servers' health reporting (each
//! binary sets its own).

use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Why [`wait_serving`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("{addr} is not a usable gRPC address: {source}")]
    BadAddress {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("{addr} did not report SERVING on grpc.health.v1 within {} s", .waited.as_secs())]
    Timeout { addr: String, waited: Duration },
}

/// Poll the server at `addr` (`host:port`) every `every` until its overall health (the empty
/// service name) is SERVING, for at most `timeout`. Connection errors and NOT_SERVING count
/// as "not yet".
pub async fn wait_serving(addr: &str, timeout: Duration, every: Duration) -> Result<(), WaitError> {
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("http://{addr}")).map_err(|source| {
            WaitError::BadAddress {
                addr: addr.to_string(),
                source,
            }
        })?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(channel) = endpoint.connect().await
            && is_serving(channel).await
        {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(WaitError::Timeout {
                addr: addr.to_string(),
                waited: timeout,
            });
        }
        tokio::time::sleep(every).await;
    }
}

/// One check of the overall health (the empty service name) over `channel` (plaintext or
/// TLS): whether the server answered SERVING.
pub async fn is_serving(channel: tonic::transport::Channel) -> bool {
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .is_ok_and(|r| r.into_inner().status() == ServingStatus::Serving)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_nobody_serves_times_out_with_the_address() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let err = wait_serving(&addr, Duration::from_millis(200), Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(err, WaitError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains(&addr), "{err}");
    }

    #[tokio::test]
    async fn a_serving_health_service_is_seen() {
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        wait_serving(&addr, Duration::from_secs(10), Duration::from_millis(20))
            .await
            .unwrap();
    }
}
