//! decode-node: pulls prompts' KV from prefill nodes and generates the rest (see the
//! library's docs). Prints one JSON ready line on stdout once it serves;
//! SIGTERM / Ctrl-C drains and exits 0.

use clap::Parser;
use decode_node::DecodeArgs;

fn main() -> std::process::ExitCode {
    let args = DecodeArgs::parse();
    if args.node.check_config {
        return pd_node::check::check_main(
            &args.node,
            pd_engine::serve::Role::Decode,
            serde_json::Value::Null,
        );
    }
    let format = args.node.log_format;
    pd_node::run_main(format, |shutdown| decode_node::serve(args, shutdown))
}
