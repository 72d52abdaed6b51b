//! Node discovery by DNS: `--prefill-dns NAME:PORT` / `--decode-dns NAME:PORT` name a
//! headless Kubernetes Service (or any name with one address per node); every
//! `--dns-interval` the name is resolved again through the system resolver and the
//! registry follows: an address that appears becomes a node (health-checked before any
//! request goes to it), an address that disappears leaves routing at once (requests already
//! running on it finish: they hold the node, not the registry).
//!
//! A failed lookup keeps the nodes the name had (a DNS blip must not drain a healthy
//! cluster); only after [`FAILED_LOOKUPS_TO_EMPTY`] failures in a row are they treated as
//! gone (a headless Service with no ready pod does not resolve at all).

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::registry::{Registry, Role};

/// Consecutive failed lookups after which a name's nodes are taken out of routing.
pub const FAILED_LOOKUPS_TO_EMPTY: u32 = 3;

/// One `--prefill-dns` / `--decode-dns` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsTarget {
    pub role: Role,
    pub host: String,
    pub port: u16,
}

impl DnsTarget {
    /// `NAME:PORT`, e.g. `pd-prefill:50051` or `pd-decode.pd.svc.cluster.local:50051`.
    pub fn parse(role: Role, text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("--{role}-dns `{text}`: expected NAME:PORT"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("--{role}-dns `{text}`: `{port}` is not a port"))?;
        let valid = !host.is_empty()
            && host.len() <= 253
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        if !valid {
            return Err(format!("--{role}-dns `{text}`: `{host}` is not a DNS name"));
        }
        Ok(Self {
            role,
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for DnsTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// How names become addresses: the system resolver in the product; a scripted one in this
/// module's tests.
pub trait Resolve: Send + Sync + 'static {
    fn resolve(
        &self,
        target: &DnsTarget,
    ) -> impl std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send;
}

/// getaddrinfo through tokio (what `/etc/hosts`, the cluster DNS and search domains give).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    async fn resolve(&self, target: &DnsTarget) -> std::io::Result<Vec<SocketAddr>> {
        let found = tokio::net::lookup_host((target.host.as_str(), target.port)).await?;
        Ok(found.collect())
    }
}

/// The addresses a name stands for, across lookups.
#[derive(Debug, Default)]
pub struct NameState {
    current: BTreeSet<SocketAddr>,
    failures: u32,
}

/// What to change after one lookup.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub added: Vec<SocketAddr>,
    pub removed: Vec<SocketAddr>,
}

impl NameState {
    /// Applies one lookup's outcome and says which addresses came and went.
    pub fn apply(&mut self, lookup: std::io::Result<Vec<SocketAddr>>) -> Change {
        let next: BTreeSet<SocketAddr> = match lookup {
            Ok(found) => {
                self.failures = 0;
                found.into_iter().collect()
            }
            Err(_) => {
                self.failures += 1;
                if self.failures < FAILED_LOOKUPS_TO_EMPTY {
                    return Change::default();
                }
                BTreeSet::new()
            }
        };
        let change = Change {
            added: next.difference(&self.current).copied().collect(),
            removed: self.current.difference(&next).copied().collect(),
        };
        self.current = next;
        change
    }
}

/// Re-resolves `target` every `interval` and applies the changes to `registry`, until the
/// task is dropped. The first lookup happens at once.
pub async fn follow<R: Resolve>(
    registry: Arc<Registry>,
    target: DnsTarget,
    resolver: R,
    interval: Duration,
    health_interval: Duration,
    health_timeout: Duration,
) {
    let mut state = NameState::default();
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let lookup = resolver.resolve(&target).await;
        if let Err(e) = &lookup {
            tracing::warn!(name = %target, role = %target.role, error = %e, "DNS lookup failed");
        }
        let change = state.apply(lookup);
        for addr in change.removed {
            tracing::info!(name = %target, role = %target.role, %addr, "node left DNS: out of routing");
            registry.remove_discovered(target.role, &addr.to_string());
        }
        for addr in change.added {
            tracing::info!(name = %target, role = %target.role, %addr, "node found in DNS");
            if let Err(e) = registry.add_discovered(
                target.role,
                &addr.to_string(),
                health_interval,
                health_timeout,
            ) {
                tracing::warn!(name = %target, %addr, error = %e, "cannot add the node");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn targets_parse_and_refuse_with_the_flag_named() {
        let t = DnsTarget::parse(Role::Prefill, "pd-prefill.pd.svc:50051").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("pd-prefill.pd.svc", 50051));
        for bad in [
            "pd-prefill",
            "pd-prefill:0",
            "pd-prefill:http",
            ":50051",
            "a b:1",
        ] {
            let e = DnsTarget::parse(Role::Decode, bad).unwrap_err();
            assert!(e.contains("--decode-dns"), "{bad}: {e}");
        }
    }

    #[test]
    fn appearing_and_disappearing_addresses_are_reported_once() {
        let mut s = NameState::default();
        let c = s.apply(Ok(addrs(&["10.0.0.1:1", "10.0.0.2:1"])));
        assert_eq!(c.added, addrs(&["10.0.0.1:1", "10.0.0.2:1"]));
        assert!(c.removed.is_empty());
        assert_eq!(
            s.apply(Ok(addrs(&["10.0.0.2:1", "10.0.0.1:1"]))),
            Change::default()
        );
        let c = s.apply(Ok(addrs(&["10.0.0.2:1", "10.0.0.3:1"])));
        assert_eq!(c.added, addrs(&["10.0.0.3:1"]));
        assert_eq!(c.removed, addrs(&["10.0.0.1:1"]));
    }

    #[test]
    fn a_dns_blip_keeps_the_nodes_and_a_lasting_failure_drains_them() {
        let mut s = NameState::default();
        s.apply(Ok(addrs(&["10.0.0.1:1"])));
        let fail = || Err(std::io::Error::other("SERVFAIL"));
        for _ in 1..FAILED_LOOKUPS_TO_EMPTY {
            assert_eq!(s.apply(fail()), Change::default());
        }
        let c = s.apply(fail());
        assert_eq!(c.removed, addrs(&["10.0.0.1:1"]));
        // A success resets the count.
        s.apply(Ok(addrs(&["10.0.0.1:1"])));
        assert_eq!(s.apply(fail()), Change::default());
    }
}
