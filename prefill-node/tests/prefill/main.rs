//! The prefill node over real gRPC on 127.0.0.1 with ephemeral ports: the service started in
//! process through the library (fast), and once as the real binary (ready line, health,
//! reflection, SIGTERM). Every test checks that all KV blocks came back.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use pd_proto::pb;
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use prefill_node::PrefillArgs;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A cache shared by the tests of this file, so `synthetic:tiny` is written once.
fn cache() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("tempdir"))
        .path()
}

/// A prefill node running in this process.
struct Node {
    ready: pd_node::Ready,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Node {
    async fn start(flags: &[&str]) -> Node {
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

    async fn client(&self) -> PrefillServiceClient<Channel> {
        PrefillServiceClient::connect(format!("http://{}", self.ready.grpc))
            .await
            .expect("connects")
    }

    async fn info(&self) -> pb::NodeInfo {
        self.client()
            .await
            .info(pb::InfoRequest {})
            .await
            .expect("info")
            .into_inner()
    }

    /// Wait until every KV block is free (leases released or expired, requests ended).
    async fn assert_all_blocks_free(&self) {
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
    async fn stop(mut self) {
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
async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connects")
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7919 + salt * 104_729 + 11) % 150_000)
        .collect()
}

fn greedy() -> Option<pb::SamplingParams> {
    Some(pb::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    })
}

fn prefill_request(id: &str, token_ids: Vec<u32>) -> pb::PrefillRequest {
    pb::PrefillRequest {
        request_id: id.into(),
        token_ids,
        sampling: greedy(),
        cache_salt: None,
        skip_kv_lease: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_answers_the_first_token_usage_and_a_kv_handle_released_on_request() {
    let node = Node::start(&[]).await;
    let mut client = node.client().await;
    let tokens = prompt(37, 1);
    let r = client
        .prefill(prefill_request("a", tokens.clone()))
        .await
        .expect("prefill")
        .into_inner();
    let first = r.first_token.expect("first token");
    assert!(first.token_id < 151_936);
    let usage = r.usage.expect("usage");
    assert_eq!(usage.prompt_tokens, 37);
    assert_eq!(usage.completion_tokens, 1);
    assert_eq!(usage.cached_tokens, 0, "nothing cached on a fresh node");
    let kv = r.kv.expect("kv handle");
    assert_eq!(kv.addr, node.ready.kv.expect("kv addr").to_string());
    assert_eq!(kv.layout_fingerprint, node.ready.fingerprint);
    assert_eq!(kv.block_size, 16);
    assert_eq!(kv.num_tokens, 37);
    assert_eq!(kv.num_blocks, 3);
    // synthetic:tiny: 3 layers, 2 KV heads of 32, K and V, 16 tokens per block, f32.
    assert_eq!(kv.block_bytes, 2 * 3 * 16 * 2 * 32 * 4);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        kv.lease_deadline_unix_ms > now_ms + 20_000 && kv.lease_deadline_unix_ms <= now_ms + 30_000,
        "the default lease lasts 30 s: {} vs now {now_ms}",
        kv.lease_deadline_unix_ms
    );
    assert!(r.prompt_logprobs.is_empty());

    let info = node.info().await;
    assert_eq!(info.role, pb::Role::Prefill as i32);
    assert_eq!(info.model, "synthetic:tiny");
    assert_eq!(info.layout_fingerprint, node.ready.fingerprint);
    assert_eq!(info.kv_transport_addr, kv.addr);
    assert!(info.healthy);
    assert_eq!(info.vocab_size, 151_936);
    assert_eq!(info.max_model_len, 4096);
    assert!(
        info.free_blocks <= info.num_blocks - 3,
        "the lease pins the prompt's 3 blocks: {info:?}"
    );

    let released = client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: kv.lease_id,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(released.released);
    let again = client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: kv.lease_id,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.released, "a lease is released once");

    // The same prompt again: its full blocks come from this node's prefix cache.
    let r2 = client
        .prefill(prefill_request("b", tokens.clone()))
        .await
        .expect("prefill")
        .into_inner();
    let u2 = r2.usage.unwrap();
    assert_eq!(u2.local_cached_tokens, 32);
    assert_eq!(u2.cached_tokens, 32);
    assert_eq!(u2.external_cached_tokens, 0);
    assert_eq!(r2.first_token.unwrap().token_id, first.token_id);
    client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: r2.kv.unwrap().lease_id,
        })
        .await
        .unwrap();

    // Prompt logprobs: one per position after the first.
    let mut with_lp = prefill_request("c", prompt(9, 2));
    with_lp.sampling.as_mut().unwrap().prompt_logprobs = Some(2);
    let r3 = client.prefill(with_lp).await.expect("prefill").into_inner();
    assert_eq!(r3.prompt_logprobs.len(), 8);
    assert!(r3.prompt_logprobs.iter().all(|l| l.top.len() == 2));
    client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: r3.kv.unwrap().lease_id,
        })
        .await
        .unwrap();

    // A request that ends with its first token asks for no lease: no handle, nothing held
    // once it answered, and the same first token and cache hits as with a lease.
    let mut no_lease = prefill_request("d", tokens);
    no_lease.skip_kv_lease = true;
    let r4 = client
        .prefill(no_lease)
        .await
        .expect("prefill")
        .into_inner();
    assert!(r4.kv.is_none(), "no KV handle without a lease");
    assert_eq!(r4.first_token.unwrap().token_id, first.token_id);
    assert_eq!(r4.usage.unwrap().local_cached_tokens, 32);
    let info = node.info().await;
    assert_eq!(
        (info.free_blocks, info.num_running),
        (info.num_blocks, 0),
        "nothing held once the answer came: {info:?}"
    );

    node.assert_all_blocks_free().await;
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_never_pulled_expires_and_its_blocks_come_back() {
    let node = Node::start(&["--kv-lease-timeout", "0.3"]).await;
    let mut client = node.client().await;
    let r = client
        .prefill(prefill_request("never-pulled", prompt(50, 3)))
        .await
        .expect("prefill")
        .into_inner();
    let kv = r.kv.unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(kv.lease_deadline_unix_ms <= now_ms + 300);
    node.assert_all_blocks_free().await;
    let late = client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: kv.lease_id,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!late.released, "the lease expired already");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_invalid_argument_and_an_actionable_message() {
    let node = Node::start(&["--max-model-len", "64"]).await;
    let mut client = node.client().await;
    let mut cases: Vec<(pb::PrefillRequest, &str)> = vec![
        (prefill_request("", prompt(4, 0)), "request_id"),
        (prefill_request("empty", vec![]), "empty"),
        (prefill_request("vocab", vec![1, 2, 151_936]), "vocabulary"),
        (prefill_request("long", prompt(64, 0)), "context"),
    ];
    let mut sampled = |f: fn(&mut pb::SamplingParams), needle: &'static str| {
        let mut r = prefill_request("sampling", prompt(4, 0));
        f(r.sampling.as_mut().unwrap());
        cases.push((r, needle));
    };
    sampled(|s| s.temperature = Some(-1.0), "temperature");
    sampled(|s| s.top_p = Some(0.0), "top_p");
    sampled(|s| s.min_p = Some(1.5), "min_p");
    sampled(|s| s.repetition_penalty = Some(0.0), "repetition_penalty");
    sampled(|s| s.prompt_logprobs = Some(21), "logprobs");
    for (req, needle) in cases {
        let id = req.request_id.clone();
        let e = client.prefill(req).await.expect_err(&id);
        assert_eq!(e.code(), Code::InvalidArgument, "{id}: {e:?}");
        assert!(
            e.message().contains(needle),
            "{id}: {:?} should mention {needle:?}",
            e.message()
        );
    }
    let e = client
        .abort(pb::NodeAbortRequest {
            request_id: String::new(),
        })
        .await
        .expect_err("empty id");
    assert_eq!(e.code(), Code::InvalidArgument);
    let unknown = client
        .abort(pb::NodeAbortRequest {
            request_id: "nobody".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.aborted, "no such request");
    node.assert_all_blocks_free().await;
    node.stop().await;
}

