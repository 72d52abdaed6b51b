//! The tenant limits file (`--tenant-limits FILE`): parsing it into [`LimitsTable`], and
//! finding the limits of a tenant or an API key.
//!
//! Format: one subject per line, `SUBJECT key=value ...`, fields separated by spaces or tabs.
//! Lines that are empty or whose first non-blank character is `#` are ignored, as is
//! everything from a `#` that starts a field.
//!
//! - `SUBJECT` is a tenant name (the tenants of `--api-keys`), `default` (the limits of every
//!   tenant that has no line of its own; each such tenant gets buckets of its own), or
//!   `key:HEX`, the limits of one API key, where `HEX` is the start (8 to 64 hex digits) of
//!   the SHA-256 of the key (`printf %s KEY | sha256sum`). A request of a key with a line
//!   draws on both its key's buckets and its tenant's; where several `key:` lines match a
//!   key, the longest wins.
//! - Keys: `requests_per_second`, `generation_tokens_per_second`, `prompt_tokens_per_second`,
//!   each a positive number, and each with an optional `_burst` (e.g.
//!   `prompt_tokens_per_second_burst`): how much the bucket holds, a number ≥ 0 (≥ 1 for
//!   requests), by default one second's worth (at least 1 request). A limit not given is no
//!   limit: a tenant's line replaces `default` whole, it does not add to it.
//!
//! A bad line is refused with the file's path and the line's number.
//!
//! Not here: the buckets ([`super::bucket`]), reading the file again (`crate::watched`).

use std::collections::HashMap;
use std::path::Path;

use crate::auth::KeyId;
use crate::metrics::LimitKind;
use crate::tenant::{BadTenant, Tenant};

/// Shortest `key:` prefix, in hex digits: shorter ones would match keys by accident.
pub const MIN_KEY_PREFIX: usize = 8;

/// What is wrong with a limits file.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    #[error("cannot read the tenant limits file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tenant limits file {path} line {line}: {problem}")]
    Line {
        path: String,
        line: usize,
        problem: LineProblem,
    },
}

/// What is wrong with one line.
#[derive(Debug, thiserror::Error)]
pub enum LineProblem {
    #[error("`{0}` has no limits: give at least one `key=value` after it")]
    NoLimits(String),
    #[error(transparent)]
    Tenant(#[from] BadTenant),
    #[error(
        "`key:{0}` is not a key prefix: give {MIN_KEY_PREFIX} to 64 hex digits of the key's \
         SHA-256 (`printf %s KEY | sha256sum`)"
    )]
    KeyPrefix(String),
    #[error("`{0}` is not `key=value`")]
    NotKeyValue(String),
    #[error(
        "unknown key `{0}` (known: requests_per_second, generation_tokens_per_second, \
         prompt_tokens_per_second, each with an optional _burst)"
    )]
    UnknownKey(String),
    #[error("`{0}` is given twice on this line")]
    DuplicateKey(String),
    #[error("{key}: `{value}` is not a positive number")]
    BadRate { key: String, value: String },
    #[error("{key}: `{value}` is not a number ≥ {min}")]
    BadBurst {
        key: String,
        value: String,
        min: f64,
    },
    #[error("{0} is given without the rate it is the burst of")]
    BurstWithoutRate(String),
    #[error("`{0}` already has limits on line {1}")]
    DuplicateSubject(String, usize),
}

/// One bucket's limit: it refills at `per_second` up to `burst`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: f64,
}

/// A subject's limits, one per [`LimitKind`] (by [`LimitKind::index`]); `None`: no limit.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits([Option<Rate>; 3]);

impl Limits {
    pub fn get(&self, kind: LimitKind) -> Option<Rate> {
        self.0[kind.index()]
    }

    pub fn set(&mut self, kind: LimitKind, rate: Option<Rate>) {
        self.0[kind.index()] = rate;
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }
}

/// A `key:` prefix: 8 to 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyPrefix(String);

impl KeyPrefix {
    pub fn new(hex: &str) -> Option<Self> {
        let ok = (MIN_KEY_PREFIX..=64).contains(&hex.len())
            && hex.bytes().all(|b| b.is_ascii_hexdigit());
        ok.then(|| Self(hex.to_ascii_lowercase()))
    }

