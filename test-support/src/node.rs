//! Prefill and decode nodes started in this process through their libraries on 127.0.0.1
//! with ephemeral ports (real gRPC, real KV transport), clients to them, and stopping them
//! cleanly once every KV block is free again.
//!
//! A node's tasks run on the runtime of the test that starts it, so a node lives within one
//! `#[tokio::test]`.

use std::future::Future;
use std::pin::Pin;
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

use crate::cache;

/// A node running in this process.
pub struct Node {
    pub ready: pd_node::Ready,
    stop: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
    /// Decode nodes: KV-transfer counters.
    pub transfers: Option<Arc<TransferStats>>,
    /// Decode nodes: the requests held open.
    requests: Option<Arc<pd_node::Requests>>,
}

/// A prefill node with these command-line flags, its model cached in [`cache`].
pub async fn prefill_node(flags: &[&str]) -> Node {
    let mut args =
        PrefillArgs::try_parse_from(["prefill-node"].iter().chain(flags)).expect("flags");
    args.node.synthetic_cache_dir = Some(cache().to_path_buf());
    let node = prefill_node::start(args)
        .await
        .expect("prefill node starts");
    let ready = node.ready().clone();
    spawn(ready, None, |stopped| node.run(stopped))
}

/// A decode node with these command-line flags, its model cached in [`cache`].
pub async fn decode_node(flags: &[&str]) -> Node {
    let mut args = DecodeArgs::try_parse_from(["decode-node"].iter().chain(flags)).expect("flags");
    args.node.synthetic_cache_dir = Some(cache().to_path_buf());
    let node = decode_node::start(args).await.expect("decode node starts");
    let ready = node.ready().clone();
    let transfers = Some(node.transfer_stats());
    let requests = Some(node.requests());
    let mut node = spawn(ready, transfers, |stopped| node.run(stopped));
    node.requests = requests;
    node
}

/// Runs a started node (`run`, given the future that ends at [`Node::shutdown`]) on this
/// runtime.
fn spawn<F>(
    ready: pd_node::Ready,
    transfers: Option<Arc<TransferStats>>,
    run: impl FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>) -> F,
) -> Node
where
    F: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(run(Box::pin(async {
        let _ = stopped.await;
    })));
    Node {
        ready,
        stop,
        task,
        transfers,
        requests: None,
    }
}

/// A gRPC channel to `addr`.
pub async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("a URL")
        .connect()
        .await
        .expect("connects")
}

impl Node {
    pub fn url(&self) -> String {
        format!("http://{}", self.ready.grpc)
    }

    pub async fn prefill(&self) -> PrefillServiceClient<Channel> {
        PrefillServiceClient::connect(self.url())
            .await
            .expect("connects")
    }

    pub async fn decode(&self) -> DecodeServiceClient<Channel> {
        DecodeServiceClient::connect(self.url())
            .await
            .expect("connects")
    }

    /// Tell this decode node it may pull KV from these addresses (what the router's registry
    /// does), the whole set.
    pub async fn set_kv_peer_addrs(&self, addrs: &[String]) {
        self.decode()
            .await
            .set_kv_peers(pb::SetKvPeersRequest {
                kv_addrs: addrs.to_vec(),
            })
            .await
            .expect("SetKvPeers");
    }

    /// Tell this decode node it may pull KV from these prefill nodes.
    pub async fn set_kv_peers(&self, prefill: &[&Node]) {
        let addrs: Vec<String> = prefill
            .iter()
            .map(|p| p.ready.kv.expect("a prefill node's KV address").to_string())
            .collect();
        self.set_kv_peer_addrs(&addrs).await;
    }

    pub async fn info(&self) -> pb::NodeInfo {
        let request = pb::InfoRequest {};
        if self.ready.role == Role::Prefill {
            self.prefill().await.info(request).await
        } else {
            self.decode().await.info(request).await
        }
        .expect("info")
        .into_inner()
    }

    /// Decode nodes: how many requests are open (running, waiting, or still pulling KV).
    pub fn open_requests(&self) -> usize {
        self.requests.as_ref().expect("a decode node").len()
    }

    /// Decode nodes: the KV blocks pulled so far.
    pub fn blocks_pulled(&self) -> u64 {
        self.transfers
            .as_ref()
            .expect("a decode node")
            .snapshot()
            .blocks_pulled
    }

    /// Every KV block free and no request open (polled: counters publish after each step,
    /// and leases are released or expire asynchronously).
    pub async fn assert_all_blocks_free(&self) {
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

    /// [`Node::assert_all_blocks_free`], then [`Node::shutdown`].
    pub async fn stop(self) {
        self.assert_all_blocks_free().await;
        self.shutdown().await;
    }

    /// Trigger the shutdown without waiting for it, to watch the node drain: its ready line
    /// and its task, which ends when the node has stopped.
    pub fn begin_shutdown(self) -> (pd_node::Ready, JoinHandle<anyhow::Result<()>>) {
        self.stop.send(()).expect("the node is running");
        (self.ready, self.task)
    }

    /// Trigger the shutdown and wait for the node to stop; it must stop cleanly.
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the node stops")
            .expect("node task")
            .expect("clean stop");
    }
}
