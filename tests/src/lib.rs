//! pd-tests: cluster-level tests that run the product's real binaries on 127.0.0.1 with
//! ephemeral ports: `pdctl up` starts a router and real prefill/decode node processes, and
//! the tests talk to it with a gRPC client and with `pdctl` itself.
//!
//! The binaries are found beside the test executable (cargo's target directory); build them
//! first with `cargo build --workspace --bins` (the test script does).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub mod soak;
pub mod tls;

use anyhow::{Context, bail};
use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use serde_json::Value;

/// The directory holding `pdctl`, `router`, `prefill-node`, `decode-node`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    // A test: target/<profile>/deps/<test> → target/<profile>; a binary of this package
    // (`soak`) is in target/<profile> itself.
    let here = exe.parent().expect("target dir");
    let dir = if here.join("router").exists() {
        here.to_path_buf()
    } else {
        here.parent().expect("target dir").to_path_buf()
    };
    for bin in ["pdctl", "router", "prefill-node", "decode-node"] {
        assert!(
            dir.join(bin).exists(),
            "{} is missing: run `cargo build --workspace --bins` first",
            dir.join(bin).display()
        );
    }
    dir
}

/// A running `pdctl up` cluster; dropping it stops the cluster.
pub struct Cluster {
    child: Child,
    pub ready: Value,
    pub cache: PathBuf,
}

impl Cluster {
    /// `pdctl up` with these arguments, synthetic models cached under `cache`.
    pub fn up(cache: &Path, args: &[&str]) -> anyhow::Result<Self> {
        Self::up_with_env(cache, args, &[])
    }

    /// `pdctl up --prefill PREFILL --decode 1` with chunked prefill: the engines compute long
    /// prompts in pieces of 7 tokens (`--max-num-batched-tokens 7`).
    pub fn up_chunked(cache: &Path, prefill: &str) -> anyhow::Result<Self> {
        Self::up(
            cache,
            &[
                "--prefill",
                prefill,
                "--decode",
                "1",
                "--",
                "--max-num-batched-tokens",
                "7",
            ],
        )
    }

    /// [`Cluster::up`] with these environment variables set for every process it starts
    /// (e.g. `PD_*` router settings that `pdctl up` has no flag for).
    pub fn up_with_env(cache: &Path, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let mut child = Command::new(bin_dir().join("pdctl"))
            .arg("up")
            .args(args)
            .envs(env.iter().copied())
            .env("PD_CACHE_DIR", cache)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting pdctl up")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("stdout")?)
            .read_line(&mut line)
            .context("reading pdctl up's ready line")?;
        if line.trim().is_empty() {
            let status = child.wait()?;
            bail!("pdctl up exited before it was ready: {status}");
        }
        let ready: Value =
            serde_json::from_str(&line).with_context(|| format!("ready line {line:?}"))?;
        Ok(Self {
            child,
            ready,
            cache: cache.to_path_buf(),
        })
    }

    /// [`Cluster::up_with_env`] with the router's `--api-keys` file (`PD_API_KEYS_FILE`)
    /// and more environment.
    pub fn up_with_keys(
        cache: &Path,
        args: &[&str],
        keys: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let keys = keys.to_str().context("keys file path")?;
        let mut all = vec![("PD_API_KEYS_FILE", keys)];
        all.extend_from_slice(env);
        Self::up_with_env(cache, args, &all)
    }

    pub fn router(&self) -> String {
        self.ready["router"]
            .as_str()
            .expect("router address")
            .to_string()
    }

