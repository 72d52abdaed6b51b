//! The nodes the router knows: static addresses from the command line, kept current by
//! active health checks.
//!
//! Every `--health-interval`, each node's `Info` is called with a `--health-timeout`
//! deadline. A node is **up** while its last answer came in time, reported `healthy`, and
//! named the role it was given on the command line; otherwise it is **down** (with the
//! reason) and no request is routed to it. A request that finds a node unreachable marks it
//! down at once; the next good `Info` brings it back. Channels connect lazily and reconnect
//! on their own, so a restarted node is used again without restarting the router.
//!
//! Load of a node = `num_running + num_waiting` from its last `Info` + the requests this
//! router has in flight on it (which counts new work between two polls).
//!
//! KV moves only between a prefill and a decode node with equal layout fingerprints and block
//! sizes; [`Registry::prefill_candidates`] offers only prefill nodes that have such a decode
//! partner up, and explains the mismatch when none has. The router's gRPC health is SERVING
//! exactly when at least one such pair is up.
//!
//! **Aggregated mode**: with decode nodes only (no `--prefill`), no KV moves between nodes:
//! each request goes whole to one decode node, which computes its prompt too. Any up decode
//! node is a candidate and the router is SERVING while one is up.
//!
//! **KV peers**: a decode node pulls KV only from the prefill nodes the router names
//! (`SetKvPeers`: the `kv_transport_addr` of every prefill node that has reported one, the
//! whole set each time; empty in aggregated mode). A decode node is up only once it
//! acknowledged the current set in the same process (its counter epoch): each health check
//! of a decode node pushes the set when the node has not acknowledged it (first check, a
//! restart, a change), and a failed push keeps the node down. A prefill node whose check
//! changes the set is recorded (and so routed to) only after the set went to every decode
//! node; a decode node that cannot take it is marked down until its next check.
//!
//! **Membership** changes at run time when nodes come from DNS ([`crate::discovery`]): a
//! discovered node is added with its own health-check task and is routed to once a check
//! finds it up; a node that leaves DNS is removed from the list at once (its health task
//! stops), while requests already on it keep their `Arc<Node>` and finish. Readers take a
//! snapshot of the list ([`Registry::nodes`]).
//!
//! **Cache events**: next to its health checks, every node has one `CacheEvents`
//! subscription (`feed`) on its own channel, feeding the router's one cache index
//! ([`Registry::cache_index`], bounded by `--cache-index-blocks`) that the prefix-aware
//! policy reads; a node that leaves the registry leaves the index.

mod breaker;
mod feed;
mod node;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use pd_proto::pb;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::transport::Endpoint;

use crate::cache_index::SharedIndex;
use crate::error::RouterError;
use crate::metrics::RouterMetrics;

pub use breaker::{Breaker, BreakerConfig, BreakerState, Permit};
use node::PushedPeers;
pub use node::{InflightGuard, Layout, Node, NodeHealth};
/// A node's role: the workspace's one role type (the router registers `Prefill` and
/// `Decode` nodes; `Mixed` is an engine setting no node reports).
pub use pd_engine::serve::Role;

/// Largest node message the router decodes (prompt logprobs of a long prompt are large).
pub const NODE_MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Block entries the cache index holds over all nodes unless `--cache-index-blocks` says.
pub const DEFAULT_CACHE_INDEX_BLOCKS: usize = 2 << 20;

/// How long opening a connection to a node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Which roles also get nodes from DNS (`--prefill-dns`, `--decode-dns`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DnsRoles {
    pub prefill: bool,
    pub decode: bool,
}

