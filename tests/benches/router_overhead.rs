//! Router overhead: the latency a client sees for a 1-token request through the router
//! (validation, routing, Prefill, the chunk streamed back) versus the same Prefill sent straight
//! to the prefill node, in shuffled rounds, on the nodes of one `pdctl up` cluster of
//! `synthetic:tiny` (the router timed is this build's, started by the benchmark beside them,
//! as every other hop it times). Both ask the prefill node for no KV lease (`skip_kv_lease`:
//! the router does so for every `max_tokens` 1 request). Prints p50 / p99 of each and the
//! difference.
//!
//! `BASELINE_ROUTER=/path/to/another/router` also times that router binary, started on the
//! same nodes, in the same rounds: before/after figures of a router change from one run.
//! Several binaries may be given, separated by commas (`BASELINE_ROUTER=/tmp/a,/tmp/b`).
//! `N` sets the number of timed requests of each kind (default 300).
//!
//! The same request through the router's OpenAI-compatible HTTP API (`POST /v1/completions`
//! with the prompt's token ids, on one kept-alive HTTP/1.1 connection) is timed in the same
//! rounds too: what the HTTP front end costs over the gRPC API.
//!
//! A bare gRPC forwarder (`router_overhead/forwarder.rs`: this executable re-run as its own
//! process) is timed in the same rounds: the floor of any router hop on this machine, so that
//! the router's own cost is its added latency minus the forwarder's.
//!
//! A secure router (TLS to its client, which presents an API key, and mTLS to its own prefill
//! and decode nodes, started beside the cluster with certificates and a key made here) is
//! timed in the same rounds too, beside its plaintext twin (the same router over nodes of its
//! own, without TLS or keys): the ratio of the secure router's p50 to the twin's is the cost of
//! TLS and key checks on the request path. (Against the cluster's router it also pays for
//! nodes that serve one target in six where the cluster's serve four and stay warmer.)
//!
//! `cargo build --release --workspace --bins && cargo bench -p pd-tests --bench router_overhead`

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use pd_tests::{Cluster, Process, client, collect, collect_as, greedy, wait_serving};
use tonic::transport::Channel;

#[path = "router_overhead/forwarder.rs"]
mod forwarder;

/// The forwarder process, killed when dropped.
struct ForwarderProcess(Child);

impl ForwarderProcess {
    /// Start this executable as the forwarder to `prefill_addr`; its address.
    fn start(prefill_addr: &str) -> (Self, String) {
        let mut child = Command::new(std::env::current_exe().expect("own executable"))
            .env(forwarder::FORWARD_TO, prefill_addr)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the forwarder");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the forwarder's address");
        let addr = line
            .trim()
            .strip_prefix("LISTEN ")
            .unwrap_or_else(|| panic!("forwarder said {line:?}"))
            .to_string();
        (Self(child), addr)
    }
}

impl Drop for ForwarderProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One 1-token request through a router.
async fn through(router: &mut GenerationClient<Channel>, prompt: &[u32]) -> Duration {
    let t = Instant::now();
    collect(router, greedy(prompt.to_vec(), 1))
        .await
        .expect("router request");
    t.elapsed()
}

/// One 1-token request through a router that wants `key`.
async fn through_with_key(
    router: &mut GenerationClient<Channel>,
    prompt: &[u32],
    key: &str,
) -> Duration {
    let t = Instant::now();
    collect_as(router, greedy(prompt.to_vec(), 1), Some(key))
        .await
        .expect("router request");
    t.elapsed()
}

/// One kept-alive HTTP/1.1 connection to the router's HTTP API.
struct Http {
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<hyper::body::Bytes>>,
    authority: String,
}

impl Http {
    async fn connect(authority: &str) -> Self {
        let stream = tokio::net::TcpStream::connect(authority)
            .await
            .expect("the router's HTTP port");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("HTTP handshake");
        tokio::spawn(conn);
        Self {
            sender,
            authority: authority.to_string(),
        }
    }
}

