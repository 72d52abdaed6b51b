//! The prefill nodes this decode node may pull KV from ([`KvPeers`]): the set of KV export
//! addresses the router last sent (`SetKvPeers`). A `KvHandle` naming any other address is
//! refused before this node resolves or dials anything, so a caller cannot make it connect
//! to an address of its choosing nor fill its cache with KV from there. An RDMA offer names
//! a second address (where to call `RdmaConnect`): it is used only on the host of the known
//! KV address ([`rdma_offer_on_peer`]). This module owns the set and the checks; the router
//! decides what is in the set (its registry).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::RwLock;

use tonic::Status;

/// Most addresses a set may hold (a cluster has far fewer prefill nodes).
pub const MAX_KV_PEERS: usize = 4096;

/// The known prefill nodes' KV export addresses; `None` until the router's first
/// `SetKvPeers`.
#[derive(Debug, Default)]
pub struct KvPeers(RwLock<Option<HashSet<String>>>);

/// One spelling per address: `SocketAddr`'s own for IP addresses (so that `[::1]:7` and
/// `[0:0:0:0:0:0:0:1]:7` are one), the host lowercased otherwise.
fn canonical(addr: &str) -> String {
    let addr = addr.trim();
    match addr.parse::<SocketAddr>() {
        Ok(a) => a.to_string(),
        Err(_) => addr.to_ascii_lowercase(),
    }
}

