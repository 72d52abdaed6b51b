//! Loading `--model` (with progress bars on a terminal) and starting the engine of a role,
//! plus the facts about the loaded model every node reports (layout, fingerprint, limits).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pd_engine::backend::Backend;
use pd_engine::backend::cpu::{CpuBackend, CpuFeatures, isa};
use pd_engine::cli::Device;
use pd_engine::kv::KvLayout;
use pd_engine::model::{ModelFiles, ModelSource, Qwen3};
use pd_engine::sampling::GuideCache;
use pd_engine::serve::{EngineThread, Role};
use pd_engine::synthetic;
use pd_engine::weights::DType;
use pd_transport::LayoutFingerprint;

use crate::args::NodeArgs;
use crate::metrics::RequestHistograms;

fn bar(message: &'static str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>18} [{bar:30}] {binary_bytes}/{binary_total_bytes} ({eta})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(message);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// A loaded model: its metadata and weights on the CPU backend.
pub struct LoadedModel {
    /// The name it is served under (`synthetic:tiny`, or the directory's name).
    pub served_name: String,
    pub files: ModelFiles,
    pub weights: Qwen3<CpuBackend>,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("served_name", &self.served_name)
            .field("dir", &self.files.dir)
            .finish_non_exhaustive()
    }
}

/// Resolve `model` (materialising a synthetic model under `synthetic_cache_dir`, or the
/// default cache directory) and load its weights, with progress bars on a terminal.
/// Blocking.
pub fn load_model(model: &str, synthetic_cache_dir: Option<&Path>) -> anyhow::Result<LoadedModel> {
    let (served_name, files) = open_model(model, synthetic_cache_dir)?;
    let weights = load_weights(&files, &CpuBackend::new(), model)?;
    Ok(LoadedModel {
        served_name,
        files,
        weights,
    })
}

/// Resolve `model` (materialising a synthetic model if needed) and open its metadata:
/// the name it is served under and its files. Blocking.
pub fn open_model(
    model: &str,
    synthetic_cache_dir: Option<&Path>,
) -> anyhow::Result<(String, ModelFiles)> {
    let source = ModelSource::parse(model)?;
    let progress = bar("writing synthetic");
    let report = |done: usize, total: usize| {
        progress.set_length(total as u64);
        progress.set_position(done as u64);
    };
    let dir = match (&source, synthetic_cache_dir) {
        (ModelSource::Synthetic { preset, seed }, Some(cache)) => {
            synthetic::materialize(*preset, *seed, cache, &report)
        }
        _ => source.resolve(&report),
    };
    progress.finish_and_clear();
    let dir = dir.with_context(|| format!("resolving model {model}"))?;
    let files = ModelFiles::open(&dir).with_context(|| format!("loading model {model}"))?;
    Ok((source.served_name(), files))
}

/// Load the weights of `files` onto `backend`, with a progress bar on a terminal.
pub fn load_weights<B: Backend>(
    files: &ModelFiles,
    backend: &B,
    model: &str,
) -> anyhow::Result<Qwen3<B>> {
    let progress = bar("loading weights");
    let weights = files.load_weights(backend, &mut |done, total| {
        progress.set_length(total as u64);
        progress.set_position(done as u64);
    });
    progress.finish_and_clear();
    weights.with_context(|| format!("loading the weights of {model} onto {}", backend.name()))
}

/// What a node serves, as it reports it (Info, the ready line, KV handles).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFacts {
    pub served_name: String,
    pub layout: KvLayout,
    /// Model identity (served name and dtype) plus KV layout; KV moves only between equal
    /// fingerprints.
    pub fingerprint: LayoutFingerprint,
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub num_blocks: usize,
    /// Whether the prefix cache is on.
    pub prefix_caching: bool,
    /// Blocks of the prefix cache's host-memory tier (`--host-cache-blocks`).
    pub host_cache_blocks: usize,
    /// The prefix cache's block hash (`--prefix-caching-hash-algo`), reported in `Info`.
    pub hash_algo: pd_engine::kv::prefix::hash::HashAlgo,
}

