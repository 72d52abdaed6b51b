//! One node as the router sees it: its role, address and channel, the health and `Info` of
//! its last check, and the requests this router has in flight on it. Which nodes exist and
//! how they are checked and chosen is the registry's ([`super::Registry`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pd_proto::pb;
use pd_proto::pb::decode_service_client::DecodeServiceClient;
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use tonic::transport::Channel;

use pd_engine::kv::prefix::hash::HashAlgo;
use pd_engine::serve::Role;

use super::NODE_MAX_MESSAGE_BYTES;
use super::breaker::{Breaker, Permit};

/// What the router currently believes about a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeHealth {
    /// Not checked yet.
    Unknown,
    Up,
    Down(String),
}

/// The KV layout two nodes must share for KV to move between them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    pub fingerprint: String,
    pub block_size: u32,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fingerprint {} block size {}",
            self.fingerprint, self.block_size
        )
    }
}

#[derive(Debug)]
struct NodeState {
    health: NodeHealth,
    info: Option<pb::NodeInfo>,
}

/// Block size assumed for a node that has not reported one (the engines' default).
const DEFAULT_BLOCK_SIZE: usize = 16;

/// One node: its address, channel, last known state and the router's in-flight count.
#[derive(Debug)]
pub struct Node {
    /// Unique within the registry (prefill and decode nodes share the numbering).
    pub id: usize,
    pub role: Role,
    pub addr: String,
    channel: Channel,
    state: Mutex<NodeState>,
    inflight: AtomicU64,
    /// Incremented each time the node comes (back) up.
    epoch: AtomicU64,
    /// Found through DNS (removed when it leaves DNS) rather than given on the command line.
    pub(super) discovered: bool,
    /// Set when it left the registry: its health task stops.
    pub(super) removed: AtomicBool,
    /// Decode nodes: the prefill KV addresses this node acknowledged (`SetKvPeers`) and the
    /// node process (counter epoch) that did; `None` until the first push succeeds.
    kv_peers: Mutex<Option<PushedPeers>>,
    /// Opens after consecutive failed requests (see [`Breaker`]).
    breaker: Breaker,
}

/// A peer set a decode node acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PushedPeers {
    /// The node process's counter epoch: a restarted node has a new one and an empty set.
    pub epoch: u64,
    /// Sorted, without duplicates.
    pub addrs: Vec<String>,
}

impl Node {
    pub(super) fn new(
        id: usize,
        role: Role,
        addr: String,
        channel: Channel,
        discovered: bool,
        breaker: Breaker,
    ) -> Self {
        Self {
            id,
            role,
            addr,
            channel,
            state: Mutex::new(NodeState {
                health: NodeHealth::Unknown,
                info: None,
            }),
            inflight: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            discovered,
            removed: AtomicBool::new(false),
            kv_peers: Mutex::new(None),
            breaker,
        }
    }

    /// The node's circuit breaker.
    pub fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    /// Up, and its circuit breaker lets a request through: a candidate for routing.
    pub fn is_routable(&self) -> bool {
        self.is_up() && self.breaker().admits(std::time::Instant::now())
    }

    /// The right to send this node one request ([`Breaker::begin`]); `None` while its
    /// breaker is open or its half-open probe is out.
    pub fn begin(&self) -> Option<Permit> {
        self.breaker().begin(std::time::Instant::now())
    }

    /// The peer set this decode node last acknowledged.
    pub(super) fn pushed_peers(&self) -> Option<PushedPeers> {
        self.kv_peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn set_pushed_peers(&self, pushed: Option<PushedPeers>) {
        *self.kv_peers.lock().unwrap_or_else(|e| e.into_inner()) = pushed;
    }

    /// Whether this decode node was told it may pull from the prefill KV address `addr`.
    pub fn knows_kv_peer(&self, addr: &str) -> bool {
        self.kv_peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|p| p.addrs.iter().any(|a| a == addr))
    }

