//! Serving: `pd.v1.Generation`, `grpc.health.v1.Health` and server reflection on one listener
//! (the gRPC server every part shares, `pd_tls::GrpcServer`), `/metrics` on another and the
//! OpenAI-compatible HTTP API on a third (both optional), health checks of the nodes in the
//! background, graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pd_proto::pb::generation_server::GenerationServer;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::{Code, Status};
use tonic_health::ServingStatus;

use crate::admission::{Admission, Admitted};
use crate::auth::Auth;
use crate::choices::ChoicesGeneration;
use crate::config::RouterConfig;
use crate::discovery;
use crate::error::RouterError;
use crate::limits::TenantLimits;
use crate::metrics::{self, MeteredGeneration, RouterMetrics};
use crate::openai;
use crate::policy;
use crate::registry::{DnsRoles, Registry};
use crate::service::{GenerationService, IdGen, InflightTable, Shared};
use crate::tenant::Tenancy;
use crate::validation::{ModelMeta, Validator};

/// The health service names the router reports: the whole server (`""`) and the API.
const HEALTH_SERVICES: [&str; 2] = ["", GENERATION];

/// The full gRPC name of the router's API.
const GENERATION: &str = pd_proto::pb::generation_server::SERVICE_NAME;

/// A router ready to serve: model metadata loaded, nodes registered (not yet checked).
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    shared: Arc<Shared>,
    tls: RouterTls,
}

/// The TLS of the router's listeners (`None`: plaintext), loaded from `config.tls` at start.
#[derive(Debug, Clone, Default)]
struct RouterTls {
    /// The gRPC API (ALPN `h2`).
    grpc: Option<pd_tls::ServerTls>,
    /// The HTTP API and `/metrics` (ALPN `http/1.1`).
    http: Option<pd_tls::ServerTls>,
}

impl RouterTls {
    fn load(settings: &pd_tls::TlsSettings) -> Result<Self, RouterError> {
        Ok(Self {
            grpc: pd_tls::ServerTls::new(settings, pd_tls::Alpn::Grpc)?,
            http: pd_tls::ServerTls::new(settings, pd_tls::Alpn::Http1)?,
        })
    }
}

fn listener_error(e: std::io::Error) -> RouterError {
    RouterError::Internal(format!("starting a listener: {e}"))
}

/// The TLS of the channels to the nodes (`--tls-ca`), `None`: plaintext.
fn node_tls(settings: &pd_tls::TlsSettings) -> Result<Option<pd_tls::ClientTls>, RouterError> {
    Ok(pd_tls::ClientTls::new(settings, pd_tls::Alpn::Grpc)?)
}

