//! prefill-node: computes prompts' KV caches and first tokens, and leases the KV to decode
//! nodes (see the library's docs). Prints one JSON ready line on stdout once it serves;
//! SIGTERM / Ctrl-C drains and exits 0.

use std::process::ExitCode;

use clap::Parser;
use prefill_node::PrefillArgs;

fn main() -> ExitCode {
    let args = PrefillArgs::parse();
    pd_node::init_tracing(args.node.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let shutdown = pd_node::shutdown_signal()?;
        prefill_node::serve(args, shutdown).await
    });
    // Model loading left running by a shutdown during start-up is not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
