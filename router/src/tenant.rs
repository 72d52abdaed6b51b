//! Tenants: who a request belongs to, and what that changes for it.
//!
//! A tenant comes from the API key a client presents (`--api-keys`, [`crate::auth`]); without
//! keys every request belongs to the one tenant [`Tenant::DEFAULT`] (`default`). A tenant owns
//! its request ids (the in-flight table is keyed by tenant and id, so another tenant's `Abort`
//! never reaches its requests) and, with keys on, its cached KV: [`Tenancy::cache_salt`]
//! derives every request's cache salt from its tenant, so no block hash of one tenant ever
//! equals one of another's, and `cached_tokens` never reveals another tenant's prompts.
//! `--shared-prefix-cache` turns that derivation off (the client's own salt, if any, is used
//! as is), for deployments with one tenant or tenants that trust each other.
//!
//! Not here: checking keys (`crate::auth`), per-tenant metrics (`crate::metrics`).

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Longest tenant name, in bytes.
pub const MAX_TENANT_BYTES: usize = 64;

/// Domain string of the tenant cache salt (see [`Tenancy::cache_salt`]).
pub const SALT_DOMAIN: &[u8] = b"pd-router/tenant-cache-salt/v1";

/// A tenant's name: 1 to [`MAX_TENANT_BYTES`] of ASCII letters, digits, `_`, `-` and `.`,
/// starting with a letter or digit (it becomes a Prometheus label value and a log field).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(Arc<str>);

/// A tenant name that breaks [`Tenant`]'s rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tenant name `{0}` is not allowed: use 1 to {MAX_TENANT_BYTES} ASCII letters, digits, `_`, \
     `-` or `.`, starting with a letter or digit"
)]
pub struct BadTenant(pub String);

impl Tenant {
    /// The tenant of every request when the router runs without `--api-keys`.
    pub const DEFAULT: &'static str = "default";

    pub fn new(name: &str) -> Result<Self, BadTenant> {
        let ok = !name.is_empty()
            && name.len() <= MAX_TENANT_BYTES
            && name.as_bytes()[0].is_ascii_alphanumeric()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if ok {
            Ok(Self(name.into()))
        } else {
            Err(BadTenant(name.chars().take(MAX_TENANT_BYTES * 2).collect()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The `default` tenant, made once: without keys every request takes a clone of it.
static DEFAULT_TENANT: std::sync::LazyLock<Tenant> =
    std::sync::LazyLock::new(|| Tenant(Tenant::DEFAULT.into()));

impl Default for Tenant {
    fn default() -> Self {
        DEFAULT_TENANT.clone()
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tenant({})", self.0)
    }
}

/// How tenants separate their cached KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tenancy {
    /// API keys are on: requests carry the tenant of their key.
    pub keys: bool,
    /// `--shared-prefix-cache`: tenants share cached KV (their salt is not derived).
    pub shared_prefix_cache: bool,
}

impl Tenancy {
    /// The cache salt the nodes and the router's prefix-aware policy hash a request's blocks
    /// with. Without keys, or with `--shared-prefix-cache`, it is the client's own salt.
    /// Otherwise it is the lowercase hex (64 digits) of SHA-256 over
    ///
    /// `SALT_DOMAIN || len(tenant) as u64 LE || tenant || salt_bytes`
    ///
    /// where [`SALT_DOMAIN`] is the 30 ASCII bytes `pd-router/tenant-cache-salt/v1` and
    /// `salt_bytes` is the byte `0x00` without a client salt, else `0x01`, the salt's length
    /// in bytes as a u64 LE, then its UTF-8 bytes (the engines' own encoding of a salt,
    /// `pd_engine::kv::prefix::hash`). Two tenants never get the same salt, nor does a tenant with and
    /// without a client salt.
    pub fn cache_salt(&self, tenant: &Tenant, client: Option<String>) -> Option<String> {
        if !self.keys || self.shared_prefix_cache {
            return client;
        }
        let mut h = Sha256::new();
        h.update(SALT_DOMAIN);
        h.update((tenant.as_str().len() as u64).to_le_bytes());
        h.update(tenant.as_str().as_bytes());
        match &client {
            None => h.update([0x00]),
            Some(s) => {
                h.update([0x01]);
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
        Some(hex(&h.finalize()))
    }
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names() {
        for ok in ["default", "acme", "team-7", "a.b_c", "A1", &"x".repeat(64)] {
            assert_eq!(Tenant::new(ok).unwrap().as_str(), ok);
        }
        for bad in [
            "",
            "-a",
            ".a",
            "a b",
            "a\"b",
            "é",
            "a{b}",
            &"x".repeat(65),
            "a/b",
        ] {
            assert!(Tenant::new(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Tenant::default().as_str(), "default");
    }

    #[test]
    fn salts_separate_tenants_only_with_keys() {
        let (a, b) = (Tenant::new("a").unwrap(), Tenant::new("b").unwrap());
        let open = Tenancy::default();
        assert_eq!(open.cache_salt(&a, None), None);
        assert_eq!(open.cache_salt(&a, Some("s".into())), Some("s".into()));
        let shared = Tenancy {
            keys: true,
            shared_prefix_cache: true,
        };
        assert_eq!(shared.cache_salt(&a, None), None);
        assert_eq!(shared.cache_salt(&b, Some("s".into())), Some("s".into()));
        let keys = Tenancy {
            keys: true,
            shared_prefix_cache: false,
        };
        let salts = [
            keys.cache_salt(&a, None),
            keys.cache_salt(&b, None),
            keys.cache_salt(&a, Some(String::new())),
            keys.cache_salt(&a, Some("s".into())),
            keys.cache_salt(&b, Some("s".into())),
        ];
        let unique: std::collections::HashSet<_> = salts.iter().collect();
        assert_eq!(unique.len(), salts.len());
        assert_eq!(keys.cache_salt(&a, None), salts[0], "deterministic");
        // Pinned: the documented encoding (cross-checked with Python's hashlib).
        assert_eq!(
            salts[0].as_deref(),
            Some("20786b308cc444c6bb25f711bab78202f8a5b87a57d2b1b1a1070cccf67bcf2d"),
        );
        assert_eq!(
            salts[4].as_deref(),
            Some("d9d7ebe3ea1400dfa57f003a63ea76fa06cd9f359bc955cec442b66b4275c573"),
        );
    }
}