impl Router {
    /// Loads the model's metadata (config and tokenizer, no weights) and registers the nodes.
    /// Blocking (the tokenizer takes a moment to parse), and needs a Tokio runtime context
    /// (node channels start their connection tasks): call it inside `spawn_blocking`, or
    /// with the runtime entered.
    pub fn new(config: RouterConfig) -> Result<Self, RouterError> {
        let model =
            Arc::new(
                ModelMeta::load(&config.model).map_err(|source| RouterError::Model {
                    model: config.model.clone(),
                    source,
                })?,
            );
        let metrics = Arc::new(
            RouterMetrics::new(&model.name, config.report_faults)
                .map_err(|e| RouterError::Internal(e.to_string()))?,
        );
        if let Some(faults) = &config.report_faults {
            tracing::warn!(
                ?faults,
                "TEST-ONLY counter report faults are on ({})",
                metrics::faults::ENV
            );
        }
        let dns = DnsRoles {
            prefill: !config.prefill_dns.is_empty(),
            decode: !config.decode_dns.is_empty(),
        };
        let tls = RouterTls::load(&config.tls)?;
        let registry = Arc::new(
            Registry::new(
                &config.prefill,
                &config.decode,
                dns,
                model.name.clone(),
                metrics.clone(),
                node_tls(&config.tls)?,
            )?
            .with_hash_algo(config.prefix_caching_hash_algo)
            .with_breaker(config.breaker)
            .with_cache_index_blocks(config.cache_index_blocks)
            .with_cache_events(config.cache_events == crate::config::CacheEventsMode::On),
        );
        let cache_index = registry.cache_index().clone();
        let auth = match &config.api_keys {
            Some(path) => Auth::from_file(path)?,
            None => Auth::open(),
        };
        metrics.add_tenants(&auth.tenants());
        metrics.add_disagg_mode(config.disagg);
        let limits = match &config.tenant_limits {
            Some(path) => Some(Arc::new(TenantLimits::from_file(
                path,
                config.cached_token_cost,
                metrics.clone(),
            )?)),
            None => None,
        };
        if !auth.is_on() && limits.as_ref().is_some_and(|l| l.has_key_lines()) {
            tracing::warn!(
                "the tenant limits file has key: lines, but without --api-keys no request \
                 has a key: they limit nothing"
            );
        }
        let tenancy = Tenancy {
            keys: auth.is_on(),
            shared_prefix_cache: config.shared_prefix_cache,
        };
        let shared = Arc::new(Shared {
            admission: Arc::new(
                Admission::new(config.admission, metrics.clone()).with_limits(limits.clone()),
            ),
            limits,
            auth,
            tenancy,
            validator: Validator::new(model.clone(), config.max_tokens_cap),
            model,
            registry,
            metrics,
            policy: policy::build(
                config.policy,
                config.prefix_index_blocks,
                config.prefix_caching_hash_algo,
                cache_index.clone(),
            ),
            decode_policy: policy::build_decode(
                config.policy,
                config.prefix_caching_hash_algo,
                cache_index,
            ),
            hash_algo: config.prefix_caching_hash_algo,
            disagg: crate::disagg::Disagg::new(config.disagg),
            inflight: Arc::new(InflightTable::default()),
            ids: IdGen::new(),
            node_timeout: config.node_timeout,
            request_timeout: config.request_timeout,
            retries: crate::retry::Retries::new(config.retry, std::time::Instant::now()),
            migration_limit: config.migration_limit,
        });
        Ok(Self {
            config,
            shared,
            tls,
        })
    }

    /// `--check-config`: validates `config` as [`Router::new`] would, without serving.
    /// A model directory missing on this machine is a note (it exists where the router
    /// runs), not a failure; so is every other thing only the serving host can know.
    /// Needs a Tokio runtime context, like `new`.
    pub fn check_config(config: &RouterConfig) -> Result<Vec<String>, RouterError> {
        let mut notes = Vec::new();
        let missing_dir = !config.model.starts_with("synthetic:")
            && !std::path::Path::new(&config.model).exists();
        let name = if missing_dir {
            notes.push(format!(
                "model directory {} is not on this machine; it is read at start",
                config.model
            ));
            config.model.clone()
        } else {
            ModelMeta::load(&config.model)
                .map_err(|source| RouterError::Model {
                    model: config.model.clone(),
                    source,
                })?
                .name
                .clone()
        };
        let metrics = Arc::new(
            RouterMetrics::new(&name, config.report_faults)
                .map_err(|e| RouterError::Internal(e.to_string()))?,
        );
        let dns = DnsRoles {
            prefill: !config.prefill_dns.is_empty(),
            decode: !config.decode_dns.is_empty(),
        };
        // TLS files are read and checked as at start where they are on this machine.
        let tls = &config.tls;
        let files = tls.identity.iter().flat_map(|i| [&i.cert, &i.key]);
        let missing: Vec<String> = files
            .chain(&tls.client_ca)
            .chain(&tls.ca)
            .filter(|p| !p.exists())
            .map(|p| p.display().to_string())
            .collect();
        let client = if missing.is_empty() {
            RouterTls::load(tls)?;
            node_tls(tls)?
        } else {
            notes.push(format!(
                "TLS files {} are not on this machine; they are read at start",
                missing.join(", ")
            ));
            None
        };
        Registry::new(&config.prefill, &config.decode, dns, name, metrics, client)?;
        if let Some(path) = &config.api_keys {
            Auth::from_file(path)?;
        }
        if let Some(path) = &config.tenant_limits {
            if path.exists() {
                crate::limits::LimitsTable::load(path)?;
            } else {
                notes.push(format!(
                    "tenant limits file {} is not on this machine; it is read at start",
                    path.display()
                ));
            }
        }
        Ok(notes)
    }

