//! Compile every kernel source of the CUDA backend with NVRTC, with the options the backend
//! uses at start-up, for each requested compute capability, and write the PTX to a
//! directory for `ptxas` (scripts/cuda-check.sh). Needs libnvrtc on the library path, no GPU.
//!
//! Usage: `nvrtc_check OUT_DIR [ARCH...]` with ARCH like `sm_90` (default: sm_80 sm_90).

use std::path::PathBuf;
use std::process::ExitCode;

use pd_kernels::cuda::modules::{self, ComputeCapability, SOURCES};

fn parse_arch(arch: &str) -> Option<ComputeCapability> {
    let digits = arch.strip_prefix("sm_")?;
    let (major, minor) = digits.split_at(digits.len().checked_sub(1)?);
    Some(ComputeCapability {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(out) = args.next().map(PathBuf::from) else {
        eprintln!("usage: nvrtc_check OUT_DIR [sm_80 sm_90 ...]");
        return ExitCode::FAILURE;
    };
    let mut archs: Vec<String> = args.collect();
    if archs.is_empty() {
        archs = vec!["sm_80".into(), "sm_90".into()];
    }
    if !modules::nvrtc_present() {
        eprintln!("libnvrtc could not be loaded: put CUDA 13's lib directory on LD_LIBRARY_PATH");
        return ExitCode::FAILURE;
    }
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("{}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    let mut failed = false;
    for arch in &archs {
        let Some(cc) = parse_arch(arch) else {
            eprintln!("`{arch}` is not an architecture like sm_90");
            return ExitCode::FAILURE;
        };
        for source in &SOURCES {
            match modules::compile(source, cc) {
                Ok(ptx) => {
                    let path = out.join(format!("{}.{}.ptx", source.name, cc.real_arch()));
                    let text = ptx.to_src();
                    for kernel in source.kernels {
                        if !text.contains(&format!(".entry {kernel}(")) {
                            eprintln!("{}: kernel {kernel} missing from the PTX", source.name);
                            failed = true;
                        }
                    }
                    if let Err(e) = std::fs::write(&path, text) {
                        eprintln!("{}: {e}", path.display());
                        return ExitCode::FAILURE;
                    }
                    println!(
                        "nvrtc ok   {:<12} {:<6} -> {}",
                        source.name,
                        arch,
                        path.display()
                    );
                }
                Err(e) => {
                    eprintln!("nvrtc FAIL {} {arch}: {e}", source.name);
                    failed = true;
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