    pub fn matches(&self, key: &KeyId) -> bool {
        key.starts_with_hex(&self.0)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Who a line limits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Subject {
    /// Every tenant without a line of its own.
    Default,
    Tenant(Tenant),
    Key(KeyPrefix),
}

impl Subject {
    fn parse(text: &str) -> Result<Self, LineProblem> {
        if text == Tenant::DEFAULT {
            return Ok(Subject::Default);
        }
        if let Some(hex) = text.strip_prefix("key:") {
            return KeyPrefix::new(hex)
                .map(Subject::Key)
                .ok_or_else(|| LineProblem::KeyPrefix(hex.chars().take(80).collect()));
        }
        Ok(Subject::Tenant(Tenant::new(text)?))
    }
}

/// The parsed file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LimitsTable {
    default: Option<Limits>,
    tenants: HashMap<Tenant, Limits>,
    /// Longest prefix first.
    keys: Vec<(KeyPrefix, Limits)>,
}

/// The file's key for a limit's rate, and for its burst.
fn key_names(kind: LimitKind) -> (&'static str, &'static str) {
    match kind {
        LimitKind::Requests => ("requests_per_second", "requests_per_second_burst"),
        LimitKind::GenerationTokens => (
            "generation_tokens_per_second",
            "generation_tokens_per_second_burst",
        ),
        LimitKind::PromptTokens => ("prompt_tokens_per_second", "prompt_tokens_per_second_burst"),
    }
}

/// The limits of one line's `key=value` fields.
fn parse_limits<'a>(fields: impl Iterator<Item = &'a str>) -> Result<Limits, LineProblem> {
    let mut rates: [Option<f64>; 3] = [None; 3];
    let mut bursts: [Option<f64>; 3] = [None; 3];
    for field in fields {
        let (key, value) = field
            .split_once('=')
            .ok_or_else(|| LineProblem::NotKeyValue(field.chars().take(80).collect()))?;
        let found = LimitKind::ALL.iter().find_map(|&kind| {
            let (rate, burst) = key_names(kind);
            (key == rate)
                .then_some((kind, false))
                .or((key == burst).then_some((kind, true)))
        });
        let Some((kind, is_burst)) = found else {
            return Err(LineProblem::UnknownKey(key.chars().take(80).collect()));
        };
        let number: Option<f64> = value.parse().ok().filter(|v: &f64| v.is_finite());
        let slot = if is_burst {
            let min = if kind == LimitKind::Requests {
                1.0
            } else {
                0.0
            };
            let v = number
                .filter(|v| *v >= min)
                .ok_or_else(|| LineProblem::BadBurst {
                    key: key.to_string(),
                    value: value.chars().take(80).collect(),
                    min,
                })?;
            (&mut bursts[kind.index()], v)
        } else {
            let v = number
                .filter(|v| *v > 0.0)
                .ok_or_else(|| LineProblem::BadRate {
                    key: key.to_string(),
                    value: value.chars().take(80).collect(),
                })?;
            (&mut rates[kind.index()], v)
        };
        if slot.0.replace(slot.1).is_some() {
            return Err(LineProblem::DuplicateKey(key.to_string()));
        }
    }
    let mut limits = Limits::default();
    for kind in LimitKind::ALL {
        let i = kind.index();
        match (rates[i], bursts[i]) {
            (None, None) => {}
            (None, Some(_)) => {
                return Err(LineProblem::BurstWithoutRate(key_names(kind).1.to_string()));
            }
            (Some(per_second), burst) => {
                let least = if kind == LimitKind::Requests {
                    1.0
                } else {
                    0.0
                };
                let burst = burst.unwrap_or(per_second.max(least));
                limits.set(kind, Some(Rate { per_second, burst }));
            }
        }
    }
    Ok(limits)
}

