//! The RDMA backend on `sideway` (feature `rdma`): device selection, memory registration,
//! queue pairs, the exporter and the reader. Everything that touches a verbs object lives
//! below this module; what crosses its boundary is this crate's own types.

mod device;
mod export;
mod host_kv;
mod landing;
mod qp;
mod read;
mod transfer;

pub use device::RdmaDevice;
pub use export::RdmaExporter;
pub use read::RdmaReader;

/// An error of a verbs call as text (with its source chain: sideway's errors say "failed
/// to ..." and keep the OS error in their source).
fn verbs_error(op: &'static str, e: impl std::error::Error) -> super::RdmaError {
    super::RdmaError::Verbs {
        op,
        message: chain(&e),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}