/// All nodes, and whether the cluster can serve.
#[derive(Debug)]
pub struct Registry {
    nodes: RwLock<Vec<Arc<Node>>>,
    next_id: AtomicUsize,
    /// No prefill nodes configured, neither static nor by DNS.
    aggregated: bool,
    /// Where the health-check tasks of nodes added later run.
    tasks: Mutex<Option<tokio::runtime::Handle>>,
    model: String,
    /// The router's `--prefix-caching-hash-algo`: a node that hashes otherwise is down.
    hash_algo: pd_engine::kv::prefix::hash::HashAlgo,
    /// Every node's circuit breaker settings (`--circuit-breaker-*`).
    breaker: BreakerConfig,
    serving: watch::Sender<bool>,
    /// The last "up but cannot pair" explanation logged, so that each is logged once.
    unpaired: Mutex<Option<String>>,
    /// Receives every node's counter report from the health checks.
    metrics: Arc<RouterMetrics>,
    /// TLS of the channels to the nodes (`--tls-ca`), `None`: plaintext.
    tls: Option<pd_tls::ClientTls>,
    /// Held while a health check pushes KV peers or records a prefill node (see the module
    /// documentation, "KV peers").
    peers_lock: tokio::sync::Mutex<()>,
    /// What every node's prefix cache holds, as its cache events say (see the module doc).
    cache_index: Arc<SharedIndex>,
    /// Whether each node's cache events are followed (`--cache-events`).
    follow_cache_events: bool,
}

impl Registry {
    /// Nodes from `host:port` (or `http://host:port`) addresses. Connects lazily, with TLS
    /// when `tls` is given. `dns` says which roles also get nodes from DNS later
    /// ([`crate::discovery`]).
    pub fn new(
        prefill: &[String],
        decode: &[String],
        dns: DnsRoles,
        model: impl Into<String>,
        metrics: Arc<RouterMetrics>,
        tls: Option<pd_tls::ClientTls>,
    ) -> Result<Self, RouterError> {
        if decode.is_empty() && !dns.decode {
            return Err(RouterError::NoNodes);
        }
        let registry = Self {
            nodes: RwLock::new(Vec::new()),
            next_id: AtomicUsize::new(0),
            aggregated: prefill.is_empty() && !dns.prefill,
            tasks: Mutex::new(None),
            model: model.into(),
            hash_algo: Default::default(),
            breaker: BreakerConfig::default(),
            serving: watch::Sender::new(false),
            unpaired: Mutex::new(None),
            metrics,
            tls,
            peers_lock: tokio::sync::Mutex::new(()),
            cache_index: Arc::new(SharedIndex::new(DEFAULT_CACHE_INDEX_BLOCKS)),
            follow_cache_events: true,
        };
        let all = prefill
            .iter()
            .map(|a| (Role::Prefill, a))
            .chain(decode.iter().map(|a| (Role::Decode, a)));
        for (role, addr) in all {
            let node = registry.make_node(role, addr, false)?;
            registry.write_nodes().push(node);
        }
        Ok(registry)
    }

    /// Routes only to nodes whose prefix cache hashes blocks with `algo` (XXH3 unless set).
    pub fn with_hash_algo(mut self, algo: pd_engine::kv::prefix::hash::HashAlgo) -> Self {
        self.hash_algo = algo;
        self
    }

    /// The cache index holds at most `max_blocks` block entries over all nodes
    /// (`--cache-index-blocks`).
    pub fn with_cache_index_blocks(mut self, max_blocks: usize) -> Self {
        self.cache_index = Arc::new(SharedIndex::new(max_blocks));
        self
    }

    /// Follow the nodes' cache events (`true`, the default) or none (`--cache-events off`).
    pub fn with_cache_events(mut self, follow: bool) -> Self {
        self.follow_cache_events = follow;
        self
    }

    /// What every node's prefix cache holds, as its cache events say (keyed by node id).
    pub fn cache_index(&self) -> &Arc<SharedIndex> {
        &self.cache_index
    }