    /// The served model's name.
    pub fn model_name(&self) -> &str {
        &self.shared.model.name
    }

    /// The node registry (health, load, layouts), e.g. for status displays and tests.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.shared.registry
    }

    /// The router's metrics (what `/metrics` exports).
    pub fn metrics(&self) -> &Arc<RouterMetrics> {
        &self.shared.metrics
    }

    /// Serves on `listener` until `shutdown` completes, then stops accepting requests,
    /// reports NOT_SERVING, lets the requests in flight finish and returns.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), RouterError> {
        self.serve_with_http(listener, None, None, shutdown).await
    }

    /// [`Router::serve`], and `GET /metrics` on `metrics_listener` (until the router stops)
    /// and the OpenAI-compatible HTTP API on `http_listener` (drained with the gRPC API),
    /// when given.
    pub async fn serve_with_http(
        self,
        listener: TcpListener,
        metrics_listener: Option<TcpListener>,
        http_listener: Option<TcpListener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), RouterError> {
        let Router {
            config,
            shared,
            tls,
        } = self;
        let registry = shared.registry.clone();
        let mut background = JoinSet::new();
        if let Some(listener) = metrics_listener {
            // Monitoring is no cluster member: TLS when configured, no client certificate.
            let listener =
                pd_tls::Listener::new(listener, tls.http.clone()).map_err(listener_error)?;
            let (metrics, registry) = (shared.metrics.clone(), registry.clone());
            background.spawn(async move {
                if let Err(e) = metrics::serve_http(listener, metrics, registry).await {
                    tracing::error!(error = %e, "the /metrics server stopped");
                }
            });
        }
        shared
            .auth
            .spawn_reload(shared.metrics.clone(), &mut background);
        if let Some(limits) = &shared.limits {
            limits.spawn_reload(&mut background);
        }
        registry.spawn_health_checks(
            config.health_interval,
            config.health_timeout,
            &mut background,
        );
        for target in config.prefill_dns.iter().chain(&config.decode_dns) {
            background.spawn(discovery::follow(
                registry.clone(),
                target.clone(),
                discovery::SystemResolver,
                config.dns_interval,
                config.health_interval,
                config.health_timeout,
            ));
        }

        let metered = MeteredGeneration::new(
            GenerationService::new(shared.clone()),
            shared.metrics.clone(),
        );
        // With --api-keys every call needs a key; the interceptor puts its tenant in the
        // request's extensions (without keys: nothing checked, no tenant, `default`).
        let generation = OversizeIsResourceExhausted(
            shared.auth.grpc(Admitted::new(
                GenerationServer::new(ChoicesGeneration::new(metered.clone()))
                    .max_decoding_message_size(config.max_message_bytes),
                shared.admission.clone(),
            )),
        );
        // With --tls-client-ca: UNAUTHENTICATED to callers without a client certificate the
        // CA signed (health stays open).
        let (grpc, reporter) = pd_tls::GrpcServer::new(
            Routes::new(generation),
            pd_tls::Api {
                service: GENERATION,
                descriptor_set: pd_proto::FILE_DESCRIPTOR_SET,
            },
            config.grpc_limits,
            config.tls.requires_client_certs(),
        )
        .map_err(|e| RouterError::Internal(e.to_string()))?;
        for name in HEALTH_SERVICES {
            reporter
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
        let mut serving = registry.serving();
        let (stop_health, mut health_stopped) = tokio::sync::watch::channel(false);
        {
            let reporter = reporter.clone();
            background.spawn(async move {
                loop {
                    let up = *serving.borrow_and_update();
                    let status = if up {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    for name in HEALTH_SERVICES {
                        reporter.set_service_status(name, status).await;
                    }
                    tracing::info!(serving = up, "router health");
                    tokio::select! {
                        changed = serving.changed() => if changed.is_err() { return },
                        _ = health_stopped.wait_for(|s| *s) => return,
                    }
                }
            });
        }

        // The HTTP API stops taking requests with the gRPC API and drains on its own.
        let (stop_http, http_stopped) = tokio::sync::watch::channel(false);
        // With --tls-client-ca the HTTP API closes connections without a client certificate
        // the CA signed (HTTP has no UNAUTHENTICATED of its own to answer them with).
        let http_listener = http_listener
            .map(|l| pd_tls::Listener::cluster_only(l, tls.http.clone()))
            .transpose()
            .map_err(listener_error)?;
        let http = http_listener.map(|listener| {
            let api = openai::Api::new(
                metered.clone(),
                shared.clone(),
                config.reasoning_parser,
                config.tool_call_parser,
            );
            let mut stopped = http_stopped.clone();
            let max_body = config.max_message_bytes;
            let limits = config.http_limits;
            tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                if let Err(e) = openai::serve(listener, api, max_body, limits, shutdown).await {
                    tracing::error!(error = %e, "the HTTP API server stopped");
                }
            })
        });
        let addr = listener.local_addr().ok();
        tracing::info!(?addr, model = %shared.model.name, policy = shared.policy.name(),
            api_keys = shared.auth.is_on(), shared_prefix_cache = shared.tenancy.shared_prefix_cache,
            prefill = ?config.prefill, decode = ?config.decode, "router serving");
        let drain = async move {
            shutdown.await;
            tracing::info!("shutting down: draining requests in flight");
            let _ = stop_health.send(true);
            let _ = stop_http.send(true);
            for name in HEALTH_SERVICES {
                reporter
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        };
        // The listener sets TCP_NODELAY on each accepted connection, or small stream messages
        // wait for delayed ACKs (~40 ms); TLS handshakes run off its accept loop.
        let incoming = pd_tls::Listener::new(listener, tls.grpc.clone()).map_err(listener_error)?;
        let result = grpc.serve(incoming, drain).await;
        if let Some(http) = http {
            let _ = http.await;
        }
        background.shutdown().await;
        tracing::info!(in_flight = shared.inflight.len(), "router stopped");
        result.map_err(RouterError::from)
    }
}