/// One 1-token completion through the router's HTTP API.
async fn through_http(http: &mut Http, prompt: &[u32]) -> Duration {
    use http_body_util::BodyExt as _;
    let body = format!(r#"{{"prompt": {prompt:?}, "max_tokens": 1, "temperature": 0}}"#);
    let request = hyper::Request::post("/v1/completions")
        .header(hyper::header::HOST, &http.authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .expect("request");
    let t = Instant::now();
    http.sender.ready().await.expect("connection ready");
    let response = http
        .sender
        .send_request(request)
        .await
        .expect("HTTP request");
    let status = response.status();
    let bytes = response.into_body().collect().await.expect("HTTP body");
    let d = t.elapsed();
    assert_eq!(status, 200, "{:?}", bytes.to_bytes());
    d
}

/// One Prefill straight to the node, as the router sends it for a 1-token request.
async fn direct(
    prefill: &mut pb::prefill_service_client::PrefillServiceClient<Channel>,
    prompt: &[u32],
    request_id: String,
) -> Duration {
    let t = Instant::now();
    let resp = prefill
        .prefill(pb::PrefillRequest {
            request_id,
            token_ids: prompt.to_vec(),
            sampling: Some(pb::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            cache_salt: None,
            skip_kv_lease: true,
            ..Default::default()
        })
        .await
        .expect("prefill")
        .into_inner();
    let d = t.elapsed();
    assert!(resp.kv.is_none(), "no lease was asked for");
    d
}

/// A fixed-seed xorshift: the same shuffled order in every run, no dependency.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Fisher–Yates.
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

fn main() {
    if let Ok(prefill) = std::env::var(forwarder::FORWARD_TO) {
        forwarder::run(&prefill);
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(bench());
}

async fn bench() {
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let cache = tempfile::tempdir().expect("tempdir");
    let cluster = Cluster::up(cache.path(), &[]).expect("pdctl up");
    let prefill_addr = cluster.nodes("prefill")[0].clone();
    let decode_addr = cluster.nodes("decode")[0].clone();
    let baseline_bins: Vec<String> = std::env::var("BASELINE_ROUTER")
        .map(|v| {
            v.split(',')
                .filter(|b| !b.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    // The router timed is this build's binary started here, as the baselines and the
    // forwarder are, not the cluster's own: the same binary started by `pdctl up` measured
    // 10-60 us slower at p50 than its copy started here, in the same rounds (2026-12-02), an
    // offset of how it was started that would otherwise count as the router's cost.
    let mut routers = Vec::new();
    for bin in std::iter::once("router").chain(baseline_bins.iter().map(String::as_str)) {
        let process = Process::start(
            bin,
            cache.path(),
            &[
                "--model",
                "synthetic:tiny",
                "--prefill",
                &prefill_addr,
                "--decode",
                &decode_addr,
            ],
        )
        .expect("router");
        wait_serving(&process.addr()).await.expect("router serving");
        routers.push(process);
    }
    // The TLS router, over nodes of its own with mTLS (same model and binaries).
    let tls = pd_tests::tls::TlsFiles::generate();
    let member = tls.member_flags();
    let start_tls_node = |bin: &str| {
        let mut args = vec!["--model".to_string(), "synthetic:tiny".into()];
        args.extend(member.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Process::start(bin, cache.path(), &args).expect("TLS node")
    };
    let tls_prefill = start_tls_node("prefill-node");
    let tls_decode = start_tls_node("decode-node");
    let mut tls_router_args = vec!["--model".to_string(), "synthetic:tiny".into()];
    // TLS to clients (who have no cluster certificate), mTLS to the nodes.
    tls_router_args.extend(tls.identity_flags());
    // And an API key from a keys file, as a client of an exposed router presents it.
    let keys_dir = tempfile::tempdir().expect("a temporary directory");
    let keys_file = keys_dir.path().join("api-keys");
    let api_key = "bench-0123456789abcdef0123456789abcdef";
    std::fs::write(&keys_file, format!("bench {api_key}\n")).expect("the API keys file");
    tls_router_args.extend([
        "--api-keys".into(),
        keys_file.display().to_string(),
        "--prefill".into(),
        tls_prefill.addr(),
        "--decode".into(),
        tls_decode.addr(),
    ]);
    let tls_router_args: Vec<&str> = tls_router_args.iter().map(String::as_str).collect();
    let tls_router = Process::start("router", cache.path(), &tls_router_args).expect("TLS router");
    let client_tls = tls.client(false);
    pd_tests::tls::wait_serving(&tls_router.addr(), Some(&client_tls))
        .await
        .expect("TLS router serving");
    // Its plaintext twin: the same router and nodes, started the same way, without TLS or
    // keys. The TLS router's nodes serve only its requests, where the cluster's nodes serve
    // four targets' (and stay warmer for it): the twin is the like-for-like baseline.
    let start_twin_node = |bin: &str| {
        Process::start(bin, cache.path(), &["--model", "synthetic:tiny"]).expect("twin node")
    };
    let twin_prefill = start_twin_node("prefill-node");
    let twin_decode = start_twin_node("decode-node");
    let (twin_prefill_addr, twin_decode_addr) = (twin_prefill.addr(), twin_decode.addr());
    let twin_router = Process::start(
        "router",
        cache.path(),
        &[
            "--model",
            "synthetic:tiny",
            "--prefill",
            &twin_prefill_addr,
            "--decode",
            &twin_decode_addr,
        ],
    )
    .expect("twin router");
    wait_serving(&twin_router.addr())
        .await
        .expect("twin router serving");
    let (_forwarder, forwarder_addr) = ForwarderProcess::start(&prefill_addr);
    // Every client connects once every process has started: a client connected before the
    // benchmark started more processes measured 40-160 us slower at p50 than another
    // connected after them, against the same router binary (2026-12-02).
    let mut forwarder = client(&forwarder_addr).await;
    let mut http = Http::connect(
        routers[0].ready["http"]
            .as_str()
            .expect("the router's HTTP address"),
    )
    .await;
    let mut routers: Vec<_> = {
        let mut connected = Vec::new();
        for process in routers {
            let c = client(&process.addr()).await;
            connected.push((process, c, Vec::new()));
        }
        connected
    };
    let mut via_tls = GenerationClient::new(
        pd_tests::tls::channel(&tls_router.addr(), Some(&client_tls))
            .await
            .expect("TLS router"),
    );
    let mut via_twin = client(&twin_router.addr()).await;
    let mut prefill =
        pb::prefill_service_client::PrefillServiceClient::connect(format!("http://{prefill_addr}"))
            .await
            .expect("prefill node");
    let prompt: Vec<u32> = (1..9).collect();
    // Target 0 is the node itself, 1 the bare forwarder, 2 this build's router over HTTP,
    // 3 the same router over gRPC, 4.. the baseline routers, the last this build's router
    // with TLS, the very last its plaintext twin. Each round times every target once, in a
    // fresh random order: what a request follows then weighs on all targets alike.
    let tls_target = 3 + routers.len();
    let twin_target = tls_target + 1;
    let targets = twin_target + 1;
    let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(n); targets];
    let mut order: Vec<usize> = (0..targets).collect();
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for i in 0..n + 20 {
        rng.shuffle(&mut order);
        for &target in &order {
            let t = match target {
                0 => direct(&mut prefill, &prompt, format!("direct-{i}")).await,
                1 => through(&mut forwarder, &prompt).await,
                2 => through_http(&mut http, &prompt).await,
                r if r == tls_target => through_with_key(&mut via_tls, &prompt, api_key).await,
                r if r == twin_target => through(&mut via_twin, &prompt).await,
                r => through(&mut routers[r - 3].1, &prompt).await,
            };
            if i >= 20 {
                times[target].push(t);
            }
        }
    }
    let mut via_forwarder = std::mem::take(&mut times[1]);
    let mut direct = std::mem::take(&mut times[0]);
    let mut via_http = std::mem::take(&mut times[2]);
    let mut via_twin_router = times.pop().expect("the plaintext twin's times");
    let mut via_tls_router = times.pop().expect("the TLS router's times");
    for ((_, _, v), t) in routers.iter_mut().zip(times.into_iter().skip(3)) {
        *v = t;
    }
    let mut via_router = std::mem::take(&mut routers[0].2);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (d50, d99) = (percentile(&mut direct, 0.5), percentile(&mut direct, 0.99));
    println!("1-token requests, synthetic:tiny, {n} each, in shuffled rounds");
    println!(
        "  straight to the node      p50 {:8.0} us   p99 {:8.0} us",
        us(d50),
        us(d99)
    );
    let report = |name: &str, v: &mut Vec<Duration>| {
        let (p50, p99) = (percentile(v, 0.5), percentile(v, 0.99));
        println!(
            "  {name:<25} p50 {:8.0} us   p99 {:8.0} us   added p50 {:6.0} us   p99 {:6.0} us",
            us(p50),
            us(p99),
            us(p50) - us(d50),
            us(p99) - us(d99)
        );
    };
    report("through the router", &mut via_router);
    report("through a bare forwarder", &mut via_forwarder);
    report("through the router's HTTP", &mut via_http);
    println!(
        "  HTTP over gRPC through the router: p50 {:.3}x (+{:.0} us)",
        us(percentile(&mut via_http, 0.5)) / us(percentile(&mut via_router, 0.5)),
        us(percentile(&mut via_http, 0.5)) - us(percentile(&mut via_router, 0.5))
    );
    println!(
        "  the router's own cost (router - forwarder) p50 {:6.0} us",
        us(percentile(&mut via_router, 0.5)) - us(percentile(&mut via_forwarder, 0.5))
    );
    report("through TLS + API key", &mut via_tls_router);
    report("through its plaintext twin", &mut via_twin_router);
    println!(
        "  TLS + API key over plaintext through the router: p50 {:.3}x (+{:.0} us)",
        us(percentile(&mut via_tls_router, 0.5)) / us(percentile(&mut via_router, 0.5)),
        us(percentile(&mut via_tls_router, 0.5)) - us(percentile(&mut via_router, 0.5))
    );
    println!(
        "  TLS + API key over its plaintext twin (nodes of their own alike): p50 {:.3}x (+{:.0} us)",
        us(percentile(&mut via_tls_router, 0.5)) / us(percentile(&mut via_twin_router, 0.5)),
        us(percentile(&mut via_tls_router, 0.5)) - us(percentile(&mut via_twin_router, 0.5))
    );
    for (bin, (_, _, times)) in baseline_bins.iter().zip(routers.iter_mut().skip(1)) {
        report(&format!("through {bin}"), times);
    }
    drop(routers);
    cluster.stop();
}
