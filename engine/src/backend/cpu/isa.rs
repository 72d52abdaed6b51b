//! Which SIMD instruction set the CPU kernels run on: the host's features, detected at run
//! time, and the `PD_CPU_ISA` override (`amx`, `avx512`, `avx2`, `portable`). One binary
//! serves every x86-64 host: each kernel is compiled once per instruction set and the backend
//! picks one when it is built.
//!
//! What it does not own: the kernels themselves (`convert.rs`, `linear.rs`, `gemm512.rs`,
//! `amx.rs`, `attention/`), which take an [`Isa`] and trust that it is [`Isa::available`].

use std::fmt;
use std::sync::OnceLock;

/// The environment variable that caps (or names) the instruction set.
pub const ENV_VAR: &str = "PD_CPU_ISA";
/// The variable's older name, still read when [`ENV_VAR`] is unset.
const LEGACY_ENV_VAR: &str = "PD_CPU_SIMD";

/// The SIMD instruction set a kernel runs on, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AMX-BF16 tiles for the large-batch products of bf16 weights (prefill, batched decode),
    /// with AVX512-BF16 to pack their activations; [`Isa::Avx512`] for everything else.
    Amx,
    /// AVX-512 F + BW + VL (16 f32 lanes), with AVX2 + FMA + F16C beside it.
    Avx512,
    /// AVX2 + FMA + F16C (8 f32 lanes).
    Avx2,
    /// Portable Rust (auto-vectorised where the compiler can); also the only one off x86-64.
    Portable,
}

/// Why `PD_CPU_ISA` cannot be honoured: each is one sentence naming the value and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    #[error("{ENV_VAR}={0}: expected auto, amx, avx512, avx2 or portable")]
    Unknown(String),
    #[error("{ENV_VAR}={requested}: this host has no {what} ({flags} not in cpu flags)")]
    Missing {
        requested: &'static str,
        what: &'static str,
        flags: String,
    },
    #[error(
        "{ENV_VAR}=amx: the Linux kernel refused this process the AMX tile state \
         (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or later is needed)"
    )]
    AmxRefused,
}

/// The CPU features the kernels care about, as Linux's `/proc/cpuinfo` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512_bf16: bool,
    pub avx512_fp16: bool,
    pub amx_bf16: bool,
    pub amx_tile: bool,
    /// Not a CPU flag: whether Linux granted this process the AMX tile data state (asked
    /// for once, at detection, only where the CPU has AMX).
    pub amx_permitted: bool,
}

impl CpuFeatures {
    /// This host's features (detected once).
    pub fn host() -> CpuFeatures {
        static HOST: OnceLock<CpuFeatures> = OnceLock::new();
        *HOST.get_or_init(detect_features)
    }