/// Loads `config`'s model metadata, then serves on `listener` until `shutdown` completes
/// (see [`Router::serve`]).
pub async fn serve(
    config: RouterConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let router = tokio::task::spawn_blocking(move || Router::new(config))
        .await
        .map_err(|e| RouterError::Internal(format!("loading the router panicked: {e}")))??;
    router.serve(listener, shutdown).await
}

/// tonic refuses a request message above the size limit with OUT_OF_RANGE; gRPC's own
/// implementations (and this project's error rules) say RESOURCE_EXHAUSTED. This wrapper
/// rewrites exactly that status, with the limit in the message.
#[derive(Debug, Clone)]
struct OversizeIsResourceExhausted<S>(S);

impl<S: NamedService> NamedService for OversizeIsResourceExhausted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<Body>> for OversizeIsResourceExhausted<S>
where
    S: tonic::codegen::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let response = self.0.call(request);
        Box::pin(async move {
            let response = response.await?;
            let oversized = Status::from_header_map(response.headers()).filter(|s| {
                s.code() == Code::OutOfRange && s.message().contains("message length too large")
            });
            Ok(match oversized {
                Some(status) => Status::resource_exhausted(format!(
                    "the request message is too large ({}); the router's --max-message-bytes \
                     sets the limit",
                    status.message().trim_start_matches("Error, ")
                ))
                .into_http(),
                None => response,
            })
        })
    }
}
