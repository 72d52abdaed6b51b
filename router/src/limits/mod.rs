//! Per-tenant limits (`--tenant-limits FILE`): token buckets per tenant, and per API key, on
//! requests per second, generated tokens per second and prompt tokens per second, where a
//! cached prompt token costs `--cached-token-cost` of a computed one: a tenant whose prompts
//! reuse cached prefixes gets more throughput from the same limit.
//!
//! A request is checked on arrival, before admission control gives it a slot and before its
//! body is read ([`TenantLimits::admit`]): it passes when each of its buckets has room (one
//! request in a request bucket; a token bucket that is not in debt), and takes one request
//! from its request buckets. It is refused otherwise, as admission refuses (gRPC
//! RESOURCE_EXHAUSTED, HTTP 429, each with the seconds until the bucket has room), and
//! counted on `pd_router_tenant_requests_rejected_total{tenant,reason}`. A request that
//! passes carries an [`Account`] that charges what it actually uses: its generated tokens as
//! they stream to the client, and, when its usage is known (its last message), its prompt:
//! `(prompt_tokens - cached_tokens) + cost × cached_tokens`, from the usage the client is
//! told (a client that goes away before its usage, after its first token, is charged its
//! whole prompt as computed). Token buckets can therefore go into debt, and a subject in debt is refused until
//! the refill pays it back.
//!
//! The buckets of a request: its tenant's (the tenant's line, else `default`'s, each tenant
//! with buckets of its own), and its key's where a `key:` line matches the key. The file is
//! read again when it changes (`crate::watched`); buckets keep their levels across a
//! reload (cut down to a lowered burst), so a reload neither forgives debt nor refills.
//!
//! Not here: the file's format ([`mod@file`]), a bucket's arithmetic ([`bucket`]), the refusal's
//! wire shape ([`crate::admission`]).

pub mod bucket;
pub mod file;

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_proto::pb;

pub use self::bucket::Bucket;
pub use self::file::{KeyPrefix, Limits, LimitsError, LimitsTable, Rate};
use crate::auth::KeyId;
use crate::metrics::{LimitKind, RouterMetrics, WatchedFileKind};
use crate::tenant::Tenant;
use crate::watched::{Watched, WatchedFile};

impl WatchedFile for LimitsTable {
    type Error = LimitsError;
    const KIND: WatchedFileKind = WatchedFileKind::TenantLimits;

    fn load(path: &Path) -> Result<Self, LimitsError> {
        LimitsTable::load(path)
    }
}

/// What a cached prompt token costs, as a fraction of a computed one (`--cached-token-cost`):
/// a finite number in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct CachedTokenCost(f64);

/// A `--cached-token-cost` outside [0, 1].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "`{0}` is not a cached token cost: give a number from 0 (cached prompt tokens are free) to \
     1 (they cost as much as computed ones)"
)]
pub struct BadCachedTokenCost(pub String);

impl CachedTokenCost {
    /// The default: a cached token costs a tenth of a computed one.
    pub const DEFAULT: CachedTokenCost = CachedTokenCost(0.1);

    pub fn new(cost: f64) -> Result<Self, BadCachedTokenCost> {
        if cost.is_finite() && (0.0..=1.0).contains(&cost) {
            Ok(Self(cost))
        } else {
            Err(BadCachedTokenCost(cost.to_string()))
        }
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// What a prompt costs: its computed tokens in full, its cached ones at this cost.
    pub fn prompt_cost(self, prompt_tokens: u32, cached_tokens: u32) -> f64 {
        let cached = cached_tokens.min(prompt_tokens);
        f64::from(prompt_tokens - cached) + self.0 * f64::from(cached)
    }
}

impl Default for CachedTokenCost {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl FromStr for CachedTokenCost {
    type Err = BadCachedTokenCost;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let cost: f64 = text
            .trim()
            .parse()
            .map_err(|_| BadCachedTokenCost(text.chars().take(40).collect()))?;
        Self::new(cost)
    }
}

impl std::fmt::Display for CachedTokenCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Whose buckets: a tenant's, or an API key's (by its line's prefix).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Owner {
    Tenant(Tenant),
    Key(KeyPrefix),
}

/// Whose limit refused a request, as its message names it (never the key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whose {
    Tenant(Tenant),
    ApiKey,
}

