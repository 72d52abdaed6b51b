//! The `router` binary: ready line, flags, SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const BIN: &str = env!("CARGO_BIN_EXE_router");

#[test]
fn prints_the_ready_line_serves_health_and_stops_on_sigterm() {
    let mut child = Command::new(BIN)
        // Nothing listens on port 9: the router starts, NOT_SERVING.
        .args(["--prefill", "127.0.0.1:9", "--port", "0"])
        .env("PD_DECODE", "127.0.0.1:9")
        .env("PD_POLICY", "round-robin")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the router binary");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).expect("one JSON line");
    assert_eq!(ready["role"], "router");
    let grpc = ready["grpc"].as_str().unwrap().to_string();
    assert!(grpc.starts_with("127.0.0.1:"), "{grpc}");
    assert!(!grpc.ends_with(":0"));

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let status = runtime.block_on(async {
        let mut health = HealthClient::new(crate::fake::channel(&grpc).await);
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .status()
    });
    assert_eq!(status, ServingStatus::NotServing);

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            break;
        }
        if start.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("the router did not stop on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_flags_are_refused_with_a_usage_message() {
    let out = Command::new(BIN)
        .args(["--prefill", "a:1", "--decode", "b:1", "--policy", "random"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prefix-aware"), "{err}");

    // No --prefill is aggregated mode; no --decode is refused.
    let out = Command::new(BIN)
        .args(["--prefill", "a:1"])
        .env_remove("PD_DECODE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--decode"));

    let out = Command::new(BIN)
        .args(["--prefill", "no-port", "--decode", "b:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-port"), "{err}");
}

/// Nodes that are up but cannot pair leave the router NOT_SERVING with no node down: its log
/// says why, once, naming each node's layout and KV cache type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_cannot_pair_are_explained_in_the_log() {
    let p = crate::fake::FakeNode::prefill().await;
    let d = crate::fake::FakeNode::decode().await;
    *d.state.fingerprint.lock().unwrap() = "beefbeef".into();
    *d.state.kv_cache_dtype.lock().unwrap() = "bfloat16".into();
    let mut child = Command::new(BIN)
        .args(["--prefill", &p.address(), "--decode", &d.address()])
        .args(["--port", "0", "--health-interval-ms", "100"])
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the router binary");
    let stderr = child.stderr.take().unwrap();
    let lines = tokio::task::spawn_blocking(move || {
        let mut seen = Vec::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.unwrap();
            let done = line.contains("router not serving");
            seen.push(line);
            if done {
                break;
            }
        }
        seen
    });
    let lines = tokio::time::timeout(Duration::from_secs(30), lines).await;
    // Killed first either way: the reader then sees the end of stderr and returns.
    let _ = child.kill();
    let _ = child.wait();
    let lines = lines.expect("a warning within 30 s").unwrap();
    let warning = lines.last().expect("log lines");
    for needle in [
        "router not serving",
        "KV cache float32",
        "KV cache bfloat16",
        "beefbeef",
        p.address().as_str(),
        d.address().as_str(),
    ] {
        assert!(warning.contains(needle), "{needle}: {lines:?}");
    }
}

/// The admission and connection flags: shown by `--check-config` (from flags and `PD_*`
/// variables), bad values refused with the flag's name.
#[test]
fn admission_and_connection_flags_are_shown_and_checked() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(BIN);
        cmd.args(["--check-config", "--decode", "127.0.0.1:9"])
            .args(args);
        for (k, _) in std::env::vars() {
            if k.starts_with("PD_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().copied());
        cmd.output().expect("run the router binary")
    };
    let out = run(
        &["--max-inflight", "2", "--queue-timeout", "250ms"],
        &[
            ("PD_MAX_QUEUE", "0"),
            ("PD_HTTP_HEADER_TIMEOUT", "1s"),
            ("PD_MAX_CONCURRENT_STREAMS", "64"),
            ("PD_REQUEST_TIMEOUT", "off"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for shown in [
        "max_inflight: Some(\n            2,",
        "max_queue: 0,",
        "queue_timeout: 250ms,",
        "header_timeout: 1s,",
        "max_concurrent_streams: 64,",
        "request_timeout: None,",
    ] {
        assert!(stdout.contains(shown), "{shown:?} not in {stdout}");
    }
    // The defaults: a limit, a queue, a request timeout.
    let out = run(&[], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for shown in [
        "max_inflight: Some(\n            256,",
        "max_queue: 128,",
        "request_timeout: Some(\n        1800s,",
    ] {
        assert!(stdout.contains(shown), "{shown:?} not in {stdout}");
    }
    for (flag, value) in [
        ("--max-inflight", "-1"),
        ("--queue-timeout", "0"),
        ("--max-concurrent-streams", "0"),
        ("--http-header-timeout", "soon"),
        ("--http-max-connections", "0"),
    ] {
        let out = run(&[&format!("{flag}={value}")], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(flag),
            "{flag} {value}: {err}"
        );
    }
}

/// The tenant limit flags: the file read by `--check-config` (a bad line refused with its
/// path and number), the cached token cost shown, and refused outside [0, 1].
#[test]
fn tenant_limit_flags_are_shown_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("limits");
    std::fs::write(&good, "default requests_per_second=5\n").unwrap();
    let bad = dir.path().join("bad-limits");
    std::fs::write(&bad, "# fine\nacme requests_per_second=fast\n").unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(BIN);
        cmd.args(["--check-config", "--decode", "127.0.0.1:9"])
            .args(args);
        for (k, _) in std::env::vars() {
            if k.starts_with("PD_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().copied());
        cmd.output().expect("run the router binary")
    };
    let out = run(&[], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("tenant_limits: None,"), "{stdout}");
    assert!(
        stdout.contains("CachedTokenCost(\n        0.1,"),
        "{stdout}"
    );

    let out = run(
        &["--tenant-limits", good.to_str().unwrap()],
        &[("PD_CACHED_TOKEN_COST", "0.25")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("CachedTokenCost(\n        0.25,"),
        "{stdout}"
    );

    let out = run(&[], &[("PD_TENANT_LIMITS_FILE", bad.to_str().unwrap())]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let wanted = format!("tenant limits file {} line 2:", bad.display());
    assert!(err.contains(&wanted) && err.contains("fast"), "{err}");

    for value in ["1.5", "-0.1", "NaN", "cheap"] {
        let out = run(&[&format!("--cached-token-cost={value}")], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--cached-token-cost"),
            "{value}: {err}"
        );
    }
}
