//! CUDA backend checks that need no GPU (feature `cuda`):
//! - every kernel source compiles with NVRTC for `compute_90` and `compute_80` with an
//!   empty log (no warning). Needs the NVRTC library (`libnvrtc.so`, e.g. the
//!   `nvidia-cuda-nvrtc` wheel on `LD_LIBRARY_PATH`); without it the test says so and
//!   passes, unless `FLASHLOSS_REQUIRE_NVRTC=1` (as `.ci/run` sets) makes it fail;
//! - without a driver, `Gpu::new` is a clear error, not a panic.
#![cfg(feature = "cuda")]

use flashloss::Error;
use flashloss::cuda::Gpu;
use flashloss::cuda::kernels::{SOURCES, compile, nvrtc_present};

#[test]
fn every_kernel_compiles_without_warnings_for_hopper_and_ampere() {
    if !nvrtc_present() {
        let required = std::env::var("FLASHLOSS_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "FLASHLOSS_REQUIRE_NVRTC=1 but libnvrtc.so cannot be loaded"
        );
        eprintln!("skipped: no NVRTC library on this machine");
        return;
    }
    for src in SOURCES {
        for arch in ["compute_90", "compute_80"] {
            let ptx = compile(src, arch).unwrap_or_else(|e| panic!("{e}"));
            for kernel in src.kernels {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{} for {arch}: no entry {kernel}",
                    src.name
                );
            }
        }
    }
}

#[test]
fn a_broken_source_is_an_error_with_the_compiler_log() {
    if !nvrtc_present() {
        return;
    }
    let broken = flashloss::cuda::kernels::KernelSource {
        name: "broken.cu",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    let err = compile(&broken, "compute_90").unwrap_err().to_string();
    assert!(
        err.starts_with("cuda: broken.cu does not compile for compute_90"),
        "{err}"
    );
    assert!(err.contains("undefined_name"), "{err}");
    let warns = flashloss::cuda::kernels::KernelSource {
        name: "warns.cu",
        source: "extern \"C\" __global__ void k(float* x) { int unused = 1; x[0] = 1.0f; }",
        kernels: &["k"],
    };
    let err = compile(&warns, "compute_90").unwrap_err().to_string();
    assert!(err.contains("with warnings"), "{err}");
}

#[test]
fn no_driver_is_a_clear_error() {
    if flashloss::cuda::driver_present() {
        return;
    }
    match Gpu::new(0) {
        Err(Error::Device { reason }) => {
            assert!(reason.starts_with("no CUDA driver found"), "{reason}")
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a GPU without a driver"),
    }
}
