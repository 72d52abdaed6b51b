//! What a fake node is told and what it saw: its scripts ([`Script`], [`End`]), its reported
//! [`pb::NodeInfo`], scripted failures, and the requests, leases and aborts it received.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_proto::failure::FailureCause;
use pd_proto::pb;
use tokio::sync::mpsc;
use tonic::{Code, Status};

/// One open `CacheEvents` stream of a fake node.
pub(crate) type CacheEventsTx = mpsc::UnboundedSender<Result<pb::CacheEventsMessage, Status>>;

pub const FINGERPRINT: &str = "f00dcafe";
pub const LOCAL_CACHED: u32 = 16;
pub const EXTERNAL_CACHED: u32 = 32;

/// How a scripted decode stream ends after its messages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum End {
    /// The last message carries this finish reason (and the node's usage).
    Finish(pb::FinishReason),
    /// The stream stays open, sending nothing, until the router drops it.
    Hang,
    /// The stream ends with this error status.
    Fail(Code),
}

#[derive(Debug, Clone)]
pub struct Script {
    /// Tokens of each message.
    pub messages: Vec<Vec<u32>>,
    pub end: End,
    /// Pause before each message.
    pub delay: Duration,
}

impl Default for Script {
    fn default() -> Self {
        Self {
            messages: vec![vec![101, 102]],
            end: End::Finish(pb::FinishReason::Length),
            delay: Duration::ZERO,
        }
    }
}

/// Everything a fake node is told and everything it saw.
#[derive(Debug)]
pub struct FakeState {
    pub role: pb::Role,
    pub fingerprint: Mutex<String>,
    pub block_size: AtomicU32,
    /// `NodeInfo.kv_cache_dtype`.
    pub kv_cache_dtype: Mutex<String>,
    /// `NodeInfo.prefix_caching_hash_algo` (empty: not reported, as an older node).
    pub hash_algo: Mutex<String>,
    /// Reported as `num_waiting`.
    pub load: AtomicU32,
    pub max_model_len: AtomicU32,
    pub unhealthy: AtomicBool,
    /// The next N Prefill / Decode calls fail with `fail_code`.
    pub fail_next: AtomicUsize,
    pub fail_code: Mutex<Code>,
    /// Scripted failures are INTERNAL marked as an engine panic (what a node whose engine
    /// panicked answers), whatever `fail_code` says.
    pub fail_as_panic: AtomicBool,
    /// Scripted failures are UNAVAILABLE marked as a failed KV pull (what a decode node
    /// answers when its prefill node's KV cannot be pulled).
    pub fail_as_kv_pull: AtomicBool,
    pub first_token: AtomicU32,
    pub prefill_delay: Mutex<Duration>,
    pub script: Mutex<Script>,
    /// One-shot scripts by client request id (the node request id's part before `@`): the
    /// next Decode of that id takes its first entry here instead of [`FakeState::script`].
    pub scripts_by_id: Mutex<Vec<(String, Script)>>,
    pub(crate) next_lease: AtomicU64,
    pub prefills: Mutex<Vec<pb::PrefillRequest>>,
    /// Each Prefill's `grpc-timeout` header, as received.
    pub prefill_timeouts: Mutex<Vec<Option<String>>>,
    pub decodes: Mutex<Vec<pb::DecodeRequest>>,
    pub leases: Mutex<Vec<u64>>,
    pub released: Mutex<Vec<u64>>,
    pub aborted: Mutex<Vec<String>>,
    /// Every `SetKvPeers` a fake decode node received, in order.
    pub kv_peers: Mutex<Vec<Vec<String>>>,
    /// The next N `SetKvPeers` calls fail (UNAVAILABLE).
    pub fail_kv_peers: AtomicUsize,
    /// Decode streams the router dropped before they ended.
    pub streams_cancelled: AtomicUsize,
    /// A prefill node's cached tokens (local, external) for requests of a tenant (the node
    /// request id's part between `@` and `/`); others get [`LOCAL_CACHED`] and
    /// [`EXTERNAL_CACHED`].
    pub cached_by_tenant: Mutex<Vec<(String, (u32, u32))>>,
    /// Of a Prefill's external cached tokens, those reported as restored from the host tier
    /// (`Usage.external_host_cached_tokens`, at most the external ones; the rest come from a
    /// peer). All of them unless set: a prefill node's external hits are its host tier's.
    pub host_cached: AtomicU32,
    /// `CacheEvents`: `None` answers UNIMPLEMENTED (a node of an older release); `Some`:
    /// every subscription gets these messages first, then what
    /// [`FakeState::publish_cache_events`] sends, until [`FakeState::end_cache_streams`].
    pub cache_events: Mutex<Option<Vec<pb::CacheEventsMessage>>>,
    pub(crate) cache_streams: Mutex<Vec<CacheEventsTx>>,
    /// `CacheEvents` calls answered with a stream.
    pub cache_subscriptions: AtomicUsize,
    /// The counter report the node sends (in `Info` and, on a prefill node, in every
    /// `PrefillResponse`); none when unset, as a node that does not count.
    pub counters: Mutex<Option<pb::CounterReport>>,
}

