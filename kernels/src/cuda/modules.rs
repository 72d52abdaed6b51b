//! The CUDA C++ kernel sources and how they are compiled: the one list and the one set of
//! NVRTC options used both at start-up (for the device's compute capability) and by the CI
//! check (`examples/nvrtc_check.rs`, for sm_80 and sm_90, assembled with ptxas), so CI
//! compiles exactly what a GPU host will.

use std::sync::{Mutex, PoisonError};

use cudarc::nvrtc::{self, CompileOptions, Ptx};

use crate::CudaError;

/// Helpers every source starts with (prepended: NVRTC gets no include path).
const COMMON: &str = include_str!("common.cuh");

/// Headers a source may `#include "name"`: pasted in place of that line, since NVRTC gets no
/// include path (the emulator's C++ compiler finds them in this directory).
const HEADERS: [(&str, &str); 1] = [("sample.cuh", include_str!("sample.cuh"))];

/// One `.cu` file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    pub name: &'static str,
    pub code: &'static str,
    pub kernels: &'static [&'static str],
}

/// Every kernel source of the backend.
pub const SOURCES: [KernelSource; 10] = [
    KernelSource {
        name: "elementwise",
        code: include_str!("elementwise.cu"),
        kernels: &[
            "embedding",
            "rms_norm",
            "rope",
            "qk_norm_rope",
            "silu_mul",
            "rms_norm_16",
            "silu_mul_16",
            "add_assign",
            "add_rows_scaled",
            "select_rows",
            "cast_bf16",
            "cast_f16",
        ],
    },
    KernelSource {
        name: "kv",
        code: include_str!("kv.cu"),
        kernels: &["write_kv", "pack_blocks", "unpack_blocks"],
    },
    KernelSource {
        name: "attention",
        code: include_str!("attention.cu"),
        kernels: &["paged_attention"],
    },
    KernelSource {
        name: "attention_mma",
        code: include_str!("attention_mma.cu"),
        kernels: &["attention_mma"],
    },
    KernelSource {
        name: "reshape",
        code: include_str!("reshape.cu"),
        kernels: &["reshape_copy", "reshape_edit"],
    },
    KernelSource {
        name: "sample",
        code: include_str!("sample.cu"),
        kernels: &["sample_rows"],
    },
    KernelSource {
        name: "sample_dense",
        code: include_str!("sample_dense.cu"),
        kernels: &["sample_dense"],
    },
    KernelSource {
        name: "prompt",
        code: include_str!("prompt.cu"),
        kernels: &["prompt_logprobs"],
    },
    KernelSource {
        name: "gemv",
        code: include_str!("gemv.cu"),
        kernels: &["gemv16", "gemv16_norm", "gemv16_norm_silu"],
    },
    KernelSource {
        name: "moe",
        code: include_str!("moe.cu"),
        kernels: &[
            "moe_route",
            "moe_gate_up",
            "moe_down",
            "moe_topk",
            "moe_align",
            "moe_gather",
            "moe_silu",
            "moe_combine",
        ],
    },
];

