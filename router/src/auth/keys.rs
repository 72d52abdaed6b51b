//! The API keys file (`--api-keys FILE`): parsing it into a [`KeyTable`], and finding the
//! tenant of a presented key.
//!
//! Format: one `TENANT KEY` pair per line, separated by spaces or tabs; a tenant may have
//! several keys (one line each), a key belongs to one tenant only. Lines that are empty or
//! whose first non-blank character is `#` are ignored (a `#` inside a key is part of it).
//! Tenant names follow [`Tenant::new`]'s rules; a key is 1 or more visible ASCII characters
//! (what an HTTP `Authorization` header can carry). Anything else is refused with the file's
//! path and the line's number, never with the key itself.
//!
//! Keys are kept only as SHA-256 digests. A presented key is hashed and compared with every
//! digest in constant time ([`subtle`]), all of them, whether one matched or not, so the time
//! an answer takes does not depend on which key, or how much of one, was right.
//!
//! Not here: reading the file again when it changes, and the transports ([`super`]).

use std::path::Path;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::tenant::{BadTenant, Tenant};

/// Keys shorter than this are accepted with a warning: they are guessable.
pub const SHORT_KEY: usize = 16;

/// What is wrong with a keys file.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read the API keys file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("API keys file {path} line {line}: {problem}")]
    Line {
        path: String,
        line: usize,
        problem: LineProblem,
    },
    #[error(
        "API keys file {path} has no keys: give at least one `TENANT KEY` line (without \
         --api-keys the router serves everyone)"
    )]
    Empty { path: String },
}

/// What is wrong with one line (never showing the key).
#[derive(Debug, thiserror::Error)]
pub enum LineProblem {
    #[error("expected `TENANT KEY` (two fields separated by spaces), found {0} field(s)")]
    Fields(usize),
    #[error(transparent)]
    Tenant(#[from] BadTenant),
    #[error("the key has a character that is not visible ASCII (an HTTP header cannot carry it)")]
    KeyCharacters,
    #[error("this key is already given on line {0}: a key belongs to one tenant, once")]
    Duplicate(usize),
}

/// A key's SHA-256 digest.
type KeyDigest = [u8; 32];

/// A presented key's identity: its SHA-256, written as the lowercase hex (64 digits) that
/// `printf %s KEY | sha256sum` prints. It names a key without revealing it (per-key limits
/// are written with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId(KeyDigest);

impl KeyId {
    pub fn of(key: &str) -> Self {
        Self(digest(key.as_bytes()))
    }

    /// The digest in lowercase hex.
    pub fn hex(&self) -> String {
        crate::tenant::hex(&self.0)
    }

