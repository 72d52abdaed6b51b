//! Secure by default where it matters: a process bound to an address other hosts can reach
//! must have the security its role needs, or be told `--insecure`. Loopback stays the one
//! command developer path.

use std::net::{IpAddr, ToSocketAddrs};

use crate::args::TlsSettings;
use crate::error::TlsError;

/// Which part of the cluster is starting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// A prefill or decode node: needs mTLS (certificate, key and client CA).
    Node,
    /// The router: needs TLS or API keys.
    Router {
        /// Whether API keys are configured.
        keys_configured: bool,
    },
}

/// Whether `host` (an address or a name) can only be reached from this machine.
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return ip.is_loopback();
    }
    match (bare, 0).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<_> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback())
        }
        // A name that does not resolve cannot be bound either; binding reports that.
        Err(_) => true,
    }
}

/// `Ok` when a process of kind `exposure` may listen on `host` with `settings`; otherwise
/// the refusal, as one sentence saying why and how to fix it.
pub fn check_exposure(
    host: &str,
    settings: &TlsSettings,
    exposure: Exposure,
) -> Result<(), TlsError> {
    if settings.insecure || is_loopback(host) {
        return Ok(());
    }
    match exposure {
        Exposure::Node if !settings.requires_client_certs() => Err(TlsError::Flags(format!(
            "refusing to listen on {host} without mTLS, since any host that reaches this node \
             could run requests on it and read their KV: give --tls-cert, --tls-key and \
             --tls-client-ca, or --insecure to accept that"
        ))),
        Exposure::Router { keys_configured } if !keys_configured && !settings.serves_tls() => {
            Err(TlsError::Flags(format!(
                "refusing to listen on {host} with neither TLS nor API keys, since any host \
                 that reaches the router could use and read it in the clear: give --tls-cert \
                 and --tls-key or --api-keys, or --insecure to accept that"
            )))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::args::Identity;

    fn tls(client_ca: bool) -> TlsSettings {
        TlsSettings {
            identity: Some(Identity {
                cert: PathBuf::from("c"),
                key: PathBuf::from("k"),
            }),
            client_ca: client_ca.then(|| PathBuf::from("ca")),
            ..TlsSettings::default()
        }
    }

    #[test]
    fn loopback_needs_nothing() {
        for host in ["127.0.0.1", "::1", "[::1]", "localhost"] {
            assert!(is_loopback(host), "{host}");
            assert!(check_exposure(host, &TlsSettings::default(), Exposure::Node).is_ok());
        }
        assert!(!is_loopback("0.0.0.0") && !is_loopback("::"));
    }

    #[test]
    fn a_node_on_a_wildcard_needs_mtls_or_insecure() {
        let plain = TlsSettings::default();
        let err = check_exposure("0.0.0.0", &plain, Exposure::Node).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("without mTLS") && message.contains("--insecure"));
        assert!(!message.contains('\n'));
        assert!(check_exposure("0.0.0.0", &tls(false), Exposure::Node).is_err());
        assert!(check_exposure("0.0.0.0", &tls(true), Exposure::Node).is_ok());
        let insecure = TlsSettings {
            insecure: true,
            ..plain
        };
        assert!(check_exposure("0.0.0.0", &insecure, Exposure::Node).is_ok());
    }

    #[test]
    fn a_router_on_a_wildcard_needs_tls_or_keys() {
        let plain = TlsSettings::default();
        let no_keys = Exposure::Router {
            keys_configured: false,
        };
        let keys = Exposure::Router {
            keys_configured: true,
        };
        let message = check_exposure("0.0.0.0", &plain, no_keys)
            .unwrap_err()
            .to_string();
        assert!(message.contains("neither TLS nor API keys"), "{message}");
        assert!(check_exposure("0.0.0.0", &plain, keys).is_ok());
        assert!(check_exposure("0.0.0.0", &tls(false), no_keys).is_ok());
    }
}