/// `host:port` with a port number.
fn is_host_port(addr: &str) -> bool {
    addr.parse::<SocketAddr>().is_ok()
        || addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

impl KvPeers {
    /// Replace the set with `addrs` (the whole set); returns how many addresses it holds.
    /// INVALID_ARGUMENT (and the old set kept) if one is not `host:port` or there are too
    /// many.
    pub fn set(&self, addrs: &[String]) -> Result<usize, Status> {
        if addrs.len() > MAX_KV_PEERS {
            return Err(Status::invalid_argument(format!(
                "kv_addrs holds {} addresses; at most {MAX_KV_PEERS}",
                addrs.len()
            )));
        }
        if let Some(bad) = addrs.iter().find(|a| !is_host_port(a.trim())) {
            return Err(Status::invalid_argument(format!(
                "kv_addrs: {bad:?} is not host:port"
            )));
        }
        let set: HashSet<String> = addrs.iter().map(|a| canonical(a)).collect();
        let n = set.len();
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(set);
        Ok(n)
    }

    /// Whether this node may pull from `addr`: PERMISSION_DENIED if it is not in the set,
    /// UNAVAILABLE while no set was sent yet (the router sends it before routing here).
    pub fn check(&self, addr: &str) -> Result<(), Status> {
        let peers = self.0.read().unwrap_or_else(|e| e.into_inner());
        match peers.as_ref() {
            None => Err(Status::unavailable(
                "this decode node does not know its prefill nodes yet (the router sends them \
                 with SetKvPeers when it registers the node); no KV was pulled",
            )),
            Some(set) if set.contains(&canonical(addr)) => Ok(()),
            Some(set) => Err(Status::permission_denied(format!(
                "kv.addr {addr:?} is not one of the {} prefill nodes this decode node knows \
                 (SetKvPeers); no connection was made",
                set.len()
            ))),
        }
    }
}

/// The host part of `host:port` (brackets of an IPv6 literal removed), lowercased.
fn host_of(addr: &str) -> Option<String> {
    let (host, _) = addr.trim().rsplit_once(':')?;
    Some(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase(),
    )
}

/// The handle's RDMA offer when its `RdmaConnect` address lies on the host of `kv_addr` (a
/// prefill node this node knows), else nothing: the pull then goes over TCP and no other
/// host is dialed. An empty or undecodable offer is returned empty too.
pub fn rdma_offer_on_peer<'a>(kv_addr: &str, offer: &'a [u8]) -> &'a [u8] {
    if offer.is_empty() {
        return offer;
    }
    let Ok(decoded) = pd_transport::rdma::RdmaOffer::decode(offer) else {
        return &[];
    };
    match (host_of(&decoded.connect_addr), host_of(kv_addr)) {
        (Some(a), Some(b)) if a == b => offer,
        _ => {
            tracing::warn!(
                kv_addr,
                connect_addr = %decoded.connect_addr,
                "the RDMA offer names another host than the prefill node's KV address; \
                 pulling over TCP"
            );
            &[]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn only_addresses_of_the_last_set_pass() {
        let peers = KvPeers::default();
        assert_eq!(
            peers.check("127.0.0.1:7000").unwrap_err().code(),
            Code::Unavailable,
            "nothing is known before the first set"
        );
        let set = vec![
            "127.0.0.1:7000".to_string(),
            "[::1]:7001".into(),
            "Prefill-0.local:7002".into(),
        ];
        assert_eq!(peers.set(&set).unwrap(), 3);
        peers.check("127.0.0.1:7000").unwrap();
        peers.check("[0:0:0:0:0:0:0:1]:7001").unwrap();
        peers.check("prefill-0.local:7002").unwrap();
        for other in [
            "127.0.0.1:7001",
            "10.0.0.1:7000",
            "evil:7000",
            "",
            "127.0.0.1",
        ] {
            let e = peers.check(other).unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{other}");
        }
        // The whole set each time: the old one is gone.
        assert_eq!(peers.set(&["127.0.0.1:7001".to_string()]).unwrap(), 1);
        assert_eq!(
            peers.check("127.0.0.1:7000").unwrap_err().code(),
            Code::PermissionDenied
        );
        // Aggregated mode: an empty set refuses every handle.
        assert_eq!(peers.set(&[]).unwrap(), 0);
        assert_eq!(
            peers.check("127.0.0.1:7001").unwrap_err().code(),
            Code::PermissionDenied
        );
    }

    #[test]
    fn hosts_compare_without_ports_or_brackets() {
        assert_eq!(host_of("10.0.0.1:7000").as_deref(), Some("10.0.0.1"));
        assert_eq!(host_of("[::1]:7000").as_deref(), Some("::1"));
        assert_eq!(host_of("Prefill-0:1").as_deref(), Some("prefill-0"));
        assert_eq!(host_of("nope"), None);
        assert!(rdma_offer_on_peer("10.0.0.1:7000", &[]).is_empty());
        assert!(
            rdma_offer_on_peer("10.0.0.1:7000", b"not an offer").is_empty(),
            "an unusable offer is dropped"
        );
    }

    #[test]
    fn an_rdma_offer_is_followed_only_to_the_known_host() {
        use pd_transport::rdma::{Fabric, LinkLayer, OfferLayout, RdmaOffer, RemoteRegion};
        let offer = |connect_addr: &str| {
            let mut gid = [0u8; 16];
            gid[0] = 0xfe;
            gid[15] = 1;
            RdmaOffer {
                fabric: Fabric {
                    link_layer: LinkLayer::InfiniBand,
                    lid: 3,
                    gid,
                },
                connect_addr: connect_addr.into(),
                block_bytes: 64,
                regions: vec![RemoteRegion {
                    addr: 0x1000,
                    len: 64,
                    rkey: 1,
                }],
                layout: OfferLayout::Packed,
                checksums: vec![0],
            }
            .encode()
        };
        let same = offer("10.0.0.1:50051");
        assert_eq!(rdma_offer_on_peer("10.0.0.1:7000", &same), &same[..]);
        let other = offer("10.6.6.6:50051");
        assert!(rdma_offer_on_peer("10.0.0.1:7000", &other).is_empty());
    }

    #[test]
    fn a_malformed_set_is_refused_and_changes_nothing() {
        let peers = KvPeers::default();
        peers.set(&["127.0.0.1:7000".to_string()]).unwrap();
        for bad in ["no-port", ":7000", "host:99999", "host:"] {
            let e = peers.set(&[bad.to_string()]).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{bad}");
        }
        peers.check("127.0.0.1:7000").unwrap();
        let many = vec!["127.0.0.1:1".to_string(); MAX_KV_PEERS + 1];
        assert_eq!(peers.set(&many).unwrap_err().code(), Code::InvalidArgument);
    }
}