    pub fn nodes(&self, role: &str) -> Vec<String> {
        self.ready[role]
            .as_array()
            .expect("node list")
            .iter()
            .map(|n| n["addr"].as_str().expect("addr").to_string())
            .collect()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM and wait; returns whether `pdctl up` exited 0.
    pub fn stop(mut self) -> bool {
        // SAFETY: kill(2) on our own child's pid with a valid signal.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let ok = self.child.wait().map(|s| s.success()).unwrap_or(false);
        std::mem::forget(self);
        ok
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: as in `stop`.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// `count` prompts of spread token ids, the `i`-th `first_len + i * step` tokens long (most
/// spanning several 16-token blocks); `salt` varies the ids between test files.
pub fn spread_prompts(count: u32, first_len: u32, step: u32, salt: u32) -> Vec<Vec<u32>> {
    (0..count)
        .map(|i| {
            (0..(first_len + i * step))
                .map(|t| (t * 7919 + i * 104_729 + salt) % 150_000)
                .collect()
        })
        .collect()
}

/// Sum of `name` (with `labels`) over the `/metrics` of every node of `role`.
pub async fn nodes_sum(cluster: &Cluster, role: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut total = 0.0;
    for addr in cluster.node_metrics(role) {
        total += exposition(&addr)
            .await
            .expect("node /metrics")
            .sum(name, labels);
    }
    total
}

/// Run `pdctl` with `args` (synthetic models under `cache`).
pub fn pdctl(cache: &Path, args: &[&str]) -> Output {
    Command::new(bin_dir().join("pdctl"))
        .args(args)
        .env("PD_CACHE_DIR", cache)
        .env_remove("PD_MODEL")
        .output()
        .expect("pdctl runs")
}

/// The single JSON object a successful `pdctl run/generate --json` printed.
pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "pdctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// `pdctl run --json` of one mixed engine in one process on `synthetic:tiny`: greedy,
/// `max_tokens` tokens of `ids`, EOS ignored (the reference the cluster must equal).
pub fn reference_run(cache: &Path, ids: &[u32], max_tokens: u32) -> Value {
    reference_run_with(cache, ids, max_tokens, &[])
}

/// [`reference_run`] with engine flags added (e.g. `--kv-cache-dtype f16`).
pub fn reference_run_with(cache: &Path, ids: &[u32], max_tokens: u32, flags: &[&str]) -> Value {
    reference_run_on(cache, "synthetic:tiny", ids, max_tokens, flags)
}

/// [`reference_run_with`] on another model.
pub fn reference_run_on(
    cache: &Path,
    model: &str,
    ids: &[u32],
    max_tokens: u32,
    flags: &[&str],
) -> Value {
    let ids = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let max_tokens = max_tokens.to_string();
    let mut args = vec![
        "run",
        "--model",
        model,
        "--token-ids",
        &ids,
        "--max-tokens",
        &max_tokens,
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(flags);
    json_of(&pdctl(cache, &args))
}

/// The token ids of a `pdctl run/generate --json` object.
pub fn token_ids(v: &Value) -> Vec<u32> {
    v["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().expect("a token id") as u32)
        .collect()
}

/// [`reference_run`]'s tokens.
pub fn reference_tokens(cache: &Path, ids: &[u32], max_tokens: u32) -> Vec<u32> {
    token_ids(&reference_run(cache, ids, max_tokens))
}

/// Streams each of `prompts` greedily, `max_tokens` tokens, and asserts that the tokens are
/// one mixed engine's ([`reference_tokens`]) and that the usage counts the prompt and them.
pub async fn assert_each_equals_reference(
    client: &mut GenerationClient<tonic::transport::Channel>,
    cache: &Path,
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
) {
    for ids in prompts {
        let want = reference_tokens(cache, &ids, max_tokens);
        let (got, last) = collect(client, greedy(ids.clone(), max_tokens))
            .await
            .unwrap();
        assert_eq!(got, want, "prompt of {} tokens", ids.len());
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        let usage = last.usage.unwrap();
        assert_eq!(usage.prompt_tokens as usize, ids.len());
        assert_eq!(usage.completion_tokens, max_tokens);
    }
}

/// Waits (10 s at most) until every node of `cluster` has all its KV blocks free and runs
/// nothing (leases are released asynchronously, right after a decode stream starts).
pub async fn all_blocks_free(cluster: &Cluster) {
    for role in ["prefill", "decode"] {
        for addr in cluster.nodes(role) {
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let info = node_info(&addr, role).await;
                if info.free_blocks == info.num_blocks && info.num_running == 0 {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{role} {addr} keeps blocks: {info:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

pub async fn client(addr: &str) -> GenerationClient<tonic::transport::Channel> {
    GenerationClient::connect(format!("http://{addr}"))
        .await
        .expect("router reachable")
}

/// A greedy token-id request.
pub fn greedy(ids: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds { ids })),
        sampling: pd_test_support::greedy(),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

/// Stream a request to the end: (token ids, the last chunk).
pub async fn collect(
    client: &mut GenerationClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
) -> Result<(Vec<u32>, pb::GenerateResponse), tonic::Status> {
    collect_as(client, req, None).await
}

/// `message` with `authorization: Bearer KEY` metadata (the router's `--api-keys`), or
/// without any when `key` is None.
pub fn with_key<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let value = format!("Bearer {key}").parse().expect("visible ASCII key");
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// [`collect`] with an API key.
pub async fn collect_as(
    client: &mut GenerationClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
    key: Option<&str>,
) -> Result<(Vec<u32>, pb::GenerateResponse), tonic::Status> {
    let mut stream = client.generate(with_key(req, key)).await?.into_inner();
    let mut ids = Vec::new();
    let mut last = None;
    while let Some(chunk) = stream.message().await? {
        ids.extend_from_slice(&chunk.token_ids);
        last = Some(chunk);
    }
    Ok((
        ids,
        last.ok_or_else(|| tonic::Status::internal("empty stream"))?,
    ))
}

/// Node `Info` over gRPC.
pub async fn node_info(addr: &str, role: &str) -> pb::NodeInfo {
    let url = format!("http://{addr}");
    if role == "prefill" {
        let mut c = pb::prefill_service_client::PrefillServiceClient::connect(url)
            .await
            .unwrap();
        c.info(pb::InfoRequest {}).await.unwrap().into_inner()
    } else {
        let mut c = pb::decode_service_client::DecodeServiceClient::connect(url)
            .await
            .unwrap();
        c.info(pb::InfoRequest {}).await.unwrap().into_inner()
    }
}

/// One product binary (`router`, `prefill-node`, `decode-node`) started directly, for tests
/// that need to kill and restart a single part (`pdctl up` stops the whole cluster when a
/// part dies). Dropping it stops the process (SIGTERM, then wait).
pub struct Process {
    child: Child,
    /// The JSON ready line the binary printed.
    pub ready: Value,
}

impl Process {
    /// Starts `bin` (beside the test executable) with `args`, synthetic models cached under
    /// `cache`, and waits for its ready line.
    pub fn start(bin: &str, cache: &Path, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_logging(bin, cache, args, Stdio::inherit())
    }

    /// [`Process::start`] with the process's log (stderr) going to `log`.
    pub fn start_logging(
        bin: &str,
        cache: &Path,
        args: &[&str],
        log: impl Into<Stdio>,
    ) -> anyhow::Result<Self> {
        let mut child = Command::new(bin_dir().join(bin))
            .args(args)
            .env("PD_CACHE_DIR", cache)
            .env("RUST_LOG", "warn")
            .env_remove("PD_MODEL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {bin}"))?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?);
        let mut line = String::new();
        lines
            .read_line(&mut line)
            .with_context(|| format!("reading {bin}'s ready line"))?;
        if line.trim().is_empty() {
            let status = child.wait()?;
            bail!("{bin} exited before it was ready: {status}");
        }
        let ready: Value =
            serde_json::from_str(&line).with_context(|| format!("{bin} ready line {line:?}"))?;
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            while lines.read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
        Ok(Self { child, ready })
    }

    /// The gRPC address from the ready line (`host:port`).
    pub fn addr(&self) -> String {
        self.ready["grpc"]
            .as_str()
            .expect("the ready line has a grpc address")
            .to_string()
    }

    /// The gRPC port from the ready line.
    pub fn port(&self) -> u16 {
        let addr = self.addr();
        addr.rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("host:port")
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would: no drain, no goodbye to anyone.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::forget(self);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid with a valid signal.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// Waits (up to a minute) until the router at `addr` reports SERVING on grpc.health.v1.
pub async fn wait_serving(addr: &str) -> anyhow::Result<()> {
    use std::time::Duration;
    pd_proto::health::wait_serving(addr, Duration::from_secs(60), Duration::from_millis(50))
        .await
        .context("the router")
}

// ---- clusters shared by the tests of one binary --------------------------------------------

/// `pdctl up` processes to stop when this process exits: a cluster kept in a `static` (one
/// that the tests of a binary share) is never dropped.
static STOP_AT_EXIT: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Runs as the process exits (after the test harness is done): SIGTERM each registered
/// `pdctl up` and wait for it, so that no cluster outlives its tests.
extern "C" fn stop_registered_clusters() {
    let pids = std::mem::take(&mut *STOP_AT_EXIT.lock().unwrap_or_else(|e| e.into_inner()));
    for pid in pids {
        // SAFETY: kill(2) and waitpid(2) on our own child's pid; a null status pointer is
        // allowed.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
            libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
        }
    }
}

impl Cluster {
    /// Stops this cluster when the process exits, for a cluster that is never dropped (one
    /// in a `static`, shared by the tests of one binary).
    pub fn stop_at_exit(&self) {
        let mut pids = STOP_AT_EXIT.lock().unwrap_or_else(|e| e.into_inner());
        if pids.is_empty() {
            // SAFETY: registers a function without arguments that touches only its own
            // statics; registering it more than once would only repeat harmless work.
            unsafe {
                libc::atexit(stop_registered_clusters);
            }
        }
        pids.push(self.child.id());
    }
}

// ---- metrics ------------------------------------------------------------------------------

impl Cluster {
    /// The API key of a `pdctl up --secure` cluster (its ready line's `api_key`); `None` for
    /// a plaintext one.
    pub fn api_key(&self) -> Option<&str> {
        self.ready["api_key"].as_str()
    }

    /// Client TLS trusting the CA of a `pdctl up --secure` cluster, for `alpn`; `None` for a
    /// plaintext one.
    pub fn client_tls(&self, alpn: pd_tls::Alpn) -> Option<pd_tls::ClientTls> {
        let ca = self.ready["ca"].as_str()?;
        let settings = pd_tls::TlsSettings {
            ca: Some(PathBuf::from(ca)),
            ..pd_tls::TlsSettings::default()
        };
        Some(
            pd_tls::ClientTls::new(&settings, alpn)
                .expect("client TLS")
                .expect("a CA is set"),
        )
    }

    /// A client of the router, over TLS when the cluster is secure (requests still need
    /// [`Cluster::api_key`]: [`with_key`], [`collect_as`]).
    pub async fn client(&self) -> GenerationClient<tonic::transport::Channel> {
        let tls = self.client_tls(pd_tls::Alpn::Grpc);
        GenerationClient::new(
            tls::channel(&self.router(), tls.as_ref())
                .await
                .expect("router reachable"),
        )
    }

    /// [`exposition`] of one of this cluster's metrics addresses, over TLS when it is secure.
    pub async fn exposition(&self, addr: &str) -> anyhow::Result<Exposition> {
        match self.client_tls(pd_tls::Alpn::Http1) {
            Some(tls) => Exposition::parse(&tls::scrape(addr, &tls).await?),
            None => exposition(addr).await,
        }
    }

    /// The router's `/metrics` URL (`router_metrics` in `pdctl up`'s ready line).
    pub fn router_metrics(&self) -> String {
        self.ready["router_metrics"]
            .as_str()
            .expect("router_metrics in the ready line")
            .to_string()
    }

    /// The `/metrics` addresses of the nodes of `role` (`prefill` / `decode`), in the order of
    /// [`Cluster::nodes`].
    pub fn node_metrics(&self, role: &str) -> Vec<String> {
        self.ready[format!("{role}_metrics")]
            .as_array()
            .expect("node metrics addresses in the ready line")
            .iter()
            .map(|m| m.as_str().expect("address").to_string())
            .collect()
    }
}

/// The `metrics_addr` of a binary's ready line (a [`Process`]'s `ready`).
pub fn metrics_addr(ready: &Value) -> String {
    ready["metrics_addr"]
        .as_str()
        .expect("the ready line has a metrics_addr")
        .to_string()
}

// The `/metrics` scraper and parser are the workspace's shared ones.
pub use pd_test_support::Exposition;
pub use pd_test_support::metrics::{authority as metrics_authority, scrape};

/// Scrapes and parses `addr`'s `/metrics`.
pub async fn exposition(addr: &str) -> anyhow::Result<Exposition> {
    Exposition::parse(&scrape(addr).await?)
}

/// One node's counters: prefix cache (local and external pairs), prompt and generated tokens.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Counts {
    pub queries: f64,
    pub hits: f64,
    pub external_queries: f64,
    pub external_hits: f64,
    pub prompt_tokens: f64,
    pub generation_tokens: f64,
}

impl Counts {
    /// (queries, hits, external queries, external hits).
    pub fn prefix(&self) -> (f64, f64, f64, f64) {
        (
            self.queries,
            self.hits,
            self.external_queries,
            self.external_hits,
        )
    }

    pub fn minus(&self, o: &Counts) -> Counts {
        Counts {
            queries: self.queries - o.queries,
            hits: self.hits - o.hits,
            external_queries: self.external_queries - o.external_queries,
            external_hits: self.external_hits - o.external_hits,
            prompt_tokens: self.prompt_tokens - o.prompt_tokens,
            generation_tokens: self.generation_tokens - o.generation_tokens,
        }
    }

    pub fn plus(&self, o: &Counts) -> Counts {
        Counts {
            queries: self.queries + o.queries,
            hits: self.hits + o.hits,
            external_queries: self.external_queries + o.external_queries,
            external_hits: self.external_hits + o.external_hits,
            prompt_tokens: self.prompt_tokens + o.prompt_tokens,
            generation_tokens: self.generation_tokens + o.generation_tokens,
        }
    }

    /// What a node's own `/metrics` says (vLLM's families).
    pub fn of_node(e: &Exposition) -> Counts {
        Counts {
            queries: e.sum("vllm:prefix_cache_queries_total", &[]),
            hits: e.sum("vllm:prefix_cache_hits_total", &[]),
            external_queries: e.sum("vllm:external_prefix_cache_queries_total", &[]),
            external_hits: e.sum("vllm:external_prefix_cache_hits_total", &[]),
            prompt_tokens: e.sum("vllm:prompt_tokens_total", &[]),
            generation_tokens: e.sum("vllm:generation_tokens_total", &[]),
        }
    }

    /// What the router says about that node.
    pub fn of_router(e: &Exposition, role: &str, node: &str) -> Counts {
        let n = [("role", role), ("node", node)];
        let cache = |c: &'static str| [("cache", c), ("role", role), ("node", node)];
        Counts {
            queries: e.sum("pd_router_prefix_cache_queries_total", &cache("local")),
            hits: e.sum("pd_router_prefix_cache_hits_total", &cache("local")),
            external_queries: e.sum("pd_router_prefix_cache_queries_total", &cache("external")),
            external_hits: e.sum("pd_router_prefix_cache_hits_total", &cache("external")),
            prompt_tokens: e.sum("pd_router_prompt_tokens_total", &n),
            generation_tokens: e.sum("pd_router_generation_tokens_total", &n),
        }
    }
}

/// A node's prefix-cache hits by tier, in tokens: its device cache (local hits), its
/// host-memory tier and other nodes (its external hits by source).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierHits {
    pub device: f64,
    pub host: f64,
    pub peer: f64,
}

impl TierHits {
    /// What a node's own `/metrics` says: its local hits, and its prompt tokens by external
    /// source (each external hit is one prompt token of its source).
    pub fn of_node(e: &Exposition) -> TierHits {
        let source = |s: &str| e.sum("vllm:prompt_tokens_by_source_total", &[("source", s)]);
        TierHits {
            device: e.sum("vllm:prefix_cache_hits_total", &[]),
            host: source("external_host_cache_hit"),
            peer: source("external_kv_transfer"),
        }
    }

    /// What the router says about that node (`pd_router_prefix_cache_hits_by_tier_total`).
    pub fn of_router(e: &Exposition, role: &str, node: &str) -> TierHits {
        let tier = |t: &str| {
            e.sum(
                "pd_router_prefix_cache_hits_by_tier_total",
                &[("tier", t), ("role", role), ("node", node)],
            )
        };
        TierHits {
            device: tier("device"),
            host: tier("host"),
            peer: tier("peer"),
        }
    }

    pub fn minus(&self, o: &TierHits) -> TierHits {
        TierHits {
            device: self.device - o.device,
            host: self.host - o.host,
            peer: self.peer - o.peer,
        }
    }
}

/// The router's OpenAI-compatible API (`openai` in `pdctl up`'s ready line: `http://HOST:PORT/v1`).
impl Cluster {
    pub fn openai(&self) -> String {
        self.ready["openai"]
            .as_str()
            .expect("openai in the ready line")
            .to_string()
    }
}

/// Sends `method` `{base}{path}` (base: an `http://HOST:PORT/PREFIX` URL) with `body` and
/// returns the response with its body unread.
pub async fn http_open(
    method: &str,
    base: &str,
    path: &str,
    body: Vec<u8>,
) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
    http_open_as(method, base, path, body, None).await
}

/// [`http_open`] with `Authorization: Bearer KEY` when `key` is given.
pub async fn http_open_as(
    method: &str,
    base: &str,
    path: &str,
    body: Vec<u8>,
    key: Option<&str>,
) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
    let rest = base.strip_prefix("http://").unwrap_or(base);
    let (authority, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .with_context(|| format!("connecting to {authority}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(format!("{prefix}{path}"))
        .header(hyper::header::HOST, authority)
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let request = request.body(http_body_util::Full::new(hyper::body::Bytes::from(body)))?;
    Ok(sender.send_request(request).await?)
}

/// `POST {base}{path}` with a JSON body: the status and the whole body as text.
pub async fn http_post(base: &str, path: &str, body: &Value) -> anyhow::Result<(u16, String)> {
    http_post_as(base, path, body, None).await
}

/// [`http_post`] with `Authorization: Bearer KEY` when `key` is given.
pub async fn http_post_as(
    base: &str,
    path: &str,
    body: &Value,
    key: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    use http_body_util::BodyExt as _;
    let response = http_open_as("POST", base, path, body.to_string().into_bytes(), key).await?;
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8(bytes.to_vec())?))
}

/// The `data:` payloads of a server-sent event stream's text, in order.
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}
