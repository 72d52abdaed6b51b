//! prefill-node: computes prompts' KV caches and first tokens, and leases the KV to decode
//! nodes (see the library's docs). Prints one JSON ready line on stdout once it serves;
//! SIGTERM / Ctrl-C drains and exits 0.

use clap::Parser;
use prefill_node::PrefillArgs;

fn main() -> std::process::ExitCode {
    let args = PrefillArgs::parse();
    if args.node.check_config {
        if args.kv_lease_timeout.is_zero() {
            eprintln!("error: --kv-lease-timeout must be more than 0 seconds");
            return std::process::ExitCode::FAILURE;
        }
        let role_flags = serde_json::json!({
            "kv_port": args.kv_port,
            "kv_lease_timeout_seconds": args.kv_lease_timeout.as_secs_f64(),
        });
        return pd_node::check::check_main(&args.node, pd_engine::serve::Role::Prefill, role_flags);
    }
    let format = args.node.log_format;
    pd_node::run_main(format, |shutdown| prefill_node::serve(args, shutdown))
}
