//! prefill-node: computes prompts' KV caches and first tokens, and leases the KV to decode
//! nodes (see the library's docs). Prints one JSON ready line on stdout once it serves;
//! SIGTERM / Ctrl-C drains and exits 0.

use clap::Parser;
use prefill_node::PrefillArgs;

fn main() -> std::process::ExitCode {
    let args = PrefillArgs::parse();
    let format = args.node.log_format;
    pd_node::run_main(format, |shutdown| prefill_node::serve(args, shutdown))
}