    fn state(&self) -> MutexGuard<'_, NodeState> {
        // The state is a plain value: a panic elsewhere cannot leave it half-written.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn prefill_client(&self) -> PrefillServiceClient<Channel> {
        PrefillServiceClient::new(self.channel.clone())
            .max_decoding_message_size(NODE_MAX_MESSAGE_BYTES)
    }

    pub fn decode_client(&self) -> DecodeServiceClient<Channel> {
        DecodeServiceClient::new(self.channel.clone())
            .max_decoding_message_size(NODE_MAX_MESSAGE_BYTES)
    }

    pub fn health(&self) -> NodeHealth {
        self.state().health.clone()
    }

    pub fn is_up(&self) -> bool {
        self.state().health == NodeHealth::Up
    }

    /// The last good `Info`.
    pub fn info(&self) -> Option<pb::NodeInfo> {
        self.state().info.clone()
    }

    /// The context length from the last good `Info` (0: not reported).
    pub fn max_model_len(&self) -> u32 {
        self.state().info.as_ref().map_or(0, |i| i.max_model_len)
    }

    pub fn layout(&self) -> Option<Layout> {
        self.state().info.as_ref().map(|i| Layout {
            fingerprint: i.layout_fingerprint.clone(),
            block_size: i.block_size,
        })
    }

    /// Tokens per KV block from the last good `Info`, else the engines' default (16); never 0.
    pub fn block_size(&self) -> usize {
        let reported = self.state().info.as_ref().map(|i| i.block_size as usize);
        reported.filter(|b| *b > 0).unwrap_or(DEFAULT_BLOCK_SIZE)
    }

    /// The KV cache's element type from the last good `Info` (part of the fingerprint;
    /// reported to explain a mismatch). Empty if not reported.
    pub fn kv_cache_dtype(&self) -> String {
        self.state()
            .info
            .as_ref()
            .map_or_else(String::new, |i| i.kv_cache_dtype.clone())
    }

    /// Running + waiting (from the last `Info`) + this router's in-flight requests.
    pub fn load(&self) -> u64 {
        let reported = self
            .state()
            .info
            .as_ref()
            .map_or(0, |i| u64::from(i.num_running) + u64::from(i.num_waiting));
        reported + self.inflight()
    }

    /// Changes each time the node comes (back) up: it may have restarted with an empty cache.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Requests this router has in flight on the node.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Counts a request on this node until the guard is dropped.
    pub fn track(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard(self.clone())
    }

    /// Takes the node out of routing until its next good health check. True if it was up.
    pub fn mark_down(&self, reason: impl Into<String>) -> bool {
        let reason = reason.into();
        let mut state = self.state();
        let was_up = state.health == NodeHealth::Up;
        if was_up {
            tracing::warn!(node = %self.addr, role = %self.role, %reason, "node marked down");
        }
        state.health = NodeHealth::Down(reason);
        was_up
    }

    /// Applies one health check's outcome; returns whether up/down changed.
    /// A node whose `Info` names another block hash algorithm than `algo` is down: the
    /// router's prefix-aware routing and the node's cache would disagree on every hash.
    pub(super) fn record(
        &self,
        outcome: Result<pb::NodeInfo, String>,
        model: &str,
        algo: HashAlgo,
    ) -> bool {
        let health = match &outcome {
            Err(reason) => NodeHealth::Down(reason.clone()),
            Ok(info) if HashAlgo::from_reported(&info.prefix_caching_hash_algo) != Ok(algo) => {
                NodeHealth::Down(format!(
                    "it hashes prefix-cache blocks with `{}`, the router with `{algo}`: give \
                     router and nodes the same --prefix-caching-hash-algo",
                    info.prefix_caching_hash_algo
                ))
            }
            Ok(info)
                if pd_proto::convert::role(info.role()).is_some_and(|role| role != self.role) =>
            {
                NodeHealth::Down(format!(
                    "it reports role {:?} but was given as --{}",
                    info.role(),
                    self.role
                ))
            }
            Ok(info) if !info.healthy => NodeHealth::Down("it reports itself unhealthy".into()),
            Ok(_) => NodeHealth::Up,
        };
        let algo_mismatch = matches!(&outcome,
            Ok(info) if HashAlgo::from_reported(&info.prefix_caching_hash_algo) != Ok(algo));
        let mut state = self.state();
        let was_up = state.health == NodeHealth::Up;
        let is_up = health == NodeHealth::Up;
        if let Ok(info) = outcome {
            if !model.is_empty() && !info.model.is_empty() && info.model != model {
                let first = state
                    .info
                    .as_ref()
                    .is_none_or(|old| old.model != info.model);
                if first {
                    tracing::warn!(node = %self.addr, node_model = %info.model, router_model = %model,
                        "node serves a model of another name than the router's");
                }
            }
            state.info = Some(info);
        }
        match (&state.health, &health) {
            (old, NodeHealth::Down(reason)) if algo_mismatch && *old != health => {
                tracing::warn!(node = %self.addr, role = %self.role, %reason,
                    "node refused: its prefix caching hash algorithm differs from the router's")
            }
            (NodeHealth::Up, NodeHealth::Down(reason)) => {
                tracing::warn!(node = %self.addr, role = %self.role, %reason, "node down")
            }
            (NodeHealth::Unknown, NodeHealth::Down(reason)) => {
                tracing::info!(node = %self.addr, role = %self.role, %reason, "node not up yet")
            }
            (NodeHealth::Unknown | NodeHealth::Down(_), NodeHealth::Up) => {
                self.epoch.fetch_add(1, Ordering::Relaxed);
                tracing::info!(node = %self.addr, role = %self.role, "node up")
            }
            _ => {}
        }
        state.health = health;
        was_up != is_up
    }
}

/// Decrements a node's in-flight count on drop.
#[derive(Debug)]
pub struct InflightGuard(Arc<Node>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}