    /// Whether the hex of the digest starts with `prefix` (hex digits, any case).
    pub fn starts_with_hex(&self, prefix: &str) -> bool {
        prefix.len() <= 64
            && prefix.bytes().enumerate().all(|(i, c)| {
                let byte = self.0[i / 2];
                let nibble = if i % 2 == 0 { byte >> 4 } else { byte & 0x0f };
                char::from(c).to_digit(16) == Some(u32::from(nibble))
            })
    }
}

fn digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

/// The tenants and the digests of their keys.
#[derive(Debug, Clone)]
pub struct KeyTable {
    entries: Vec<(KeyDigest, Tenant)>,
}

impl KeyTable {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, KeysError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| KeysError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text, &shown)
    }

    /// Parses a keys file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, KeysError> {
        let mut entries: Vec<(KeyDigest, Tenant)> = Vec::new();
        let mut lines_of: Vec<usize> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let number = i + 1;
            let bad = |problem| KeysError::Line {
                path: path.to_string(),
                line: number,
                problem,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            let [tenant, key] = fields[..] else {
                return Err(bad(LineProblem::Fields(fields.len())));
            };
            let tenant = Tenant::new(tenant).map_err(|e| bad(e.into()))?;
            if !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad(LineProblem::KeyCharacters));
            }
            if key.len() < SHORT_KEY {
                tracing::warn!(path, line = number, %tenant,
                    "API key shorter than {SHORT_KEY} characters: it can be guessed");
            }
            let d = digest(key.as_bytes());
            if let Some(j) = entries.iter().position(|(e, _)| *e == d) {
                return Err(bad(LineProblem::Duplicate(lines_of[j])));
            }
            entries.push((d, tenant));
            lines_of.push(number);
        }
        if entries.is_empty() {
            return Err(KeysError::Empty {
                path: path.to_string(),
            });
        }
        Ok(Self { entries })
    }

    /// The tenant `key` belongs to, if any. Compares with every digest in constant time.
    pub fn tenant_of(&self, key: &str) -> Option<Tenant> {
        self.lookup(key).map(|(tenant, _)| tenant)
    }

    /// The tenant `key` belongs to and the key's identity, if it is one of the keys.
    /// Compares with every digest in constant time.
    pub fn lookup(&self, key: &str) -> Option<(Tenant, KeyId)> {
        let d = digest(key.as_bytes());
        let mut found = None;
        for (e, tenant) in &self.entries {
            if bool::from(e.ct_eq(&d)) {
                found = Some(tenant);
            }
        }
        found.map(|tenant| (tenant.clone(), KeyId(d)))
    }

    /// The tenants, each once, sorted.
    pub fn tenants(&self) -> Vec<Tenant> {
        let mut t: Vec<Tenant> = self.entries.iter().map(|(_, t)| t.clone()).collect();
        t.sort();
        t.dedup();
        t
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line_error(text: &str) -> (usize, String) {
        match KeyTable::parse(text, "keys.txt") {
            Err(KeysError::Line { line, problem, .. }) => (line, problem.to_string()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_tenants_keys_comments_and_blank_lines() {
        let table = KeyTable::parse(
            "# tenants\n\nacme  key-acme-1\n  acme\tkey-acme-2  \nbeta key#beta\n   # indented\n",
            "keys.txt",
        )
        .unwrap();
        assert_eq!(table.len(), 3);
        let acme = Tenant::new("acme").unwrap();
        assert_eq!(table.tenant_of("key-acme-1"), Some(acme.clone()));
        assert_eq!(table.tenant_of("key-acme-2"), Some(acme));
        assert_eq!(table.tenant_of("key#beta").unwrap().as_str(), "beta");
        assert_eq!(table.tenant_of("key-acme-"), None);
        assert_eq!(table.tenant_of(""), None);
        let names: Vec<String> = table.tenants().iter().map(ToString::to_string).collect();
        assert_eq!(names, ["acme", "beta"]);
    }

    #[test]
    fn a_key_id_is_its_sha256_and_matches_hex_prefixes() {
        // printf %s key-two-0123456789 | sha256sum
        let hex = "bddf9699d691b9e1dca55302c88695ccf3da92bf74543804363977e1c3b4e93d";
        let id = KeyId::of("key-two-0123456789");
        assert_eq!(id.hex(), hex);
        for prefix in ["", "b", "bddf9699", "BDDF9699D691", hex] {
            assert!(id.starts_with_hex(prefix), "{prefix}");
        }
        for prefix in ["c", "bddf9698", "bddf969x", &format!("{hex}0")] {
            assert!(!id.starts_with_hex(prefix), "{prefix}");
        }
        let table = KeyTable::parse("t key-two-0123456789\n", "k").unwrap();
        let (tenant, found) = table.lookup("key-two-0123456789").unwrap();
        assert_eq!((tenant.as_str(), found), ("t", id));
    }

    #[test]
    fn refuses_bad_lines_naming_the_line_never_the_key() {
        let (line, problem) = line_error("a k1\nb\n");
        assert_eq!(line, 2);
        assert!(problem.contains("found 1 field"), "{problem}");
        let (line, problem) = line_error("# x\na k1 extra\n");
        assert_eq!((line, problem.contains("found 3")), (2, true));
        let (line, problem) = line_error("a{b} secret-key\n");
        assert_eq!(line, 1);
        assert!(problem.contains("a{b}") && !problem.contains("secret-key"));
        let (line, problem) = line_error("a k\u{e9}y\n");
        assert_eq!(line, 1);
        assert!(problem.contains("visible ASCII"));
        let (line, problem) = line_error("a same-key\nb other\nc same-key\n");
        assert_eq!(line, 3);
        assert!(problem.contains("line 1") && !problem.contains("same-key"));
        let whole = KeyTable::parse("a same-key\na same-key\n", "/etc/pd/keys")
            .unwrap_err()
            .to_string();
        assert!(
            whole.starts_with("API keys file /etc/pd/keys line 2:"),
            "{whole}"
        );
        assert!(matches!(
            KeyTable::parse("# none\n\n", "k"),
            Err(KeysError::Empty { .. })
        ));
    }
}
