//! Resolving `--model` and loading it with progress bars on a terminal.

use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::model::{ModelFiles, ModelSource, Qwen3};

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
    let progress = bar("loading weights");
    let model = files.load_weights(&CpuBackend::new(), &mut |done, total| {
        progress.set_length(total as u64);
        progress.set_position(done as u64);
    });
    progress.finish_and_clear();
    Ok(model?)
}
