//! Asking for a CUDA device where it cannot work fails at start with one clear sentence:
//! in a build without the `cuda` feature, and (with the feature) on a machine without an
//! NVIDIA driver. On a machine with a driver the second test has nothing to check and says so.

use pd_kernels::{CudaBackend, CudaError};

fn open_error(ordinal: usize) -> CudaError {
    match CudaBackend::open(ordinal, 0.9) {
        Ok(_) => panic!("cuda:{ordinal} opened"),
        Err(e) => e,
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_build_without_cuda_says_how_to_get_it() {
    let e = open_error(1);
    assert!(matches!(e, CudaError::NotBuilt { ordinal: 1 }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with("--device cuda:1 needs a build with CUDA support"),
        "{text}"
    );
    assert!(text.contains("--features cuda"), "{text}");
    assert!(!text.contains('\n'), "one sentence: {text}");
}

#[cfg(feature = "cuda")]
#[test]
fn a_machine_without_a_driver_says_so_instead_of_panicking() {
    if pd_kernels::cuda::driver_present() {
        eprintln!("skipped: this machine has an NVIDIA driver (the GPU tests cover it)");
        return;
    }
    let e = open_error(0);
    assert!(matches!(e, CudaError::NoDriver { ordinal: 0 }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("no NVIDIA driver found"), "{text}");
    assert!(text.contains("--device cpu"), "{text}");
    assert!(!text.contains('\n'), "one sentence: {text}");
}

#[test]
fn memory_utilization_outside_the_unit_interval_is_refused() {
    // Without the feature the build error comes first; with it the fraction is checked
    // before any library is touched.
    let e = match CudaBackend::open(0, 1.5) {
        Ok(_) => panic!("opened"),
        Err(e) => e,
    };
    if pd_kernels::BUILT {
        assert!(matches!(e, CudaError::BadMemoryUtilization(_)), "{e:?}");
        assert!(e.to_string().contains("(0, 1]"));
    } else {
        assert!(matches!(e, CudaError::NotBuilt { .. }), "{e:?}");
    }
}