/// Wait until the node runs or queues a request.
async fn wait_busy(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = node.info().await;
        if info.num_running + info.num_waiting > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_duplicate_ids_and_cancelled_calls_free_every_block() {
    // Small steps make a long prompt's prefill take hundreds of steps.
    let node = Node::start(&["--max-num-batched-tokens", "4"]).await;
    let slow = prompt(3000, 4);

    // Abort by id; the id is in use meanwhile.
    let mut client = node.client().await;
    let call = tokio::spawn({
        let mut client = node.client().await;
        let slow = slow.clone();
        async move { client.prefill(prefill_request("slow", slow)).await }
    });
    wait_busy(&node).await;
    let dup = client
        .prefill(prefill_request("slow", prompt(4, 0)))
        .await
        .expect_err("duplicate id");
    assert_eq!(dup.code(), Code::InvalidArgument);
    assert!(dup.message().contains("already in use"), "{dup:?}");
    let aborted = client
        .abort(pb::NodeAbortRequest {
            request_id: "slow".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(aborted.aborted);
    let e = call.await.unwrap().expect_err("aborted call");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    node.assert_all_blocks_free().await;

    // A call the client gives up on aborts the engine request.
    let mut impatient = node.client().await;
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        impatient.prefill(prefill_request("impatient", slow)),
    )
    .await;
    assert!(gave_up.is_err(), "the slow prefill should still be running");
    // The same id again: the node takes it once the cancelled call is gone, and the engine
    // only if that request was aborted (it refuses an id still open; its abort and this
    // submission reach it in order).
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match client
            .prefill(prefill_request("impatient", prompt(4, 0)))
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(e) if e.message().contains("on this node") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => panic!("the cancelled prefill was not aborted: {e:?}"),
        }
    };
    client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: again.kv.unwrap().lease_id,
        })
        .await
        .unwrap();
    node.assert_all_blocks_free().await;
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_refuses_new_work_and_waits_for_leases() {
    let node = Node::start(&["--max-num-batched-tokens", "4", "--drain-timeout", "20"]).await;
    let mut client = node.client().await;
    let mut health = HealthClient::new(channel(node.ready.grpc).await);
    let call = tokio::spawn({
        let mut client = node.client().await;
        async move {
            client
                .prefill(prefill_request("in-flight", prompt(600, 5)))
                .await
        }
    });
    wait_busy(&node).await;
    let Node {
        ready,
        mut stop,
        task,
        ..
    } = node;
    stop.take().unwrap().send(()).unwrap();
    // Draining: NOT_SERVING, new work refused, other calls still answered.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = health
            .check(HealthCheckRequest {
                service: "pd.v1.PrefillService".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        if status == ServingStatus::NotServing as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "health never turned NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let refused = client
        .prefill(prefill_request("late", prompt(4, 0)))
        .await
        .expect_err("draining");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        !client
            .info(pb::InfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .healthy
    );
    // The in-flight prefill finishes; the node waits for its lease.
    let r = call
        .await
        .unwrap()
        .expect("in-flight prefill finishes")
        .into_inner();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !task.is_finished(),
        "the drain waits for the lease to be released"
    );
    let released = client
        .release_kv(pb::ReleaseKvRequest {
            lease_id: r.kv.unwrap().lease_id,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(released.released);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops once drained")
        .unwrap()
        .expect("clean stop");
    assert!(
        tokio::net::TcpStream::connect(ready.grpc).await.is_err(),
        "the gRPC port is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_aborts_what_is_left() {
    let node = Node::start(&["--max-num-batched-tokens", "2", "--drain-timeout", "0.2"]).await;
    let call = tokio::spawn({
        let mut client = node.client().await;
        async move {
            client
                .prefill(prefill_request("too-slow", prompt(4000, 6)))
                .await
        }
    });
    wait_busy(&node).await;
    let started = Instant::now();
    node.stop().await;
    assert!(started.elapsed() < Duration::from_secs(10));
    let e = call.await.unwrap().expect_err("aborted by the drain");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
}

/// The real binary: one JSON ready line on stdout, health SERVING over gRPC, reflection,
/// and exit 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_its_ready_line_serves_health_and_exits_0_on_sigterm() {
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_prefill-node"))
            .args(["--port", "0", "--kv-port", "0"])
            .env("PD_CACHE_DIR", cache())
            .env_remove("PD_MODEL")
            .env_remove("PD_PORT")
            .env_remove("PD_KV_PORT")
            .env_remove("PD_METRICS_PORT")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("prefill-node starts"),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (line, rest) = tokio::task::spawn_blocking(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).expect("reads the ready line");
        (line, reader)
    })
    .await
    .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).expect("the ready line is JSON");
    let obj = ready.as_object().unwrap();
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["fingerprint", "grpc", "kv", "metrics_addr", "model", "role"],
        "{line}"
    );
    assert_eq!(ready["role"], "prefill");
    assert_eq!(ready["model"], "synthetic:tiny");
    let fingerprint = ready["fingerprint"].as_str().unwrap();
    assert!(fingerprint.len() == 16 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()));
    let grpc: std::net::SocketAddr = ready["grpc"].as_str().unwrap().parse().unwrap();
    let kv: std::net::SocketAddr = ready["kv"].as_str().unwrap().parse().unwrap();
    assert!(grpc.ip().is_loopback() && grpc.port() != 0 && kv.port() != 0);
    let metrics: std::net::SocketAddr = ready["metrics_addr"].as_str().unwrap().parse().unwrap();
    assert!(metrics.ip().is_loopback() && metrics.port() != 0);

    let mut health = HealthClient::new(channel(grpc).await);
    for service in ["", "pd.v1.PrefillService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }
    let services = reflected_services(grpc).await;
    for s in ["pd.v1.PrefillService", "grpc.health.v1.Health"] {
        assert!(services.iter().any(|x| x == s), "{s} in {services:?}");
    }
    // A health watch stays open across the shutdown: it must not hold the exit up.
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        watch.message().await.unwrap().unwrap().status,
        ServingStatus::Serving as i32
    );

    let kill = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                panic!("prefill-node did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let mut rest = rest;
    let mut more = String::new();
    std::io::Read::read_to_string(&mut rest, &mut more).unwrap();
    assert!(
        more.is_empty(),
        "exactly one line on stdout, then: {more:?}"
    );
}

/// A child process killed if the test fails before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Service names listed by server reflection (v1).
async fn reflected_services(addr: std::net::SocketAddr) -> Vec<String> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut client = ServerReflectionClient::new(channel(addr).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    match stream.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer: {other:?}"),
    }
}
