//! Why a CUDA device cannot be used, each as one sentence a person can act on.

/// Errors of opening and running the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "--device cuda:{ordinal} needs a build with CUDA support, but this binary was built \
         without the `cuda` feature (rebuild with `--features cuda`, or use --device cpu)"
    )]
    NotBuilt { ordinal: usize },
    #[error(
        "--device cuda:{ordinal}: no NVIDIA driver found (libcuda.so could not be loaded); \
         run on a machine with an NVIDIA GPU and driver, or use --device cpu"
    )]
    NoDriver { ordinal: usize },
    #[error(
        "--device cuda:{ordinal}: the CUDA library {library} could not be loaded; put CUDA \
         13's lib directory on LD_LIBRARY_PATH"
    )]
    NoLibrary {
        ordinal: usize,
        library: &'static str,
    },
    #[error("--device cuda:{ordinal}: this machine has {count} CUDA device(s)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error(
        "--device cuda:{ordinal} is a {name} with compute capability {major}.{minor}, but the \
         CUDA backend needs 8.0 (Ampere) or newer"
    )]
    TooOld {
        ordinal: usize,
        name: String,
        major: u32,
        minor: u32,
    },
    #[error("--gpu-memory-utilization {0} must be in (0, 1]")]
    BadMemoryUtilization(f64),
    #[error(
        "cuda:{ordinal}: the model needs {needed_mib} MiB of device memory beyond what is in \
         use, but --gpu-memory-utilization {utilization} allows {limit_mib} MiB of the \
         card's {total_mib} MiB; raise --gpu-memory-utilization or use a smaller model"
    )]
    OutOfMemory {
        ordinal: usize,
        utilization: f64,
        needed_mib: usize,
        limit_mib: usize,
        total_mib: usize,
    },
    #[error("cuda:{ordinal}: {what}: {message}")]
    Driver {
        ordinal: usize,
        what: &'static str,
        message: String,
    },
    #[error("NVRTC could not compile {source_name} for {arch}:\n{log}")]
    Compile {
        source_name: &'static str,
        arch: String,
        log: String,
    },
    #[error("the CUDA backend does not support {0}")]
    Unsupported(String),
    #[error("PD_CUDA_ATTENTION={0}: expected auto (tensor cores for prefill) or f32")]
    BadAttentionSetting(String),
    #[error("PD_CUDA_GEMV={0}: expected cublas or kernel")]
    BadGemvSetting(String),
    #[error("PD_CUDA_PDL={0}: expected on or off")]
    BadPdlSetting(String),
    #[error("PD_CUDA_MOE={0}: expected device or host")]
    BadMoeSetting(String),
}