impl ModelFacts {
    /// The facts of `files` served as `served_name` with `num_blocks` KV blocks of `layout`
    /// (from [`pd_engine::cli::EngineArgs::num_blocks_on`]; the layout carries the cache's
    /// resolved type).
    pub fn new(
        args: &NodeArgs,
        served_name: &str,
        files: &ModelFiles,
        layout: KvLayout,
        num_blocks: usize,
    ) -> anyhow::Result<Self> {
        let max_model_len = args.engine.max_model_len(&files.config)?;
        Ok(Self {
            served_name: served_name.to_string(),
            fingerprint: fingerprint(&layout, served_name, files),
            vocab_size: files.config.vocab_size,
            max_model_len,
            num_blocks,
            layout,
            prefix_caching: !args.engine.no_enable_prefix_caching,
            host_cache_blocks: args.engine.host_cache_blocks,
            hash_algo: args.engine.prefix_caching_hash_algo,
        })
    }

    pub fn block_size(&self) -> usize {
        self.layout.block_size
    }

    /// Bytes per KV block (all layers, K and V, as stored: what one block moves).
    pub fn block_bytes(&self) -> usize {
        self.layout.block_bytes()
    }

    /// How the KV cache is stored (`--kv-cache-dtype`, `auto` resolved).
    pub fn kv_dtype(&self) -> DType {
        self.layout.dtype
    }
}

/// The layout fingerprint of `layout` filled by the model served as `served_name`: the
/// identity is `"<served name>|<config dtype>"`, the same on every node serving that model.
pub fn fingerprint(layout: &KvLayout, served_name: &str, files: &ModelFiles) -> LayoutFingerprint {
    let identity = format!("{served_name}|{}", files.config.dtype.torch_name());
    LayoutFingerprint::new(layout, &identity)
}

/// A node's engine, running.
#[derive(Debug)]
pub struct StartedEngine {
    pub facts: ModelFacts,
    pub thread: EngineThread,
    /// The histograms the engine thread feeds with every request's end and every step.
    pub histograms: Arc<RequestHistograms>,
    /// Structured outputs compiled over the model's vocabulary (`crate::guide`).
    pub guides: Arc<GuideCache>,
}

/// Load the model onto `backend`, size its KV cache and start its engine thread.
fn start_on<B: Backend>(
    backend: B,
    args: &NodeArgs,
    role: Role,
    lease_timeout: Duration,
) -> anyhow::Result<StartedEngine> {
    let (served_name, files) = open_model(&args.model, args.synthetic_cache_dir.as_deref())?;
    let weights = load_weights(&files, &backend, &args.model)?;
    let max_model_len = args.engine.max_model_len(&files.config)?;
    let layout = KvLayout::new(&files.config, args.engine.block_size, backend.kv_dtype())?;
    let num_blocks = args
        .engine
        .num_blocks_on(&backend, &files.config, &layout, max_model_len)?;
    let facts = ModelFacts::new(args, &served_name, &files, layout, num_blocks)?;
    let engine = args
        .engine
        .build_on(
            &files,
            backend,
            weights,
            num_blocks,
            role,
            args.seed,
            lease_timeout,
        )
        .context("building the engine")?;
    let histograms = Arc::new(RequestHistograms::new(max_model_len));
    let (finished, step) = histograms.observers();
    let guides = Arc::new(GuideCache::new(
        files.tokenizer.clone(),
        files.eos_token_ids(),
    ));
    Ok(StartedEngine {
        facts,
        thread: EngineThread::spawn_observed(engine, finished, step),
        histograms,
        guides,
    })
}

/// Load the model and start an engine of `role` on its own thread (blocking work runs on
/// tokio's blocking pool). `lease_timeout` bounds how long a prefill lease pins its blocks.
pub async fn start_engine(
    args: &NodeArgs,
    role: Role,
    lease_timeout: Duration,
) -> anyhow::Result<StartedEngine> {
    let args = args.clone();
    tokio::task::spawn_blocking(move || {
        // The device is opened first: asking for one that cannot work fails before any
        // model is written or read.
        match args.engine.device {
            Device::Cpu => {
                let backend = args.engine.cpu_backend()?;
                tracing::info!(
                    isa = backend.isa().name(),
                    cpu_flags = CpuFeatures::host().names().join(" "),
                    "CPU kernels: {}",
                    isa::describe(backend.isa())
                );
                start_on(backend, &args, role, lease_timeout)
            }
            Device::Cuda { ordinal } => {
                let backend = pd_kernels::CudaBackend::open_with(
                    ordinal,
                    args.engine.gpu_memory_utilization,
                    args.engine.kv_cache_dtype.on_device(),
                )?;
                start_on(backend, &args, role, lease_timeout)
            }
        }
    })
    .await
    .context("the model loading task failed")?
}
