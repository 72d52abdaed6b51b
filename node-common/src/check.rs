//! `--check-config`: validate a node's whole configuration (flags and `PD_*` variables) the
//! way start-up would, print the effective configuration as JSON, and stop — without loading
//! weights or opening a device, so a manifest's command line can be checked anywhere (CI
//! runs every container's args of `deploy/k8s` through it).
//!
//! What it cannot know here is reported as a note on stderr, not as a failure: a model
//! directory that exists only on the serving host, or a device this machine lacks.

use std::io::Write as _;
use std::net::ToSocketAddrs;
use std::process::ExitCode;

use pd_engine::backend::cpu::{Isa, IsaError, isa};
use pd_engine::cli::Device;
use pd_engine::kv::KvLayout;
use pd_engine::model::ModelSource;
use pd_engine::serve::Role;
use serde_json::{Value, json};

use crate::args::NodeArgs;

/// The effective configuration of a node, or the first problem, as one sentence.
/// `role_flags` are the role's own flags, already parsed.
pub fn effective_config(
    node: &NodeArgs,
    role: Role,
    role_flags: Value,
) -> Result<(Value, Vec<String>), String> {
    let mut notes = Vec::new();
    let source = ModelSource::parse(&node.model).map_err(|e| format!("--model: {e}"))?;
    let e = &node.engine;
    if e.max_num_batched_tokens == 0 {
        return Err("--max-num-batched-tokens must be more than 0".into());
    }
    if e.max_num_seqs == 0 {
        return Err("--max-num-seqs must be more than 0".into());
    }
    if node.drain_timeout.is_zero() {
        notes.push("--drain-timeout 0: in-flight requests are aborted at once on SIGTERM".into());
    }
    // The model's limits, where its metadata can be read here.
    let mut model = json!({ "source": node.model });
    let metadata = match &source {
        ModelSource::Dir(dir) if !dir.exists() => {
            notes.push(format!(
                "model directory {} is not on this machine; it is read at start",
                dir.display()
            ));
            None
        }
        _ => Some(
            source
                .open_metadata()
                .map_err(|e| format!("--model: {e}"))?,
        ),
    };
    if let Some(files) = metadata {
        let max_model_len = e
            .max_model_len(&files.config)
            .map_err(|e| format!("--max-model-len: {e}"))?;
        // The cache's type as the node will resolve it: on a GPU `auto` is the weights' type.
        let kv_dtype = match e.device {
            Device::Cpu => e.kv_cache_dtype.on_cpu(),
            Device::Cuda { .. } => e.kv_cache_dtype.on_device().unwrap_or(files.config.dtype),
        };
        let layout = KvLayout::new(&files.config, e.block_size, kv_dtype)
            .map_err(|e| format!("--block-size: {e}"))?;
        model["max_model_len"] = json!(max_model_len);
        model["kv_cache_dtype"] = json!(kv_dtype.torch_name());
        model["kv_block_bytes"] = json!(layout.block_bytes());
        if matches!(e.device, Device::Cpu) {
            model["num_gpu_blocks"] = json!(e.num_blocks(&layout, max_model_len));
        }
    } else if e.block_size == 0 {
        return Err("--block-size must be more than 0".into());
    }
    if let Device::Cuda { .. } = e.device
        && !cfg!(feature = "cuda")
    {
        notes.push(format!(
            "--device {}: this build has no CUDA support (build with --features cuda); \
             the node would refuse to start",
            e.device
        ));
    }
    // `PD_CPU_ISA`: a value it does not know is an error anywhere; a path this machine
    // lacks may exist on the serving host.
    let cpu_isa = std::env::var(isa::ENV_VAR).unwrap_or_else(|_| "auto".into());
    if matches!(e.device, Device::Cpu) {
        match Isa::from_env() {
            Ok(_) => {}
            Err(err @ IsaError::Unknown(_)) => return Err(err.to_string()),
            Err(err) => notes.push(format!(
                "{err}: the node would refuse to start on this host"
            )),
        }
    }
    if node.kv_transport == crate::args::KvTransport::Rdma && !pd_transport::rdma::BUILT {
        notes.push(
            "--kv-transport rdma: this build has no RDMA support (build with --features rdma); \
             the node would refuse to start"
                .into(),
        );
    }
    let bind = (node.host.as_str(), node.port)
        .to_socket_addrs()
        .map_err(|err| format!("--host {}: {err}", node.host))?
        .next()
        .ok_or_else(|| format!("--host {} resolves to no address", node.host))?;
    if bind.ip().is_unspecified() && node.advertise_host.is_none() && role == Role::Prefill {
        notes.push(
            "--host is a wildcard and --advertise-host is not set: decode nodes on other \
             hosts cannot dial the KV addresses this node hands out"
                .into(),
        );
    }
    let tls = crate::tls::checked_settings(node).map_err(|e| format!("{e:#}"))?;
    check_tls_files(&tls, &mut notes)?;
    let config = json!({
        "role": role.as_str(),
        "model": model,
        "host": node.host,
        "port": node.port,
        "metrics_port": node.metrics_port,
        "advertise_host": node.advertise_host.map(|ip| ip.to_string()),
        "kv_transport": format!("{:?}", node.kv_transport).to_lowercase(),
        "rdma": {
            "device": node.rdma.rdma_device,
            "port": node.rdma.rdma_port,
            "gid_index": node.rdma.rdma_gid_index,
        },
        "drain_timeout_seconds": node.drain_timeout.as_secs_f64(),
        "max_waiting": node.max_waiting,
        "max_open_requests": node.max_open_requests(),
        "seed": node.seed,
        "log_format": format!("{:?}", node.log_format).to_lowercase(),
        "engine": {
            "device": e.device.to_string(),
            "cpu_isa": cpu_isa,
            "gpu_memory_utilization": e.gpu_memory_utilization,
            "block_size": e.block_size,
            "num_gpu_blocks": e.num_gpu_blocks,
            "host_cache_blocks": e.host_cache_blocks,
            "enable_prefix_caching": !e.no_enable_prefix_caching,
            "prefix_caching_hash_algo": e.prefix_caching_hash_algo.as_str(),
            "max_model_len": e.max_model_len,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "max_num_seqs": e.max_num_seqs,
        },
        "tls": tls.describe(),
        "role_flags": role_flags,
    });
    Ok((config, notes))
}

