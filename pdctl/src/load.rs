//! Resolving `--model`, loading it with progress bars on a terminal, and starting an engine
//! on the `--device` it asks for.

use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pd_engine::backend::Backend;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::cli::{Device, EngineArgs};
use pd_engine::kv::KvLayout;
use pd_engine::model::{ModelFiles, ModelSource, Qwen3};
use pd_engine::serve::{EngineThread, Role};

fn bar(message: &'static str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
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

/// The model's directory and metadata (materialising a synthetic model if needed).
pub fn open(model: &str) -> anyhow::Result<ModelFiles> {
    let source = ModelSource::parse(model)?;
    let progress = bar("writing synthetic");
    let dir = source.resolve(&|done, total| {
        progress.set_length(total as u64);
        progress.set_position(done as u64);
    });
    progress.finish_and_clear();
    let dir = dir?;
    ModelFiles::open(&dir).with_context(|| format!("loading model {model}"))
}

/// Map the weights onto the CPU backend.
pub fn weights(files: &ModelFiles) -> anyhow::Result<Qwen3<CpuBackend>> {
    weights_on(files, &CpuBackend::new())
}

/// Load the weights onto `backend`.
fn weights_on<B: Backend>(files: &ModelFiles, backend: &B) -> anyhow::Result<Qwen3<B>> {
    let progress = bar("loading weights");
    let model = files.load_weights(backend, &mut |done, total| {
        progress.set_length(total as u64);
        progress.set_position(done as u64);
    });
    progress.finish_and_clear();
    model.with_context(|| format!("loading the weights onto {}", backend.name()))
}

/// Start an engine of `role` for `files` on `args.device` (its weights loaded there, its KV
/// cache sized for it).
pub fn start_engine(
    files: &ModelFiles,
    args: &EngineArgs,
    role: Role,
    seed: u64,
    lease_timeout: Duration,
) -> anyhow::Result<EngineThread> {
    match args.device {
        Device::Cpu => start_on(args.cpu_backend()?, files, args, role, seed, lease_timeout),
        Device::Cuda { ordinal } => {
            let backend = pd_kernels::CudaBackend::open_with(
                ordinal,
                args.gpu_memory_utilization,
                args.kv_cache_dtype.on_device(),
            )?;
            start_on(backend, files, args, role, seed, lease_timeout)
        }
    }
}

fn start_on<B: Backend>(
    backend: B,
    files: &ModelFiles,
    args: &EngineArgs,
    role: Role,
    seed: u64,
    lease_timeout: Duration,
) -> anyhow::Result<EngineThread> {
    let model = weights_on(files, &backend)?;
    let max_model_len = args.max_model_len(&files.config)?;
    let layout = KvLayout::new(&files.config, args.block_size, backend.kv_dtype())?;
    let num_blocks = args.num_blocks_on(&backend, &files.config, &layout, max_model_len)?;
    let engine = args.build_on(files, backend, model, num_blocks, role, seed, lease_timeout)?;
    Ok(EngineThread::spawn(engine))
}
