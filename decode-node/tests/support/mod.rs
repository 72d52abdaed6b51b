//! What the in-process node tests share (`cluster.rs`, `metrics.rs`): a prefill and a
//! decode node started through their libraries on 127.0.0.1 with ephemeral ports, clients to
//! them, and stopping them once every KV block is free again.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use decode_node::{DecodeArgs, TransferStats};
use pd_engine::serve::Role;
use pd_proto::pb;
use pd_proto::pb::decode_service_client::DecodeServiceClient;
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use prefill_node::PrefillArgs;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// A cache shared by the tests of one file, so `synthetic:tiny` is written once.
pub(crate) fn cache() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("tempdir"))
        .path()
}

/// A node running in this process.
pub(crate) struct Node {
    pub(crate) ready: pd_node::Ready,
    pub(crate) stop: oneshot::Sender<()>,
    pub(crate) task: JoinHandle<anyhow::Result<()>>,
    /// Decode nodes: KV-transfer counters.
    pub(crate) transfers: Option<Arc<TransferStats>>,
}

pub(crate) async fn prefill_node(flags: &[&str]) -> Node {
    let mut args = PrefillArgs::try_parse_from(["prefill-node"].iter().chain(flags)).unwrap();
    args.node.synthetic_cache_dir = Some(cache().to_path_buf());
    let node = prefill_node::start(args)
        .await
        .expect("prefill node starts");
    let ready = node.ready().clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(node.run(async {
        let _ = stopped.await;
    }));
    Node {
        ready,
        stop,
        task,
        transfers: None,
    }
}

pub(crate) async fn decode_node(flags: &[&str]) -> Node {
    let mut args = DecodeArgs::try_parse_from(["decode-node"].iter().chain(flags)).unwrap();
    args.node.synthetic_cache_dir = Some(cache().to_path_buf());
    let node = decode_node::start(args).await.expect("decode node starts");
    let ready = node.ready().clone();
    let transfers = Some(node.transfer_stats());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(node.run(async {
        let _ = stopped.await;
    }));
    Node {
        ready,
        stop,
        task,
        transfers,
    }
}

impl Node {
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.ready.grpc)
    }

    pub(crate) async fn prefill(&self) -> PrefillServiceClient<Channel> {
        PrefillServiceClient::connect(self.url()).await.unwrap()
    }

    pub(crate) async fn decode(&self) -> DecodeServiceClient<Channel> {
        DecodeServiceClient::connect(self.url()).await.unwrap()
    }

    /// Tell this decode node it may pull KV from these addresses (what the router's registry
    /// does), the whole set.
    pub(crate) async fn set_kv_peer_addrs(&self, addrs: &[String]) {
        self.decode()
            .await
            .set_kv_peers(pb::SetKvPeersRequest {
                kv_addrs: addrs.to_vec(),
            })
            .await
            .expect("SetKvPeers");
    }

    /// Tell this decode node it may pull KV from these prefill nodes.
    pub(crate) async fn set_kv_peers(&self, prefill: &[&Node]) {
        let addrs: Vec<String> = prefill
            .iter()
            .map(|p| p.ready.kv.expect("a prefill node's KV address").to_string())
            .collect();
        self.set_kv_peer_addrs(&addrs).await;
    }

    pub(crate) async fn info(&self) -> pb::NodeInfo {
        let request = pb::InfoRequest {};
        if self.ready.role == Role::Prefill {
            self.prefill().await.info(request).await
        } else {
            self.decode().await.info(request).await
        }
        .unwrap()
        .into_inner()
    }

    pub(crate) fn blocks_pulled(&self) -> u64 {
        self.transfers.as_ref().unwrap().snapshot().blocks_pulled
    }

    /// Every KV block free and no request open (polled: counters publish after each step).
    pub(crate) async fn assert_all_blocks_free(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = self.info().await;
            if info.free_blocks == info.num_blocks && info.num_running + info.num_waiting == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} node: {} of {} blocks free, {} running, {} waiting",
                self.ready.role,
                info.free_blocks,
                info.num_blocks,
                info.num_running,
                info.num_waiting
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(crate) async fn stop(self) {
        self.assert_all_blocks_free().await;
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the node stops")
            .unwrap()
            .expect("clean stop");
    }
}

pub(crate) fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + salt * 104_729 + 11) % 150_000)
        .collect()
}