impl LimitsTable {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, LimitsError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| LimitsError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text, &shown)
    }

    /// Parses a limits file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, LimitsError> {
        let mut table = Self::default();
        let mut seen: HashMap<Subject, usize> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let number = i + 1;
            let bad = |problem| LimitsError::Line {
                path: path.to_string(),
                line: number,
                problem,
            };
            let mut fields = line
                .split_ascii_whitespace()
                .take_while(|f| !f.starts_with('#'));
            let Some(subject_text) = fields.next() else {
                continue;
            };
            let subject = Subject::parse(subject_text).map_err(bad)?;
            let limits = parse_limits(fields).map_err(bad)?;
            if limits.is_empty() {
                return Err(bad(LineProblem::NoLimits(subject_text.to_string())));
            }
            if let Some(first) = seen.get(&subject) {
                return Err(bad(LineProblem::DuplicateSubject(
                    subject_text.to_string(),
                    *first,
                )));
            }
            seen.insert(subject.clone(), number);
            match subject {
                Subject::Default => table.default = Some(limits),
                Subject::Tenant(t) => {
                    table.tenants.insert(t, limits);
                }
                Subject::Key(k) => table.keys.push((k, limits)),
            }
        }
        table
            .keys
            .sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.as_str().len()));
        Ok(table)
    }

    /// The limits of `tenant`: its line's, else `default`'s.
    pub fn tenant(&self, tenant: &Tenant) -> Option<&Limits> {
        self.tenants.get(tenant).or(self.default.as_ref())
    }

    /// The `key:` line that matches `key` (the longest), if any.
    pub fn key(&self, key: &KeyId) -> Option<(&KeyPrefix, &Limits)> {
        self.keys
            .iter()
            .find(|(p, _)| p.matches(key))
            .map(|(p, l)| (p, l))
    }

    /// The limits of the `key:` line of exactly `prefix`.
    pub fn key_line(&self, prefix: &KeyPrefix) -> Option<&Limits> {
        self.keys.iter().find(|(p, _)| p == prefix).map(|(_, l)| l)
    }

    /// Whether the file has `key:` lines.
    pub fn has_key_lines(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether any line limits anything.
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.tenants.is_empty() && self.keys.is_empty()
    }

    /// How many lines limit something.
    pub fn len(&self) -> usize {
        usize::from(self.default.is_some()) + self.tenants.len() + self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line_error(text: &str) -> (usize, String) {
        match LimitsTable::parse(text, "limits.txt") {
            Err(LimitsError::Line { line, problem, .. }) => (line, problem.to_string()),
            other => panic!("{other:?}"),
        }
    }

    fn rate(per_second: f64, burst: f64) -> Option<Rate> {
        Some(Rate { per_second, burst })
    }

    #[test]
    fn parses_subjects_limits_bursts_and_comments() {
        let table = LimitsTable::parse(
            "# limits\n\
             \n\
             default requests_per_second=5 # five a second\n\
             acme  generation_tokens_per_second=100\tprompt_tokens_per_second=1000 \
             prompt_tokens_per_second_burst=5000\n\
             slow requests_per_second=0.5\n\
             key:ABCDEF0123 requests_per_second=2 requests_per_second_burst=4\n\
             key:abcdef01 requests_per_second=9\n\
             \t# indented comment\n",
            "limits.txt",
        )
        .unwrap();
        assert_eq!(table.len(), 5);
        let t = |n: &str| Tenant::new(n).unwrap();
        let acme = table.tenant(&t("acme")).unwrap();
        assert_eq!(
            acme.get(LimitKind::Requests),
            None,
            "a line replaces default"
        );
        assert_eq!(acme.get(LimitKind::GenerationTokens), rate(100.0, 100.0));
        assert_eq!(acme.get(LimitKind::PromptTokens), rate(1000.0, 5000.0));
        let other = table.tenant(&t("other")).unwrap();
        assert_eq!(other.get(LimitKind::Requests), rate(5.0, 5.0));
        assert_eq!(
            table.tenant(&t("slow")).unwrap().get(LimitKind::Requests),
            rate(0.5, 1.0),
            "a request burst holds at least one request"
        );
        // The longest matching prefix wins; prefixes are case-insensitive.
        let key = KeyId::of("k");
        let hex = key.hex();
        assert!(table.key(&key).is_none() || hex.starts_with("abcdef01"));
        let long = LimitsTable::parse(
            &format!(
                "key:{} requests_per_second=1\nkey:{} requests_per_second=2\n",
                &hex[..8],
                hex[..20].to_ascii_uppercase()
            ),
            "l",
        )
        .unwrap();
        let (prefix, limits) = long.key(&key).unwrap();
        assert_eq!(prefix.as_str(), &hex[..20]);
        assert_eq!(limits.get(LimitKind::Requests), rate(2.0, 2.0));
        assert!(long.key(&KeyId::of("another key")).is_none());
        assert!(LimitsTable::parse("# nothing\n", "l").unwrap().is_empty());
    }

    #[test]
    fn refuses_bad_lines_with_their_number() {
        let cases: [(&str, usize, &str); 12] = [
            ("acme\n", 1, "has no limits"),
            ("a b=1\n", 1, "unknown key `b`"),
            ("default x\n", 1, "is not `key=value`"),
            ("a{b} requests_per_second=1\n", 1, "not allowed"),
            ("key:abc requests_per_second=1\n", 1, "not a key prefix"),
            (
                "key:zzzzzzzzzz requests_per_second=1\n",
                1,
                "not a key prefix",
            ),
            ("a requests_per_second=0\n", 1, "not a positive number"),
            (
                "# c\na requests_per_second=inf\n",
                2,
                "not a positive number",
            ),
            ("a requests_per_second=-1\n", 1, "not a positive number"),
            (
                "a requests_per_second=1 requests_per_second_burst=0.5\n",
                1,
                "not a number ≥ 1",
            ),
            (
                "a prompt_tokens_per_second_burst=5\n",
                1,
                "without the rate",
            ),
            (
                "a requests_per_second=1\nb requests_per_second=1\na requests_per_second=2\n",
                3,
                "already has limits on line 1",
            ),
        ];
        for (text, line, wanted) in cases {
            let (got_line, problem) = line_error(text);
            assert_eq!(got_line, line, "{text:?}: {problem}");
            assert!(problem.contains(wanted), "{text:?}: {problem}");
        }
        let (_, problem) = line_error("a requests_per_second=1 requests_per_second=2\n");
        assert!(problem.contains("twice"), "{problem}");
        let whole = LimitsTable::parse("a nope=1\n", "/etc/pd/limits")
            .unwrap_err()
            .to_string();
        assert!(
            whole.starts_with("tenant limits file /etc/pd/limits line 1:"),
            "{whole}"
        );
    }
}