/// A compute capability, e.g. 9.0 for Hopper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl ComputeCapability {
    /// `compute_90`: NVRTC emits PTX for this virtual architecture; the driver turns it into
    /// the device's machine code when the module loads.
    pub fn virtual_arch(self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }

    /// `sm_90`, as ptxas names the real architecture.
    pub fn real_arch(self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

impl KernelSource {
    /// The text NVRTC compiles: the common helpers, then the file with each header it
    /// includes pasted in (with `#line` so errors point into the file they are in).
    pub fn full_text(&self) -> String {
        let file = format!("{}.cu", self.name);
        let mut text = format!("{COMMON}\n#line 1 \"{file}\"\n");
        for (n, line) in self.code.lines().enumerate() {
            let header = line
                .strip_prefix("#include \"")
                .and_then(|rest| rest.strip_suffix('"'))
                .and_then(|name| HEADERS.iter().find(|(known, _)| *known == name));
            match header {
                Some((name, code)) => {
                    text.push_str(&format!("#line 1 \"{name}\"\n{code}\n"));
                    text.push_str(&format!("#line {} \"{file}\"\n", n + 2));
                }
                None => {
                    text.push_str(line);
                    text.push('\n');
                }
            }
        }
        text
    }
}

/// The NVRTC options of every compile. Precise division, square root and exp (no fast math)
/// so results stay close to the CPU reference backend.
pub fn compile_options(source: &KernelSource, cc: ComputeCapability) -> CompileOptions {
    CompileOptions {
        options: vec![
            format!("--gpu-architecture={}", cc.virtual_arch()),
            "--std=c++17".to_string(),
            "-lineinfo".to_string(),
        ],
        name: Some(format!("{}.cu", source.name)),
        ..Default::default()
    }
}

/// Compile `source` to PTX for `cc`. The caller checks that libnvrtc can be loaded first
/// (cudarc panics where it cannot).
///
/// Each (source, compute capability) is compiled once per process and its PTX kept: NVRTC
/// takes seconds for all the sources, and every backend opened on a device of that
/// capability (each test of a suite, each device a process opens) loads the same modules.
pub fn compile(source: &KernelSource, cc: ComputeCapability) -> Result<Ptx, CudaError> {
    static COMPILED: Mutex<Vec<(&str, ComputeCapability, Ptx)>> = Mutex::new(Vec::new());
    let cached = |compiled: &[(&str, ComputeCapability, Ptx)]| {
        compiled
            .iter()
            .find(|(name, arch, _)| *name == source.name && *arch == cc)
            .map(|(_, _, ptx)| ptx.clone())
    };
    if let Some(ptx) = cached(&COMPILED.lock().unwrap_or_else(PoisonError::into_inner)) {
        return Ok(ptx);
    }
    // Not under the lock: two threads may both compile a source the first time, and one
    // result is kept.
    let ptx = nvrtc::compile_ptx_with_opts(source.full_text(), compile_options(source, cc))
        .map_err(|e| CudaError::Compile {
            source_name: source.name,
            arch: cc.virtual_arch(),
            log: compile_log(e),
        })?;
    let mut compiled = COMPILED.lock().unwrap_or_else(PoisonError::into_inner);
    if cached(&compiled).is_none() {
        compiled.push((source.name, cc, ptx.clone()));
    }
    Ok(ptx)
}

fn compile_log(e: nvrtc::CompileError) -> String {
    match e {
        nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

/// Whether libnvrtc can be loaded (cudarc panics on first use where it cannot).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names; no symbol is called.
    unsafe { nvrtc::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_pasted_in_and_lines_keep_their_files_numbers() {
        for source in &SOURCES {
            let text = source.full_text();
            // NVRTC has no include path: a line left here fails to compile on the GPU host.
            assert!(
                !text.lines().any(|l| l.trim_start().starts_with("#include")),
                "{}: an #include NVRTC cannot resolve",
                source.name
            );
        }
        let sample = SOURCES.iter().find(|s| s.name == "sample").unwrap();
        let text = sample.full_text();
        assert_eq!(text.matches("#define PD_SAMPLE_CUH").count(), 1);
        let lines: Vec<&str> = text.lines().collect();
        let file: Vec<&str> = sample.code.lines().collect();
        let resumed = lines
            .iter()
            .position(|l| {
                l.starts_with("#line ")
                    && l.ends_with("\"sample.cu\"")
                    && *l != "#line 1 \"sample.cu\""
            })
            .expect("the file resumes after its header");
        let number: usize = lines[resumed].split(' ').nth(1).unwrap().parse().unwrap();
        assert_eq!(lines[resumed + 1], file[number - 1]);
        assert!(file[number - 2].starts_with("#include \"sample.cuh\""));
    }
}