impl FakeState {
    pub fn new(role: pb::Role) -> Arc<Self> {
        Arc::new(Self {
            role,
            fingerprint: Mutex::new(FINGERPRINT.into()),
            block_size: AtomicU32::new(16),
            kv_cache_dtype: Mutex::new("float32".into()),
            hash_algo: Mutex::default(),
            load: AtomicU32::new(0),
            max_model_len: AtomicU32::new(4096),
            unhealthy: AtomicBool::new(false),
            fail_next: AtomicUsize::new(0),
            fail_code: Mutex::new(Code::Unavailable),
            fail_as_panic: AtomicBool::new(false),
            fail_as_kv_pull: AtomicBool::new(false),
            first_token: AtomicU32::new(100),
            prefill_delay: Mutex::new(Duration::ZERO),
            script: Mutex::new(Script::default()),
            scripts_by_id: Mutex::default(),
            next_lease: AtomicU64::new(1000),
            prefills: Mutex::default(),
            prefill_timeouts: Mutex::default(),
            decodes: Mutex::default(),
            leases: Mutex::default(),
            released: Mutex::default(),
            aborted: Mutex::default(),
            kv_peers: Mutex::default(),
            fail_kv_peers: AtomicUsize::new(0),
            streams_cancelled: AtomicUsize::new(0),
            cached_by_tenant: Mutex::default(),
            host_cached: AtomicU32::new(u32::MAX),
            cache_events: Mutex::default(),
            cache_streams: Mutex::default(),
            cache_subscriptions: AtomicUsize::new(0),
            counters: Mutex::default(),
        })
    }

    pub(crate) fn info(&self) -> pb::NodeInfo {
        pb::NodeInfo {
            model: "synthetic:tiny".into(),
            role: self.role as i32,
            layout_fingerprint: self.fingerprint.lock().unwrap().clone(),
            block_size: self.block_size.load(Ordering::SeqCst),
            num_blocks: 1000,
            free_blocks: 1000,
            num_running: 0,
            num_waiting: self.load.load(Ordering::SeqCst),
            kv_transport_addr: "127.0.0.1:9".into(),
            vocab_size: 151_936,
            max_model_len: self.max_model_len.load(Ordering::SeqCst),
            healthy: !self.unhealthy.load(Ordering::SeqCst),
            counters: self.counters.lock().unwrap().clone(),
            kv_cache_dtype: self.kv_cache_dtype.lock().unwrap().clone(),
            prefix_caching_hash_algo: self.hash_algo.lock().unwrap().clone(),
        }
    }

    pub(crate) fn scripted_failure(&self) -> Option<Status> {
        let failing = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        failing.then(|| {
            if self.fail_as_panic.load(Ordering::SeqCst) {
                FailureCause::EnginePanic.status(Code::Internal, "scripted engine panic")
            } else if self.fail_as_kv_pull.load(Ordering::SeqCst) {
                FailureCause::KvPull.status(Code::Unavailable, "scripted KV pull failure")
            } else {
                Status::new(*self.fail_code.lock().unwrap(), "scripted failure")
            }
        })
    }

    /// The cached tokens (local, external) a Prefill of `node_request_id` reports.
    pub(crate) fn cached_for(&self, node_request_id: &str) -> (u32, u32) {
        let tenant = node_request_id
            .split_once('@')
            .and_then(|(_, rest)| rest.split('/').next())
            .unwrap_or_default();
        let by_tenant = self.cached_by_tenant.lock().unwrap();
        by_tenant
            .iter()
            .find(|(t, _)| t == tenant)
            .map_or((LOCAL_CACHED, EXTERNAL_CACHED), |(_, c)| *c)
    }

    /// The script of the next Decode of node request id `node_request_id`.
    pub(crate) fn script_for(&self, node_request_id: &str) -> Script {
        let client_id = node_request_id.split('@').next().unwrap_or_default();
        let mut by_id = self.scripts_by_id.lock().unwrap();
        match by_id.iter().position(|(id, _)| id == client_id) {
            Some(i) => by_id.remove(i).1,
            None => self.script.lock().unwrap().clone(),
        }
    }

    /// Sends `message` on every open `CacheEvents` stream.
    pub fn publish_cache_events(&self, message: pb::CacheEventsMessage) {
        let streams = self.cache_streams.lock().unwrap();
        for tx in streams.iter() {
            let _ = tx.send(Ok(message.clone()));
        }
    }

    /// Ends every open `CacheEvents` stream (as a node whose stream broke); later
    /// subscriptions get `then` (`None`: UNIMPLEMENTED).
    pub fn end_cache_streams(&self, then: Option<Vec<pb::CacheEventsMessage>>) {
        *self.cache_events.lock().unwrap() = then;
        self.cache_streams.lock().unwrap().clear();
    }

    pub fn prefill_count(&self) -> usize {
        self.prefills.lock().unwrap().len()
    }

    pub fn decode_count(&self) -> usize {
        self.decodes.lock().unwrap().len()
    }

    pub fn released(&self) -> Vec<u64> {
        self.released.lock().unwrap().clone()
    }

    pub fn aborted(&self) -> Vec<String> {
        self.aborted.lock().unwrap().clone()
    }
}
