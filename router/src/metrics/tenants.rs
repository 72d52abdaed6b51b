//! Per-tenant usage: what a billing system needs, labelled `tenant`.
//!
//! - `pd_router_tenant_prompt_tokens_total{tenant,source}`: the prompt tokens of each finished
//!   request, split by `source` exactly as the request's `usage` split them for the client:
//!   `local_hit` = `local_cached_tokens`, `external_hit` = `external_cached_tokens` (the
//!   prefill node's hits: docs/accounting.md), `computed` = `prompt_tokens - cached_tokens`.
//! - `pd_router_tenant_generation_tokens_total{tenant}`: `completion_tokens`.
//! - `pd_router_tenant_requests_total{tenant,outcome}`: every generation request (each
//!   choice of `n`, each prompt of an HTTP request, as `pd_router_requests_total`) by how it
//!   ended.
//! - `pd_router_tenant_requests_rejected_total{tenant,reason}`: requests refused because the
//!   tenant (or its API key) was over a limit of `--tenant-limits` (`crate::limits`), by the
//!   bucket that refused.
//!
//! The token counters are raised from the very `usage` the client receives (its last chunk),
//! once per request, so over any set of requests they equal the sum of those requests'
//! `usage` fields. Over gRPC each choice of `n` has its own usage, prompt included; an HTTP
//! response's usage counts each prompt once, with its first choice (OpenAI's), so the later
//! choices of an HTTP prompt add their generated tokens only. A request that ends without usage (an error, a client gone before the
//! end) counts in `requests_total` only. Series of the tenants of the keys file exist from
//! the start (at 0); a tenant added to the file later appears with its first request.

use std::sync::Arc;

use pd_proto::pb;

use super::exporter::{CounterVec, Exporter};
use super::ids::{Family, LimitKind, Outcome, PromptSource, label};
use crate::tenant::Tenant;

/// The per-tenant families.
#[derive(Debug)]
pub(crate) struct TenantSeries {
    prompt_tokens: CounterVec,
    generation_tokens: CounterVec,
    requests: CounterVec,
    rejected: CounterVec,
}

impl TenantSeries {
    pub fn new(exporter: &Arc<Exporter>) -> Self {
        let counter = |family: Family, labels: &'static [&'static str]| {
            CounterVec::new(exporter, family, labels)
        };
        Self {
            prompt_tokens: counter(Family::TenantPromptTokens, &[label::TENANT, label::SOURCE]),
            generation_tokens: counter(Family::TenantGenerationTokens, &[label::TENANT]),
            requests: counter(Family::TenantRequests, &[label::TENANT, label::OUTCOME]),
            rejected: counter(
                Family::TenantRequestsRejected,
                &[label::TENANT, label::REASON],
            ),
        }
    }

    /// Makes `tenant`'s series exist, at 0 until its first request.
    pub fn add(&self, tenant: &Tenant) {
        let t = tenant.as_str();
        for source in PromptSource::ALL {
            self.prompt_tokens.create(&[t, source.as_str()]);
        }
        self.generation_tokens.create(&[t]);
        for outcome in Outcome::INITIAL {
            self.requests.create(&[t, outcome.as_str()]);
        }
        for kind in LimitKind::ALL {
            self.rejected.create(&[t, kind.as_str()]);
        }
    }

    /// A request of `tenant` was refused by its `kind` bucket.
    pub fn limited(&self, tenant: &Tenant, kind: LimitKind) {
        (self.rejected)
            .with_label_values(&[tenant.as_str(), kind.as_str()])
            .increment(1);
    }

    /// The `usage` a request of `tenant` ended with; its prompt tokens only if `prompt`.
    pub fn usage(&self, tenant: &Tenant, usage: &pb::Usage, prompt: bool) {
        let t = tenant.as_str();
        (self.generation_tokens.with_label_values(&[t]))
            .increment(u64::from(usage.completion_tokens));
        if !prompt {
            return;
        }
        let computed = usage.prompt_tokens.saturating_sub(usage.cached_tokens);
        for (source, n) in [
            (PromptSource::Computed, computed),
            (PromptSource::LocalHit, usage.local_cached_tokens),
            (PromptSource::ExternalHit, usage.external_cached_tokens),
        ] {
            (self.prompt_tokens.with_label_values(&[t, source.as_str()])).increment(u64::from(n));
        }
    }

    /// A request of `tenant` ended with `outcome`.
    pub fn ended(&self, tenant: &Tenant, outcome: Outcome) {
        (self
            .requests
            .with_label_values(&[tenant.as_str(), outcome.as_str()]))
        .increment(1);
    }
}