impl std::fmt::Display for Whose {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Whose::Tenant(t) => write!(f, "tenant `{t}`"),
            Whose::ApiKey => f.write_str("this API key"),
        }
    }
}

/// A refused request: which bucket, and when it has room.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "{who} is over its limit of {} {} per second (burst {}); retry after {}s (the router's \
     --tenant-limits file)",
    .rate.per_second, unit(*.kind), .rate.burst, self.retry_after_secs()
)]
pub struct LimitRefusal {
    pub who: Whose,
    pub kind: LimitKind,
    pub rate: Rate,
    /// How long until the bucket has room.
    pub wait: Duration,
}

fn unit(kind: LimitKind) -> &'static str {
    match kind {
        LimitKind::Requests => "requests",
        LimitKind::GenerationTokens => "generated tokens",
        LimitKind::PromptTokens => "prompt tokens (a cached one at the cached token cost)",
    }
}

impl LimitRefusal {
    /// The retry hint in whole seconds: the wait rounded up, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        let secs = self.wait.as_secs_f64().ceil();
        if secs.is_finite() && secs < u64::MAX as f64 {
            (secs as u64).max(1)
        } else {
            u64::MAX
        }
    }

    /// The retry hint: [`LimitRefusal::retry_after_secs`].
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(self.retry_after_secs())
    }
}

/// The router's tenant limits: the file in use, the cached token cost, every bucket.
#[derive(Debug)]
pub struct TenantLimits {
    file: Arc<Watched<LimitsTable>>,
    cached_token_cost: CachedTokenCost,
    buckets: Mutex<HashMap<(Owner, LimitKind), Bucket>>,
    metrics: Arc<RouterMetrics>,
}

/// A slack for float rounding: a bucket refilled to exactly what it needs has room.
const EPSILON: f64 = 1e-9;

