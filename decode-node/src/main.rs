//! decode-node: pulls a prompt's KV from a prefill node and generates the rest with continuous
//! batching. Not built yet (the cluster issue): this binary refuses to start rather than
//! pretend to serve.

fn main() -> std::process::ExitCode {
    eprintln!(
        "decode-node: not available yet in this version; use `pdctl run` for single-process generation"
    );
    std::process::ExitCode::from(2)
}
