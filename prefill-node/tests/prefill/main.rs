//! The prefill node over real gRPC on 127.0.0.1 with ephemeral ports: the service started in
//! process through the library (fast), and once as the real binary (ready line, health,
//! reflection, SIGTERM). Every test checks that all KV blocks came back.
//!
//! This file holds the shared in-process [`Node`] harness and request helpers.

mod abort;
mod binary;
mod requests;
mod sealed;

use std::time::{Duration, Instant};

use clap::Parser;
use pd_proto::pb;
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use prefill_node::PrefillArgs;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub(crate) use pd_test_support::{cache, greedy, prompt};

/// A prefill node running in this process.
pub(crate) struct Node {
    pub(crate) ready: pd_node::Ready,
    pub(crate) stop: Option<oneshot::Sender<()>>,
    pub(crate) task: JoinHandle<anyhow::Result<()>>,
}

impl Node {
    pub(crate) async fn start(flags: &[&str]) -> Node {
        let mut args =
            PrefillArgs::try_parse_from(["prefill-node"].iter().chain(flags)).expect("flags");
        args.node.synthetic_cache_dir = Some(cache().to_path_buf());
        let node = prefill_node::start(args).await.expect("node starts");
        let ready = node.ready().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(node.run(async {
            let _ = stopped.await;
        }));
        Node {
            ready,
            stop: Some(stop),
            task,
        }
    }

    pub(crate) async fn client(&self) -> PrefillServiceClient<Channel> {
        PrefillServiceClient::connect(format!("http://{}", self.ready.grpc))
            .await
            .expect("connects")
    }

    pub(crate) async fn info(&self) -> pb::NodeInfo {
        self.client()
            .await
            .info(pb::InfoRequest {})
            .await
            .expect("info")
            .into_inner()
    }

    /// Wait until every KV block is free (leases released or expired, requests ended).
    pub(crate) async fn assert_all_blocks_free(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = self.info().await;
            if info.free_blocks == info.num_blocks && info.num_running + info.num_waiting == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "blocks still in use: {} of {} free, {} running, {} waiting",
                info.free_blocks,
                info.num_blocks,
                info.num_running,
                info.num_waiting
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Trigger the shutdown and wait for the node to stop; it must stop cleanly.
    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the node stops")
            .expect("node task")
            .expect("clean stop");
    }
}

/// A gRPC channel to `addr`.
pub(crate) async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connects")
}

/// The release of the lease `kv` names, with its secret (as the router sends it).
pub(crate) fn release_of(kv: &pb::KvHandle) -> pb::ReleaseKvRequest {
    pb::ReleaseKvRequest {
        lease_id: kv.lease_id,
        lease_secret: kv.lease_secret.clone(),
    }
}

pub(crate) fn prefill_request(id: &str, token_ids: Vec<u32>) -> pb::PrefillRequest {
    pb::PrefillRequest {
        request_id: id.into(),
        token_ids,
        sampling: greedy(),
        cache_salt: None,
        skip_kv_lease: false,
        ..Default::default()
    }
}