    /// Every node's circuit breaker, of the nodes given so far and of those added later,
    /// works with `config`.
    pub fn with_breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = config;
        for node in self.nodes() {
            node.breaker().configure(config);
        }
        self
    }

    fn make_node(
        &self,
        role: Role,
        addr: &str,
        discovered: bool,
    ) -> Result<Arc<Node>, RouterError> {
        let addr = addr.trim();
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("{}://{addr}", pd_tls::scheme(self.tls.as_ref()))
        };
        let bad = |message: String| RouterError::BadAddress {
            role,
            addr: addr.to_string(),
            message,
        };
        let endpoint = Endpoint::from_shared(uri)
            .map_err(|e| bad(format!("{e} (expected host:port)")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        if endpoint.uri().port_u16().is_none() {
            return Err(bad("no port (expected host:port)".into()));
        }
        Ok(Arc::new(Node::new(
            self.next_id.fetch_add(1, Ordering::Relaxed),
            role,
            addr.trim_start_matches("http://").to_string(),
            // TCP with TCP_NODELAY, then TLS when configured.
            endpoint.connect_with_connector_lazy(pd_tls::Connector::new(self.tls.clone())),
            discovered,
            Breaker::new(self.breaker),
        )))
    }

    fn write_nodes(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Node>>> {
        // The list is replaced whole on every change: a panic elsewhere cannot leave it torn.
        self.nodes.write().unwrap_or_else(|e| e.into_inner())
    }

    /// A snapshot of the nodes, in the order they were added.
    pub fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A snapshot of the nodes of one role.
    pub fn role(&self, role: Role) -> Vec<Arc<Node>> {
        self.nodes()
            .into_iter()
            .filter(|n| n.role == role)
            .collect()
    }

    /// Adds a node found through DNS (unless one with this role and address is there) and
    /// starts its health checks; it is routed to once a check finds it up.
    pub fn add_discovered(
        self: &Arc<Self>,
        role: Role,
        addr: &str,
        interval: Duration,
        timeout: Duration,
    ) -> Result<(), RouterError> {
        if self
            .nodes()
            .iter()
            .any(|n| n.role == role && n.addr == addr)
        {
            return Ok(());
        }
        let node = self.make_node(role, addr, true)?;
        self.write_nodes().push(node.clone());
        let runtime = self.tasks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match runtime {
            Some(runtime) => {
                if self.follow_cache_events {
                    runtime.spawn(feed::follow(
                        node.clone(),
                        self.cache_index.clone(),
                        self.metrics.clone(),
                    ));
                }
                runtime.spawn(Self::health_loop(self.clone(), node, interval, timeout));
            }
            None => tracing::warn!(%addr, "no runtime for health checks yet; node stays unchecked"),
        }
        Ok(())
    }

    /// Removes a node that left DNS: no new request goes to it; those on it finish.
    pub fn remove_discovered(&self, role: Role, addr: &str) {
        let mut nodes = self.write_nodes();
        nodes.retain(|n| {
            let gone = n.discovered && n.role == role && n.addr == addr;
            if gone {
                n.removed.store(true, Ordering::Relaxed);
                // Its subscription ends on its own and removes it again (after a message it
                // may have been applying).
                self.cache_index.update(|ix| ix.remove(n.id));
            }
            !gone
        });
        drop(nodes);
        self.refresh();
    }

    /// No prefill nodes: decode nodes serve whole requests (see the module doc).
    pub fn aggregated(&self) -> bool {
        self.aggregated
    }

    /// Whether at least one prefill node and one decode node with the same layout are up;
    /// follows every change.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// Starts one health-check task and one cache-events subscription per node in `tasks`
    /// (they stop when it is dropped); nodes added later get theirs on the same runtime.
    pub fn spawn_health_checks(
        self: &Arc<Self>,
        interval: Duration,
        timeout: Duration,
        tasks: &mut JoinSet<()>,
    ) {
        *self.tasks.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(tokio::runtime::Handle::current());
        for node in self.nodes() {
            if self.follow_cache_events {
                tasks.spawn(feed::follow(
                    node.clone(),
                    self.cache_index.clone(),
                    self.metrics.clone(),
                ));
            }
            tasks.spawn(Self::health_loop(self.clone(), node, interval, timeout));
        }
    }

    async fn health_loop(
        registry: Arc<Self>,
        node: Arc<Node>,
        interval: Duration,
        timeout: Duration,
    ) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if node.removed.load(Ordering::Relaxed) {
                return;
            }
            registry.check(&node, timeout).await;
        }
    }

    /// One health check of one node.
    pub async fn check(&self, node: &Node, timeout: Duration) {
        let mut request = tonic::Request::new(pb::InfoRequest {});
        request.set_timeout(timeout);
        let call = async {
            // The router registers prefill and decode nodes only; a mixed engine would be
            // reached as a decode node (a decode node's engine is mixed).
            match node.role {
                Role::Prefill => node.prefill_client().info(request).await,
                Role::Decode | Role::Mixed => node.decode_client().info(request).await,
            }
        };
        let outcome = match tokio::time::timeout(timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => Err(format!(
                "it does not serve pd.v1.{}Service: is it a {} node, given as --{}?",
                if node.role == Role::Prefill {
                    "Prefill"
                } else {
                    "Decode"
                },
                match node.role {
                    Role::Prefill => Role::Decode,
                    Role::Decode | Role::Mixed => Role::Prefill,
                },
                node.role,
            )),
            Ok(Err(status)) => Err(format!(
                "Info failed: {:?}: {}",
                status.code(),
                status.message()
            )),
            Err(_) => Err(format!("Info did not answer within {timeout:?}")),
        };
        if let Ok(info) = &outcome {
            self.metrics.observe_report(node, info.counters.as_ref());
        }
        match (node.role, outcome) {
            (Role::Decode, Ok(info)) => {
                // Serialized with prefill nodes' records: the set pushed here includes every
                // prefill node recorded before, and one recorded later pushes to this node.
                let _peers = self.peers_lock.lock().await;
                let want = self.kv_peer_set(None);
                let outcome = Self::push_peers(node, &info, &want, timeout)
                    .await
                    .map(|()| info);
                node.record(outcome, &self.model, self.hash_algo);
            }
            (Role::Prefill, Ok(info)) => {
                // Every decode node learns a new prefill KV address before any request can
                // take this node (it is routed to once recorded up).
                let _peers = self.peers_lock.lock().await;
                let want = self.kv_peer_set(Some((node, &info)));
                if want != self.kv_peer_set(None) {
                    self.push_peers_to_all(&want, timeout).await;
                }
                node.record(Ok(info), &self.model, self.hash_algo);
            }
            (_, outcome) => {
                node.record(outcome, &self.model, self.hash_algo);
            }
        }
        self.refresh();
    }

    /// The prefill KV addresses decode nodes may pull from: every prefill node's last
    /// reported `kv_transport_addr` (with `update`'s new `Info` in place of its last), sorted,
    /// without duplicates. Empty in aggregated mode.
    fn kv_peer_set(&self, update: Option<(&Node, &pb::NodeInfo)>) -> Vec<String> {
        let mut addrs: Vec<String> = self
            .role(Role::Prefill)
            .iter()
            .filter_map(|n| match update {
                Some((u, info)) if u.id == n.id => Some(info.kv_transport_addr.clone()),
                _ => n.info().map(|i| i.kv_transport_addr),
            })
            .filter(|a| !a.is_empty())
            .collect();
        addrs.sort();
        addrs.dedup();
        addrs
    }

    /// Send `want` to decode node `node` (whose `Info` is `info`) unless this node process
    /// acknowledged it already; the reason it is down if that fails.
    async fn push_peers(
        node: &Node,
        info: &pb::NodeInfo,
        want: &[String],
        timeout: Duration,
    ) -> Result<(), String> {
        let epoch = info.counters.as_ref().map_or(0, |c| c.epoch);
        let pushed = node.pushed_peers();
        if pushed
            .as_ref()
            .is_some_and(|p| p.epoch == epoch && p.addrs == want)
        {
            return Ok(());
        }
        let mut request = tonic::Request::new(pb::SetKvPeersRequest {
            kv_addrs: want.to_vec(),
        });
        request.set_timeout(timeout);
        let mut client = node.decode_client();
        match tokio::time::timeout(timeout, client.set_kv_peers(request)).await {
            Ok(Ok(_)) => {
                tracing::info!(node = %node.addr, peers = ?want, "decode node told its prefill KV peers");
                node.set_pushed_peers(Some(PushedPeers {
                    epoch,
                    addrs: want.to_vec(),
                }));
                Ok(())
            }
            Ok(Err(status)) => Err(format!(
                "SetKvPeers failed: {:?}: {}",
                status.code(),
                status.message()
            )),
            Err(_) => Err(format!("SetKvPeers did not answer within {timeout:?}")),
        }
    }

    /// Send `want` to every decode node that acknowledged a set before, concurrently; one
    /// that cannot take it is marked down (its next health check tries again). The others
    /// get it with their first good health check.
    async fn push_peers_to_all(&self, want: &[String], timeout: Duration) {
        let mut pushes = JoinSet::new();
        for node in self.role(Role::Decode) {
            let Some(pushed) = node.pushed_peers() else {
                continue;
            };
            // The node process that acknowledged the last set (a restarted one gets the set
            // again at its next check, which sees a new epoch).
            let info = pb::NodeInfo {
                counters: Some(pb::CounterReport {
                    epoch: pushed.epoch,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let want = want.to_vec();
            pushes.spawn(async move {
                if let Err(reason) = Self::push_peers(&node, &info, &want, timeout).await {
                    node.mark_down(reason);
                }
            });
        }
        while pushes.join_next().await.is_some() {}
    }

    /// Recomputes the serving flag (after any change of a node's health).
    pub fn refresh(&self) {
        // With prefill nodes: serving when one up prefill node has an up decode node of its
        // layout, which is exactly when there are prefill candidates.
        let (serving, unpaired) = if self.aggregated() {
            (
                self.role(Role::Decode).iter().any(|n| n.is_routable()),
                None,
            )
        } else {
            match self.prefill_candidates(&[]) {
                Ok(_) => (true, None),
                // Up but unable to pair (another block size, model or KV cache type): NOT_SERVING
                // with no node down, so the log says why, once per explanation.
                Err(e @ RouterError::IncompatibleLayouts { .. }) => (false, Some(e.to_string())),
                Err(_) => (false, None),
            }
        };
        self.serving.send_if_modified(|s| {
            let changed = *s != serving;
            *s = serving;
            changed
        });
        let mut last = self.unpaired.lock().unwrap_or_else(|e| e.into_inner());
        if unpaired != *last {
            if let Some(reason) = &unpaired {
                tracing::warn!(%reason, "router not serving");
            }
            *last = unpaired;
        }
    }

    /// The context length requests are validated against: the model's, lowered to the
    /// smallest `max_model_len` an up node reports.
    pub fn context_len(&self, model_max: usize) -> usize {
        // Runs on every request: reads the one number, not a clone of each node's Info.
        self.nodes()
            .iter()
            .filter(|n| n.is_up())
            .map(|n| n.max_model_len() as usize)
            .filter(|&m| m > 0)
            .fold(model_max, usize::min)
    }

    /// Up prefill nodes (not in `exclude`) that have an up decode node of the same layout,
    /// in registry order.
    pub fn prefill_candidates(&self, exclude: &[usize]) -> Result<Vec<Arc<Node>>, RouterError> {
        let all_prefill = self.role(Role::Prefill);
        let prefill: Vec<&Arc<Node>> = all_prefill
            .iter()
            .filter(|n| !exclude.contains(&n.id))
            .collect();
        let up_prefill: Vec<&Arc<Node>> = prefill
            .iter()
            .copied()
            .filter(|n| n.is_routable())
            .collect();
        if up_prefill.is_empty() {
            return Err(RouterError::NoHealthyNode {
                role: Role::Prefill,
                detail: describe(prefill.iter().copied(), exclude),
            });
        }
        let all_decode = self.role(Role::Decode);
        let decode: Vec<&Arc<Node>> = all_decode.iter().collect();
        let up_decode: Vec<&Arc<Node>> =
            decode.iter().copied().filter(|n| n.is_routable()).collect();
        if up_decode.is_empty() {
            return Err(RouterError::NoHealthyNode {
                role: Role::Decode,
                detail: describe(decode.iter().copied(), &[]),
            });
        }
        let decode_layouts: Vec<Layout> = up_decode.iter().filter_map(|n| n.layout()).collect();
        let candidates: Vec<Arc<Node>> = up_prefill
            .iter()
            .filter(|n| n.layout().is_some_and(|l| decode_layouts.contains(&l)))
            .map(|n| (*n).clone())
            .collect();
        if candidates.is_empty() {
            return Err(RouterError::IncompatibleLayouts {
                detail: layouts(up_prefill.iter().chain(&up_decode).copied()),
            });
        }
        // ... and that decode node was told it may pull from this prefill node.
        let known: Vec<Arc<Node>> = candidates
            .iter()
            .filter(|p| {
                let kv_addr = p.info().map(|i| i.kv_transport_addr).unwrap_or_default();
                up_decode
                    .iter()
                    .any(|d| d.layout() == p.layout() && d.knows_kv_peer(&kv_addr))
            })
            .cloned()
            .collect();
        if known.is_empty() {
            return Err(RouterError::NoHealthyNode {
                role: Role::Decode,
                detail: "no up decode node has been told about the up prefill nodes' KV \
                         addresses yet (SetKvPeers)"
                    .into(),
            });
        }
        Ok(known)
    }

    /// Up decode nodes (not in `exclude`) with exactly this layout that were told they may
    /// pull from `kv_addr` (the handle's prefill KV address); any layout and no KV address
    /// for `None` (aggregated mode: no KV comes from elsewhere).
    pub fn decode_candidates(
        &self,
        kv: Option<(&Layout, &str)>,
        exclude: &[usize],
    ) -> Result<Vec<Arc<Node>>, RouterError> {
        let all_decode = self.role(Role::Decode);
        let decode: Vec<&Arc<Node>> = all_decode
            .iter()
            .filter(|n| !exclude.contains(&n.id))
            .collect();
        let up: Vec<&Arc<Node>> = decode.iter().copied().filter(|n| n.is_routable()).collect();
        if up.is_empty() {
            return Err(RouterError::NoHealthyNode {
                role: Role::Decode,
                detail: describe(decode.iter().copied(), exclude),
            });
        }
        let Some((layout, kv_addr)) = kv else {
            return Ok(up.into_iter().cloned().collect());
        };
        let matching: Vec<&Arc<Node>> = up
            .iter()
            .copied()
            .filter(|n| n.layout().as_ref() == Some(layout))
            .collect();
        if matching.is_empty() {
            return Err(RouterError::IncompatibleLayouts {
                detail: format!(
                    "the prompt's KV has {layout}; {}",
                    layouts(up.iter().copied())
                ),
            });
        }
        // A decode node refuses KV from a prefill node it was not told about: only those
        // that acknowledged this one (a push may still be on its way to the others).
        let knowing: Vec<Arc<Node>> = matching
            .into_iter()
            .filter(|n| n.knows_kv_peer(kv_addr))
            .cloned()
            .collect();
        if knowing.is_empty() {
            return Err(RouterError::NoHealthyNode {
                role: Role::Decode,
                detail: format!(
                    "no up decode node has been told about the prefill KV address {kv_addr} \
                     yet (SetKvPeers)"
                ),
            });
        }
        Ok(knowing)
    }
}

/// `addr (down: reason), addr (not checked yet)` for error messages.
fn describe<'a>(nodes: impl Iterator<Item = &'a Arc<Node>>, excluded: &[usize]) -> String {
    let mut parts: Vec<String> = nodes
        .map(|n| match n.health() {
            NodeHealth::Up if !n.is_routable() => format!(
                "{} (circuit open after consecutive failures: no requests until its cool-down \
                 ends)",
                n.addr
            ),
            NodeHealth::Up => format!("{} (up)", n.addr),
            NodeHealth::Unknown => format!("{} (not checked yet)", n.addr),
            NodeHealth::Down(reason) => format!("{} (down: {reason})", n.addr),
        })
        .collect();
    if !excluded.is_empty() {
        parts.push(format!("{} already failed this request", excluded.len()));
    }
    if parts.is_empty() {
        "none configured".into()
    } else {
        parts.join(", ")
    }
}

/// `prefill A has fingerprint X block size 16 KV cache bfloat16; decode B has ...`.
fn layouts<'a>(nodes: impl Iterator<Item = &'a Arc<Node>>) -> String {
    nodes
        .map(|n| match n.layout() {
            Some(l) => {
                let dtype = n.kv_cache_dtype();
                let dtype = if dtype.is_empty() {
                    String::new()
                } else {
                    format!(" KV cache {dtype}")
                };
                format!("{} {} has {l}{dtype}", n.role, n.addr)
            }
            None => format!("{} {} has not reported a layout", n.role, n.addr),
        })
        .collect::<Vec<_>>()
        .join("; ")
}