    /// The detected features' names, in `/proc/cpuinfo` spelling.
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.avx2, "avx2"),
            (self.fma, "fma"),
            (self.f16c, "f16c"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512vl, "avx512vl"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.avx512_fp16, "avx512_fp16"),
            (self.amx_bf16, "amx_bf16"),
            (self.amx_tile, "amx_tile"),
        ]
        .into_iter()
        .filter_map(|(has, name)| has.then_some(name))
        .collect()
    }

    fn avx2_set(&self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    fn avx512_set(&self) -> bool {
        self.avx2_set() && self.avx512f && self.avx512bw && self.avx512vl
    }

    fn amx(&self) -> bool {
        self.amx_bf16 && self.amx_tile
    }

    fn amx_set(&self) -> bool {
        self.avx512_set() && self.avx512_bf16 && self.amx() && self.amx_permitted
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> CpuFeatures {
    use std::arch::is_x86_feature_detected as has;
    // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE (the standard library's
    // detection of AMX is not stable yet). Leaf 7 exists on every CPU with AVX2.
    let leaf7 = if has!("avx2") {
        std::arch::x86_64::__cpuid_count(7, 0).edx
    } else {
        0
    };
    let amx_bf16 = leaf7 >> 22 & 1 == 1;
    let amx_tile = leaf7 >> 24 & 1 == 1;
    CpuFeatures {
        avx2: has!("avx2"),
        fma: has!("fma"),
        f16c: has!("f16c"),
        avx512f: has!("avx512f"),
        avx512bw: has!("avx512bw"),
        avx512vl: has!("avx512vl"),
        avx512_bf16: has!("avx512bf16"),
        avx512_fp16: has!("avx512fp16"),
        amx_bf16,
        amx_tile,
        amx_permitted: amx_bf16 && amx_tile && super::amx::request_permission(),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_features() -> CpuFeatures {
    CpuFeatures::default()
}

impl Isa {
    /// Every instruction set, best first.
    pub const ALL: [Isa; 4] = [Isa::Amx, Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// The name `PD_CPU_ISA` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Amx => "amx",
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU can run the instruction set.
    pub fn available(self) -> bool {
        self.available_on(&CpuFeatures::host())
    }

    fn available_on(self, cpu: &CpuFeatures) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => cfg!(target_arch = "x86_64") && cpu.avx2_set(),
            Isa::Avx512 => cfg!(target_arch = "x86_64") && cpu.avx512_set(),
            Isa::Amx => cfg!(target_arch = "x86_64") && cpu.amx_set(),
        }
    }

    /// The vector instruction set of the kernels that are not matrix products on tiles:
    /// AVX-512 under AMX, otherwise the set itself.
    pub fn simd(self) -> Isa {
        match self {
            Isa::Amx => Isa::Avx512,
            other => other,
        }
    }

    /// The best instruction set this CPU can run.
    pub fn best() -> Isa {
        Isa::best_on(&CpuFeatures::host())
    }

    fn best_on(cpu: &CpuFeatures) -> Isa {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.available_on(cpu))
            .unwrap_or(Isa::Portable)
    }

    /// Instruction sets this CPU can run, best first (for tests and benchmarks).
    pub fn all_available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.available()).collect()
    }

    /// The instruction set a value of `PD_CPU_ISA` asks for on a CPU with `cpu`'s features:
    /// `auto` (or empty) is the best one; a named one the CPU lacks is refused.
    pub fn requested_on(value: &str, cpu: &CpuFeatures) -> Result<Isa, IsaError> {
        let value = value.trim().to_ascii_lowercase();
        let missing = |requested, what, flags: &[(&'static str, bool)]| IsaError::Missing {
            requested,
            what,
            flags: flags
                .iter()
                .filter(|(_, has)| !has)
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", "),
        };
        match value.as_str() {
            "" | "auto" => Ok(Isa::best_on(cpu)),
            "portable" | "scalar" => Ok(Isa::Portable),
            "avx2" if Isa::Avx2.available_on(cpu) => Ok(Isa::Avx2),
            "avx2" => Err(missing(
                "avx2",
                "AVX2 + FMA + F16C",
                &[("avx2", cpu.avx2), ("fma", cpu.fma), ("f16c", cpu.f16c)],
            )),
            "avx512" if Isa::Avx512.available_on(cpu) => Ok(Isa::Avx512),
            "avx512" => Err(missing(
                "avx512",
                "AVX-512",
                &[
                    ("avx512f", cpu.avx512f),
                    ("avx512bw", cpu.avx512bw),
                    ("avx512vl", cpu.avx512vl),
                    ("avx2", cpu.avx2),
                    ("fma", cpu.fma),
                    ("f16c", cpu.f16c),
                ],
            )),
            "amx" if Isa::Amx.available_on(cpu) => Ok(Isa::Amx),
            "amx" if cpu.amx() && cpu.avx512_set() && cpu.avx512_bf16 => Err(IsaError::AmxRefused),
            "amx" => Err(missing(
                "amx",
                "AMX with AVX-512",
                &[
                    ("amx_bf16", cpu.amx_bf16),
                    ("amx_tile", cpu.amx_tile),
                    ("avx512_bf16", cpu.avx512_bf16),
                    ("avx512f", cpu.avx512f),
                    ("avx512bw", cpu.avx512bw),
                    ("avx512vl", cpu.avx512vl),
                ],
            )),
            _ => Err(IsaError::Unknown(value)),
        }
    }

    /// The instruction set `PD_CPU_ISA` asks for on this CPU (unset: the best one).
    pub fn from_env() -> Result<Isa, IsaError> {
        let value = std::env::var(ENV_VAR)
            .or_else(|_| std::env::var(LEGACY_ENV_VAR))
            .unwrap_or_default();
        Isa::requested_on(&value, &CpuFeatures::host())
    }

    /// [`Isa::from_env`], decided once per process; what the free functions
    /// (`linear::linear`, `convert::to_f32`, `attention::paged_attention`) and
    /// [`super::CpuBackend::new`] use.
    ///
    /// # Panics
    /// If `PD_CPU_ISA` asks for an instruction set this CPU cannot run (servers check
    /// [`Isa::from_env`] at start and refuse with the same sentence instead).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Result<Isa, IsaError>> = OnceLock::new();
        match ISA.get_or_init(Isa::from_env) {
            Ok(isa) => *isa,
            Err(e) => panic!("{e}"),
        }
    }
}

