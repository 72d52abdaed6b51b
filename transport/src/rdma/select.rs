//! Which transport a node runs and which path each transfer takes.
//!
//! - At start ([`start_rdma`]): `tcp` never opens a device; `rdma` must open one or the
//!   node does not start; `auto` opens one if it can and runs TCP-only otherwise. The prefill
//!   node always runs its TCP export server, so TCP is there in every mode.
//! - Per transfer ([`choose_path`]): RDMA when this node has a device, the prefill node
//!   offered the lease over RDMA (a non-empty `KvHandle.rdma`) and both ports share a fabric
//!   ([`Fabric::common_with`]); TCP otherwise.
//! - After a failed RDMA read the transfer is retried once over TCP before the request
//!   fails; the RDMA attempt gets only part of the deadline ([`rdma_deadline`]) so that the
//!   retry has time left.

use std::time::{Duration, Instant};

use super::descriptor::RdmaOffer;
use super::endpoint::Fabric;
use super::error::{RdmaError, RdmaStartError};

/// `--kv-transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTransportMode {
    Tcp,
    Rdma,
    Auto,
}

/// Open the RDMA side as `mode` asks: `open` is called for `rdma` and `auto` only.
pub fn start_rdma<T>(
    mode: KvTransportMode,
    open: impl FnOnce() -> Result<T, RdmaError>,
) -> Result<Option<T>, RdmaStartError> {
    match mode {
        KvTransportMode::Tcp => Ok(None),
        KvTransportMode::Rdma => match open() {
            Ok(t) => Ok(Some(t)),
            Err(RdmaError::NotBuilt) => Err(RdmaStartError::NotBuilt),
            Err(e) => Err(RdmaStartError::NoDevice(e)),
        },
        KvTransportMode::Auto => match open() {
            Ok(t) => Ok(Some(t)),
            Err(e) => {
                tracing::info!(error = %e, "no usable RDMA: KV moves over TCP (--kv-transport auto)");
                Ok(None)
            }
        },
    }
}

/// Why a transfer goes over TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcpBecause {
    /// This node runs without RDMA.
    NoLocalRdma,
    /// The prefill node did not offer the lease over RDMA.
    NotOffered,
    /// The offer could not be decoded or is inconsistent.
    BadOffer(String),
    /// The two ports cannot reach each other.
    NoCommonFabric { ours: Fabric, theirs: Fabric },
}

/// The path of one transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Path {
    Rdma(RdmaOffer),
    Tcp(TcpBecause),
}

/// The path for a transfer from an exporter whose `KvHandle.rdma` is `offer`, on a node
/// whose RDMA port is `local` (`None`: no RDMA here).
pub fn choose_path(local: Option<&Fabric>, offer: &[u8]) -> Path {
    let Some(local) = local else {
        return Path::Tcp(TcpBecause::NoLocalRdma);
    };
    if offer.is_empty() {
        return Path::Tcp(TcpBecause::NotOffered);
    }
    match RdmaOffer::decode(offer) {
        Err(e) => Path::Tcp(TcpBecause::BadOffer(e.to_string())),
        Ok(o) if !local.common_with(&o.fabric) => Path::Tcp(TcpBecause::NoCommonFabric {
            ours: *local,
            theirs: o.fabric,
        }),
        Ok(o) => Path::Rdma(o),
    }
}

/// The RDMA attempt's deadline: half of what is left, so that a TCP retry after a failure
/// (which may be the RDMA deadline itself) still has the other half.
pub fn rdma_deadline(now: Instant, deadline: Instant) -> Instant {
    now + deadline.saturating_duration_since(now) / 2
}

/// An RDMA attempt with less time than this left goes straight to TCP.
pub const MIN_RDMA_TIME: Duration = Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::super::descriptor::tests::offer;
    use super::super::endpoint::LinkLayer;
    use super::*;

    #[test]
    fn modes_open_the_device_as_documented() {
        let no_device = || Err::<(), _>(RdmaError::Unavailable("no device".into()));
        let called = std::cell::Cell::new(false);
        let r = start_rdma(KvTransportMode::Tcp, || {
            called.set(true);
            Ok(())
        });
        assert!(matches!(r, Ok(None)) && !called.get(), "tcp never probes");
        assert!(matches!(
            start_rdma(KvTransportMode::Auto, no_device),
            Ok(None)
        ));
        assert!(matches!(
            start_rdma(KvTransportMode::Auto, || Ok(5)),
            Ok(Some(5))
        ));
        assert!(matches!(
            start_rdma(KvTransportMode::Rdma, no_device),
            Err(RdmaStartError::NoDevice(_))
        ));
        assert!(matches!(
            start_rdma(KvTransportMode::Rdma, || Err::<(), _>(RdmaError::NotBuilt)),
            Err(RdmaStartError::NotBuilt)
        ));
    }

    #[test]
    fn rdma_needs_a_local_device_an_offer_and_a_common_fabric() {
        let o = offer(4096, &[2]);
        let bytes = o.encode();
        assert_eq!(
            choose_path(None, &bytes),
            Path::Tcp(TcpBecause::NoLocalRdma)
        );
        assert_eq!(
            choose_path(Some(&o.fabric), &[]),
            Path::Tcp(TcpBecause::NotOffered)
        );
        assert!(matches!(
            choose_path(Some(&o.fabric), &bytes[..10]),
            Path::Tcp(TcpBecause::BadOffer(_))
        ));
        let mut other_subnet = o.fabric;
        other_subnet.gid[7] = 9;
        assert!(matches!(
            choose_path(Some(&other_subnet), &bytes),
            Path::Tcp(TcpBecause::NoCommonFabric { .. })
        ));
        let mut roce = o.fabric;
        roce.link_layer = LinkLayer::Ethernet;
        assert!(matches!(
            choose_path(Some(&roce), &bytes),
            Path::Tcp(TcpBecause::NoCommonFabric { .. })
        ));
        assert_eq!(choose_path(Some(&o.fabric), &bytes), Path::Rdma(o));
    }

    #[test]
    fn the_rdma_attempt_leaves_half_the_time_for_tcp() {
        let now = Instant::now();
        let d = now + Duration::from_secs(4);
        assert_eq!(rdma_deadline(now, d), now + Duration::from_secs(2));
        assert_eq!(rdma_deadline(d, now), d, "already past");
    }
}
