//! `--check-config`: the effective configuration from flags and `PD_*` variables, or one
//! line naming the problem, without loading a model (deploy/k8s manifests are checked with it).

use std::process::{Command, Output};

fn check(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_prefill-node"));
    cmd.arg("--check-config").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    // The caller's own PD_* settings must not leak into the check.
    for (k, _) in std::env::vars() {
        if k.starts_with("PD_") && !env.iter().any(|(e, _)| *e == k) {
            cmd.env_remove(k);
        }
    }
    cmd.output().expect("run prefill-node")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the effective configuration is JSON")
}

#[test]
fn flags_and_environment_make_the_effective_configuration() {
    let out = check(
        &[
            "--host=0.0.0.0",
            // A wildcard bind without mTLS is refused otherwise (tests/tests/tls.rs).
            "--insecure",
            "--port=50051",
            "--advertise-host=10.1.2.3",
            "--kv-port=50052",
        ],
        &[
            ("PD_MODEL", "synthetic:qwen3-0.6b"),
            ("PD_BLOCK_SIZE", "32"),
            ("PD_PREFIX_CACHING_HASH_ALGO", "sha256"),
        ],
    );
    let c = json(&out);
    assert_eq!(c["engine"]["prefix_caching_hash_algo"], "sha256");
    assert_eq!(c["role"], "prefill");
    assert_eq!(c["model"]["source"], "synthetic:qwen3-0.6b");
    assert_eq!(c["model"]["max_model_len"], 40960);
    assert_eq!(c["engine"]["block_size"], 32);
    assert_eq!(c["advertise_host"], "10.1.2.3");
    assert_eq!(c["role_flags"]["kv_port"], 50052);
}

/// The KV cache's type as the node resolves it, and the block size that follows (a block
/// moves between nodes as stored): f32 on the CPU by default, the weights' bf16 on a GPU.
#[test]
fn the_kv_cache_type_and_block_bytes_are_resolved_per_device() {
    let qwen = [("PD_MODEL", "synthetic:qwen3-0.6b")];
    // 28 layers x K and V x 16 tokens x 8 KV heads x 128 dims.
    let values = 28 * 2 * 16 * 8 * 128;
    for (flags, dtype, bytes) in [
        (&[][..], "float32", 4 * values),
        (&["--kv-cache-dtype=f16"][..], "float16", 2 * values),
        (&["--device=cuda"][..], "bfloat16", 2 * values),
        (
            &["--device=cuda", "--kv-cache-dtype=f32"][..],
            "float32",
            4 * values,
        ),
    ] {
        let c = json(&check(flags, &qwen));
        assert_eq!(c["model"]["kv_cache_dtype"], dtype, "{flags:?}");
        assert_eq!(c["model"]["kv_block_bytes"], bytes, "{flags:?}");
    }
}

#[test]
fn what_only_the_serving_host_has_is_a_note_not_a_failure() {
    let out = check(
        &["--model=/models/not-here", "--host=0.0.0.0", "--insecure"],
        &[],
    );
    json(&out);
    let notes = String::from_utf8_lossy(&out.stderr);
    assert!(notes.contains("/models/not-here"), "{notes}");
    assert!(notes.contains("--advertise-host"), "{notes}");
}

#[test]
fn a_bad_value_exits_non_zero_naming_it() {
    for (args, needle) in [
        (&["--model=synthetic:nope"][..], "--model"),
        (&["--max-model-len=1000000"][..], "--max-model-len"),
        (&["--block-size=0"][..], "--block-size"),
        (
            &["--prefix-caching-hash-algo=md5"][..],
            "--prefix-caching-hash-algo",
        ),
        (&["--max-num-seqs=0"][..], "--max-num-seqs"),
        (&["--kv-lease-timeout=0"][..], "--kv-lease-timeout"),
        (&["--advertise-host=pod-ip"][..], "--advertise-host"),
        (&["--no-such-flag"][..], "--no-such-flag"),
    ] {
        let out = check(args, &[]);
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} printed a configuration");
    }
}

/// `PD_CPU_ISA`: shown as set; an unknown value is an error; a path this machine lacks is a
/// note (the serving host may have it), one it has is no note: here AMX, which only some
/// hosts have.
#[test]
fn the_cpu_instruction_set_is_checked() {
    let model = ("PD_MODEL", "synthetic:qwen3-0.6b");
    let c = json(&check(&[], &[model]));
    assert_eq!(c["engine"]["cpu_isa"], "auto");
    let c = json(&check(&[], &[model, ("PD_CPU_ISA", "portable")]));
    assert_eq!(c["engine"]["cpu_isa"], "portable");

    let out = check(&[], &[model, ("PD_CPU_ISA", "sse9")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("PD_CPU_ISA=sse9: expected auto, amx, avx512, avx2 or portable"),
        "{err}"
    );

    let out = check(&[], &[model, ("PD_CPU_ISA", "amx")]);
    let c = json(&out);
    assert_eq!(c["engine"]["cpu_isa"], "amx");
    let notes = String::from_utf8_lossy(&out.stderr);
    let noted = notes.contains("note: PD_CPU_ISA=amx: ")
        && notes.contains("the node would refuse to start on this host");
    assert_eq!(
        noted,
        !pd_engine::backend::cpu::Isa::Amx.available(),
        "AMX available here: {}; {notes}",
        pd_engine::backend::cpu::Isa::Amx.available()
    );
}

/// `--max-waiting` (and the open-request bound it makes with --max-num-seqs) is shown; a
/// value that is no count is refused.
#[test]
fn max_waiting_is_shown_and_checked() {
    let c = json(&check(&["--max-num-seqs=8"], &[("PD_MAX_WAITING", "3")]));
    assert_eq!(c["max_waiting"], 3);
    assert_eq!(c["max_open_requests"], 11);
    let out = check(&["--max-waiting=-1"], &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-waiting"), "{err}");
}