/// How `isa` came to be chosen, for logs and reports: `avx512 (the best this host has)`, or
/// `avx2 (set by PD_CPU_ISA; the best this host has is avx512)`.
pub fn describe(isa: Isa) -> String {
    let best = Isa::best();
    let set = std::env::var(ENV_VAR)
        .or_else(|_| std::env::var(LEGACY_ENV_VAR))
        .is_ok_and(|v| !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("auto"));
    match (set, isa == best) {
        (false, true) => format!("{isa} (the best this host has)"),
        (true, true) => format!("{isa} (set by {ENV_VAR}; the best this host has)"),
        (_, false) => format!("{isa} (set by {ENV_VAR}; the best this host has is {best})"),
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zen3() -> CpuFeatures {
        CpuFeatures {
            avx2: true,
            fma: true,
            f16c: true,
            ..CpuFeatures::default()
        }
    }

    fn zen5() -> CpuFeatures {
        CpuFeatures {
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            avx512_bf16: true,
            ..zen3()
        }
    }

    fn sapphire_rapids() -> CpuFeatures {
        CpuFeatures {
            avx512_fp16: true,
            amx_bf16: true,
            amx_tile: true,
            amx_permitted: true,
            ..zen5()
        }
    }

    #[test]
    fn auto_picks_the_best_the_cpu_has() {
        assert_eq!(Isa::requested_on("", &zen3()), Ok(Isa::Avx2));
        assert_eq!(Isa::requested_on("auto", &zen5()), Ok(Isa::Avx512));
        assert_eq!(Isa::requested_on("", &sapphire_rapids()), Ok(Isa::Amx));
        // AMX the kernel will not grant is not the AMX path.
        let refused = CpuFeatures {
            amx_permitted: false,
            ..sapphire_rapids()
        };
        assert_eq!(Isa::requested_on("", &refused), Ok(Isa::Avx512));
        assert_eq!(
            Isa::requested_on("", &CpuFeatures::default()),
            Ok(Isa::Portable)
        );
        // AVX-512F without BW/VL is not the AVX-512 path.
        let knl = CpuFeatures {
            avx512f: true,
            ..zen3()
        };
        assert_eq!(Isa::requested_on("", &knl), Ok(Isa::Avx2));
    }

    #[test]
    fn a_lower_path_can_be_forced() {
        assert_eq!(Isa::requested_on("avx2", &zen5()), Ok(Isa::Avx2));
        assert_eq!(Isa::requested_on("amx", &sapphire_rapids()), Ok(Isa::Amx));
        assert_eq!(
            Isa::requested_on("avx512", &sapphire_rapids()),
            Ok(Isa::Avx512)
        );
        assert_eq!(Isa::requested_on(" AVX512 ", &zen5()), Ok(Isa::Avx512));
        assert_eq!(Isa::requested_on("portable", &zen5()), Ok(Isa::Portable));
        assert_eq!(Isa::requested_on("scalar", &zen3()), Ok(Isa::Portable));
    }

    #[test]
    fn a_path_the_host_lacks_is_refused_in_one_sentence() {
        assert_eq!(
            Isa::requested_on("amx", &zen5()).unwrap_err().to_string(),
            "PD_CPU_ISA=amx: this host has no AMX with AVX-512 (amx_bf16, amx_tile not in cpu \
             flags)"
        );
        assert_eq!(
            Isa::requested_on("avx512", &zen3())
                .unwrap_err()
                .to_string(),
            "PD_CPU_ISA=avx512: this host has no AVX-512 (avx512f, avx512bw, avx512vl not in \
             cpu flags)"
        );
        assert_eq!(
            Isa::requested_on("avx2", &CpuFeatures::default())
                .unwrap_err()
                .to_string(),
            "PD_CPU_ISA=avx2: this host has no AVX2 + FMA + F16C (avx2, fma, f16c not in cpu \
             flags)"
        );
        let refused = CpuFeatures {
            amx_permitted: false,
            ..sapphire_rapids()
        };
        assert_eq!(
            Isa::requested_on("amx", &refused).unwrap_err().to_string(),
            "PD_CPU_ISA=amx: the Linux kernel refused this process the AMX tile state \
             (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or later is needed)"
        );
        assert_eq!(
            Isa::requested_on("sse", &zen5()).unwrap_err().to_string(),
            "PD_CPU_ISA=sse: expected auto, amx, avx512, avx2 or portable"
        );
    }

    #[test]
    fn the_host_runs_what_it_reports() {
        let host = CpuFeatures::host();
        assert!(Isa::best().available());
        assert_eq!(Isa::all_available().last(), Some(&Isa::Portable));
        assert_eq!(
            Isa::Avx512.available(),
            host.names()
                .iter()
                .filter(|n| ["avx512f", "avx512bw", "avx512vl"].contains(n))
                .count()
                == 3
                && Isa::Avx2.available()
        );
    }
}
