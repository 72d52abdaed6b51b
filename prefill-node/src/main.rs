//! prefill-node: computes a prompt's KV cache and first token, then leases the KV blocks to a
//! decode node. Not built yet (the cluster issue): this binary refuses to start rather than
//! pretend to serve.

fn main() -> std::process::ExitCode {
    eprintln!(
        "prefill-node: not available yet in this version; use `pdctl run` for single-process generation"
    );
    std::process::ExitCode::from(2)
}