/// The TLS files are read and checked as at start where they are on this machine; a file
/// that is not here is a note (it may exist only where the node runs, e.g. from a Secret).
fn check_tls_files(tls: &pd_tls::TlsSettings, notes: &mut Vec<String>) -> Result<(), String> {
    let files = tls
        .identity
        .iter()
        .flat_map(|i| [&i.cert, &i.key])
        .chain(&tls.client_ca)
        .chain(&tls.ca);
    let missing: Vec<String> = files
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if !missing.is_empty() {
        notes.push(format!(
            "TLS files {} are not on this machine; they are read at start",
            missing.join(", ")
        ));
        return Ok(());
    }
    pd_tls::ServerTls::new(tls, pd_tls::Alpn::Grpc).map_err(|e| e.to_string())?;
    pd_tls::ClientTls::new(tls, pd_tls::Alpn::Grpc).map_err(|e| e.to_string())?;
    Ok(())
}

/// The whole `--check-config` run of a node binary: print and exit.
pub fn check_main(node: &NodeArgs, role: Role, role_flags: Value) -> ExitCode {
    match effective_config(node, role, role_flags) {
        Ok((config, notes)) => {
            for note in notes {
                eprintln!("note: {note}");
            }
            // A closed stdout (`| head`) is not this check's failure.
            let text = serde_json::to_string_pretty(&config).unwrap_or_default();
            let _ = writeln!(std::io::stdout(), "{text}");
            ExitCode::SUCCESS
        }
        Err(problem) => {
            eprintln!("error: {problem}");
            ExitCode::FAILURE
        }
    }
}
