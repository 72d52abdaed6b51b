//! `--kv-transport`: opening RDMA as the mode asks (or refusing to start, in one sentence
//! that names the fix), the decode node's [`KvImporter`], and the gRPC half of the RDMA
//! endpoint exchange (`PrefillService.RdmaConnect`).

use std::sync::Arc;
use std::time::Duration;

use pd_engine::kv::handoff::placement::HostKvMemory;
use pd_engine::serve::LeaseSecret;
use pd_proto::pb;
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use pd_transport::rdma::{
    BoxFuture, RdmaConnector, RdmaDevice, RdmaReader, RdmaStartError, start_rdma,
};
use pd_transport::{KvImporter, LayoutFingerprint};

use crate::NodeArgs;

/// How long the endpoint exchange may take to connect to the prefill node.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The RDMA device `--kv-transport` asks for: `None` for `tcp`, and for `auto` without a
/// usable device; an error for `rdma` without one (or in a build without RDMA).
pub fn open_rdma(args: &NodeArgs) -> Result<Option<RdmaDevice>, RdmaStartError> {
    let config = args.rdma.config();
    let device = start_rdma(args.kv_transport.mode(), || RdmaDevice::open(&config))?;
    match &device {
        Some(d) => tracing::info!(device = %d.describe(), "KV transport: RDMA, with TCP fallback"),
        None => tracing::info!(mode = ?args.kv_transport, "KV transport: TCP"),
    }
    Ok(device)
}

/// The decode node's importer: RDMA reads through `device` when there is one, landing in
/// place in `host_kv` (the engine's KV memory, registered once here; `None` on a GPU, whose
/// reads land in registered buffers and are copied in).
/// `dial_grpc`: TLS for the RdmaConnect call to prefill nodes (`--tls-ca`).
pub fn importer(
    device: Option<&RdmaDevice>,
    host_kv: Option<HostKvMemory>,
    fingerprint: LayoutFingerprint,
    args: &NodeArgs,
    dial_grpc: Option<pd_tls::ClientTls>,
) -> anyhow::Result<KvImporter> {
    let Some(device) = device else {
        return Ok(KvImporter::tcp_only());
    };
    let reader = RdmaReader::new(
        device,
        Arc::new(GrpcConnector { tls: dial_grpc }),
        fingerprint,
        &args.rdma.config(),
    )?
    .with_host_kv(host_kv);
    Ok(KvImporter::with_rdma(Arc::new(reader)))
}

/// Calls `PrefillService.RdmaConnect` on the prefill node (over TLS when `tls` is given).
#[derive(Debug, Default)]
pub struct GrpcConnector {
    pub tls: Option<pd_tls::ClientTls>,
}

impl RdmaConnector for GrpcConnector {
    fn connect(
        &self,
        addr: String,
        fingerprint: LayoutFingerprint,
        endpoint: Vec<u8>,
        (lease_id, lease_secret): (u64, LeaseSecret),
    ) -> BoxFuture<'static, Result<Vec<u8>, String>> {
        let tls = self.tls.clone();
        Box::pin(async move {
            let scheme = pd_tls::scheme(tls.as_ref());
            let channel = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))
                .map_err(|e| format!("bad address {addr:?}: {e}"))?
                .connect_timeout(CONNECT_TIMEOUT)
                .connect_with_connector(pd_tls::Connector::new(tls))
                .await
                .map_err(|e| format!("cannot reach the prefill node's gRPC server: {e}"))?;
            let answer = PrefillServiceClient::new(channel)
                .rdma_connect(pb::RdmaConnectRequest {
                    layout_fingerprint: fingerprint.to_string(),
                    endpoint,
                    lease_id,
                    lease_secret: lease_secret.as_bytes().to_vec(),
                })
                .await
                .map_err(|s| format!("RdmaConnect: {}: {}", s.code(), s.message()))?;
            Ok(answer.into_inner().endpoint)
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        node: NodeArgs,
    }

    fn args(flags: &[&str]) -> NodeArgs {
        let mut argv = vec!["node"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv).unwrap().node
    }

    /// This machine (like every build machine of the project) has no RDMA device, so what
    /// a node does here is what it does on any host without one.
    #[test]
    fn rdma_without_a_device_or_the_feature_refuses_to_start_in_one_sentence() {
        if pd_transport::rdma::BUILT && RdmaDevice::open(&Default::default()).is_ok() {
            return; // a host with a device: nothing to check here
        }
        let err = open_rdma(&args(&["--kv-transport", "rdma"])).unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("--kv-transport auto or tcp"), "{msg}");
        if pd_transport::rdma::BUILT {
            assert!(matches!(err, RdmaStartError::NoDevice(_)), "{msg}");
            assert!(
                msg.contains("rdma-core") && msg.contains("Soft-RoCE"),
                "{msg}"
            );
        } else {
            assert!(matches!(err, RdmaStartError::NotBuilt), "{msg}");
            assert!(msg.contains("--features rdma"), "{msg}");
        }
    }

    #[test]
    fn auto_and_tcp_start_without_rdma_here() {
        if pd_transport::rdma::BUILT && RdmaDevice::open(&Default::default()).is_ok() {
            return;
        }
        assert!(
            open_rdma(&args(&[])).unwrap().is_none(),
            "auto is the default"
        );
        assert!(
            open_rdma(&args(&["--kv-transport", "tcp"]))
                .unwrap()
                .is_none()
        );
        let importer = importer(None, None, LayoutFingerprint(1), &args(&[]), None).unwrap();
        assert!(importer.rdma_fabric().is_none());
    }

    #[test]
    fn rdma_flags_parse_and_bad_ones_are_refused() {
        let a = args(&[
            "--kv-transport",
            "rdma",
            "--rdma-device",
            "mlx5_1",
            "--rdma-port",
            "2",
            "--rdma-gid-index",
            "3",
        ]);
        let c = a.rdma.config();
        assert_eq!(
            (c.device.as_deref(), c.port, c.gid_index),
            (Some("mlx5_1"), Some(2), Some(3))
        );
        for bad in [
            &["--rdma-port", "0"][..],
            &["--rdma-gid-index", "-1"],
            &["--kv-transport", "infiniband"],
        ] {
            let mut argv = vec!["node"];
            argv.extend_from_slice(bad);
            assert!(Cli::try_parse_from(argv).is_err(), "{bad:?}");
        }
    }
}