impl TenantLimits {
    /// The limits of `path`, read now (errors name the file and line).
    pub fn from_file(
        path: &Path,
        cached_token_cost: CachedTokenCost,
        metrics: Arc<RouterMetrics>,
    ) -> Result<Self, LimitsError> {
        let file = Watched::<LimitsTable>::load(path)?;
        tracing::info!(path = %path.display(), subjects = file.current().len(),
            %cached_token_cost, "tenant limits loaded");
        Ok(Self {
            file: Arc::new(file),
            cached_token_cost,
            buckets: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// Whether the file in use has `key:` lines (they match nothing without API keys).
    pub fn has_key_lines(&self) -> bool {
        self.file.current().has_key_lines()
    }

    /// Reads the file again when it changes, until the task is dropped.
    pub fn spawn_reload(&self, tasks: &mut tokio::task::JoinSet<()>) {
        self.file.spawn_reload(self.metrics.clone(), tasks);
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, HashMap<(Owner, LimitKind), Bucket>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The limits of `owner` in `table`.
    fn limits_of<'t>(table: &'t LimitsTable, owner: &Owner) -> Option<&'t Limits> {
        match owner {
            Owner::Tenant(t) => table.tenant(t),
            Owner::Key(p) => table.key_line(p),
        }
    }

    /// Checks a request of `tenant` (with `key`, when keys are on) against its buckets: its
    /// [`Account`] (`None` when nothing limits it), or the refusal (counted here).
    pub fn admit(
        self: &Arc<Self>,
        tenant: &Tenant,
        key: Option<&KeyId>,
    ) -> Result<Option<Account>, LimitRefusal> {
        let table = self.file.current();
        let mut owners: Vec<(Owner, Limits)> = Vec::with_capacity(2);
        if let Some(limits) = table.tenant(tenant) {
            owners.push((Owner::Tenant(tenant.clone()), *limits));
        }
        if let Some((prefix, limits)) = key.and_then(|k| table.key(k)) {
            owners.push((Owner::Key(prefix.clone()), *limits));
        }
        if owners.is_empty() {
            return Ok(None);
        }
        let now = Instant::now();
        let refusal = {
            let mut buckets = self.buckets();
            let mut worst: Option<LimitRefusal> = None;
            for (owner, limits) in &owners {
                for kind in LimitKind::ALL {
                    let Some(rate) = limits.get(kind) else {
                        continue;
                    };
                    let bucket = (buckets.entry((owner.clone(), kind)))
                        .or_insert_with(|| Bucket::full(rate, now));
                    bucket.refill(rate, now);
                    let need = if kind == LimitKind::Requests {
                        1.0
                    } else {
                        0.0
                    };
                    let wait = bucket.wait_for(rate, need - EPSILON);
                    if wait > Duration::ZERO && worst.as_ref().is_none_or(|w| wait > w.wait) {
                        let who = match owner {
                            Owner::Tenant(t) => Whose::Tenant(t.clone()),
                            Owner::Key(_) => Whose::ApiKey,
                        };
                        worst = Some(LimitRefusal {
                            who,
                            kind,
                            rate,
                            wait,
                        });
                    }
                }
            }
            if worst.is_none() {
                for (owner, limits) in &owners {
                    if limits.get(LimitKind::Requests).is_some()
                        && let Some(bucket) = buckets.get_mut(&(owner.clone(), LimitKind::Requests))
                    {
                        bucket.take(1.0);
                    }
                }
            }
            worst
        };
        if let Some(refusal) = refusal {
            tracing::debug!(%tenant, reason = refusal.kind.as_str(), "request over its limits");
            self.metrics.tenant_limited(tenant, refusal.kind);
            return Err(refusal);
        }
        Ok(Some(Account {
            limits: self.clone(),
            owners: owners.into_iter().map(|(o, _)| o).collect(),
        }))
    }

    /// Takes `amount` of `kind` from each of `owners`' buckets that the file in use limits.
    fn charge(&self, owners: &[Owner], kind: LimitKind, amount: f64) {
        if amount.is_nan() || amount <= 0.0 {
            return;
        }
        let table = self.file.current();
        let now = Instant::now();
        let mut buckets = self.buckets();
        for owner in owners {
            let Some(rate) = Self::limits_of(&table, owner).and_then(|l| l.get(kind)) else {
                continue;
            };
            let bucket =
                (buckets.entry((owner.clone(), kind))).or_insert_with(|| Bucket::full(rate, now));
            bucket.refill(rate, now);
            bucket.take(amount);
        }
    }

    /// The level of `tenant`'s `kind` bucket now (None: it has none yet).
    #[cfg(test)]
    pub fn tenant_level(&self, tenant: &Tenant, kind: LimitKind) -> Option<f64> {
        let table = self.file.current();
        let rate = table.tenant(tenant)?.get(kind)?;
        let mut buckets = self.buckets();
        let bucket = buckets.get_mut(&(Owner::Tenant(tenant.clone()), kind))?;
        bucket.refill(rate, Instant::now());
        Some(bucket.level())
    }
}

/// What an admitted request is charged to: its buckets. In the request's extensions from the
/// limit check to the metered service, which charges it as the request's chunks go out.
#[derive(Debug, Clone)]
pub struct Account {
    limits: Arc<TenantLimits>,
    owners: Vec<Owner>,
}

impl Account {
    /// `n` tokens were generated (sent to the client).
    pub fn generated(&self, n: u64) {
        (self.limits).charge(&self.owners, LimitKind::GenerationTokens, n as f64);
    }

    /// The request's prompt, by the usage its client is told.
    pub fn prompt(&self, usage: &pb::Usage) {
        let cost =
            (self.limits.cached_token_cost).prompt_cost(usage.prompt_tokens, usage.cached_tokens);
        (self.limits).charge(&self.owners, LimitKind::PromptTokens, cost);
    }

    /// A prompt of `prompt_tokens` whose usage never came (its client went away first),
    /// charged as if all of it was computed.
    pub fn prompt_computed(&self, prompt_tokens: u32) {
        let cost = f64::from(prompt_tokens);
        (self.limits).charge(&self.owners, LimitKind::PromptTokens, cost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(text: &str) -> (Arc<TenantLimits>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limits");
        std::fs::write(&path, text).unwrap();
        let metrics = Arc::new(RouterMetrics::new("m", None).unwrap());
        let limits = TenantLimits::from_file(&path, CachedTokenCost::DEFAULT, metrics).unwrap();
        (Arc::new(limits), dir)
    }

    fn usage(prompt: u32, cached: u32) -> pb::Usage {
        pb::Usage {
            prompt_tokens: prompt,
            cached_tokens: cached,
            ..Default::default()
        }
    }

    #[test]
    fn cached_token_costs() {
        assert_eq!(CachedTokenCost::default().get(), 0.1);
        assert_eq!("0".parse::<CachedTokenCost>().unwrap().get(), 0.0);
        assert_eq!(" 1 ".parse::<CachedTokenCost>().unwrap().get(), 1.0);
        for bad in ["-0.1", "1.01", "NaN", "inf", "x", ""] {
            assert!(bad.parse::<CachedTokenCost>().is_err(), "{bad}");
        }
        let half = CachedTokenCost::new(0.5).unwrap();
        assert_eq!(half.prompt_cost(100, 80), 20.0 + 40.0);
        assert_eq!(half.prompt_cost(100, 0), 100.0);
        assert_eq!(
            half.prompt_cost(10, 50),
            5.0,
            "cached never above the prompt"
        );
    }

    #[test]
    fn computed_tokens_cost_more_than_cached_ones() {
        let (l, _dir) =
            limits("default prompt_tokens_per_second=0.001 prompt_tokens_per_second_burst=100\n");
        let (a, b) = (Tenant::new("a").unwrap(), Tenant::new("b").unwrap());
        // a computes 100 tokens: its bucket is empty, and the next 1 puts it in debt.
        let account = l.admit(&a, None).unwrap().unwrap();
        account.prompt(&usage(100, 0));
        let account = l.admit(&a, None).unwrap().unwrap();
        account.prompt(&usage(1, 0));
        let refused = l.admit(&a, None).unwrap_err();
        assert_eq!(refused.kind, LimitKind::PromptTokens);
        assert!(refused.retry_after_secs() >= 1);
        assert!(refused.to_string().contains("tenant `a`"), "{refused}");
        // b sends the same prompts with 96 of each 100 tokens cached: 4 + 9.6 a request.
        for _ in 0..7 {
            let account = l.admit(&b, None).unwrap().unwrap();
            account.prompt(&usage(100, 96));
        }
        assert!(l.tenant_level(&b, LimitKind::PromptTokens).unwrap() > 0.0);
    }

    #[test]
    fn requests_per_second_and_key_buckets() {
        let key = KeyId::of("some-key");
        let text = format!(
            "acme requests_per_second=0.001 requests_per_second_burst=3\n\
             key:{} requests_per_second=0.001 requests_per_second_burst=1\n",
            &key.hex()[..12]
        );
        let (l, _dir) = limits(&text);
        let acme = Tenant::new("acme").unwrap();
        // Nothing limits another tenant (no default line).
        assert!(
            l.admit(&Tenant::new("other").unwrap(), None)
                .unwrap()
                .is_none()
        );
        // The key's bucket holds one request, the tenant's three.
        assert!(l.admit(&acme, Some(&key)).is_ok());
        let refused = l.admit(&acme, Some(&key)).unwrap_err();
        assert_eq!(refused.kind, LimitKind::Requests);
        assert!(refused.to_string().contains("this API key"), "{refused}");
        assert!(l.admit(&acme, Some(&KeyId::of("other-key"))).is_ok());
        assert!(l.admit(&acme, None).is_ok());
        let refused = l.admit(&acme, None).unwrap_err();
        assert_eq!(refused.kind, LimitKind::Requests);
        // ~1000 s until one request's room.
        assert!(
            refused.retry_after_secs() > 900,
            "{}",
            refused.retry_after_secs()
        );
    }

    #[test]
    fn generated_tokens_put_a_tenant_in_debt() {
        let (l, _dir) = limits(
            "default generation_tokens_per_second=0.001 generation_tokens_per_second_burst=10\n",
        );
        let t = Tenant::default();
        let account = l.admit(&t, None).unwrap().unwrap();
        // Admitted while not in debt, whatever it then uses.
        assert!(l.admit(&t, None).is_ok());
        account.generated(8);
        account.generated(8);
        assert!(l.tenant_level(&t, LimitKind::GenerationTokens).unwrap() < 0.0);
        let refused = l.admit(&t, None).unwrap_err();
        assert_eq!(refused.kind, LimitKind::GenerationTokens);
    }
}
