//! Build script: tells the test suite which of the CPU backend's instruction sets the
//! building host can run (`pd_host_avx512`, `pd_host_avx2`, `pd_host_amx`), so that the
//! conformance tests of a path this host lacks are reported as ignored, with the reason,
//! instead of passing without having run. The library itself decides at run time.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pd_host_avx512, pd_host_avx2, pd_host_amx)");
    println!("cargo::rerun-if-changed=build.rs");
    let target_x86 = std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    #[cfg(target_arch = "x86_64")]
    if target_x86 {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        if avx2 {
            println!("cargo::rustc-cfg=pd_host_avx2");
        }
        let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
        if avx512 {
            println!("cargo::rustc-cfg=pd_host_avx512");
        }
        // CPUID leaf 7, sub-leaf 0, EDX bits 22 (AMX-BF16) and 24 (AMX-TILE); the AMX path
        // runs AVX-512 (with AVX512-BF16) around its tiles.
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        if avx512 && has!("avx512bf16") && edx >> 22 & 1 == 1 && edx >> 24 & 1 == 1 {
            println!("cargo::rustc-cfg=pd_host_amx");
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = target_x86;
}
