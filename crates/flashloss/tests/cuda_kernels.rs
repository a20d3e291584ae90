//! CUDA backend checks that need no GPU (feature `cuda`):
//! - every kernel source compiles with NVRTC for `compute_90` and `compute_80` with an
//!   empty log (no warning). Needs the NVRTC library (`libnvrtc.so`, e.g. the
//!   `nvidia-cuda-nvrtc` wheel on `LD_LIBRARY_PATH`); without it the test says so and
//!   passes, unless `FLASHLOSS_REQUIRE_NVRTC=1` (as `.ci/run` sets) makes it fail;
//! - every kernel compiles to a cubin for `sm_80`, `sm_90` and `sm_100` (so that ptxas
//!   runs) with no spill and its shared memory within the limit; prints ptxas's table;
//! - without a driver, `Gpu::new` is a clear error, not a panic.
#![cfg(feature = "cuda")]

use flashloss::Error;
use flashloss::cuda::Gpu;
use flashloss::cuda::kernels::{
    CUBIN_ARCHS, KernelUsage, SOURCES, compile, compile_cubin, nvrtc_present, parse_ptxas_log,
};

/// Whether NVRTC is here; without it a test is skipped, unless `FLASHLOSS_REQUIRE_NVRTC=1`.
fn nvrtc_or_skip() -> bool {
    if !nvrtc_present() {
        let required = std::env::var("FLASHLOSS_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "FLASHLOSS_REQUIRE_NVRTC=1 but libnvrtc.so cannot be loaded"
        );
        eprintln!("skipped: no NVRTC library on this machine");
        return false;
    }
    true
}

#[test]
fn every_kernel_compiles_without_warnings_for_hopper_and_ampere() {
    if !nvrtc_or_skip() {
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

#[test]
fn every_kernel_compiles_to_a_cubin_without_spills_for_ampere_hopper_and_blackwell() {
    if !nvrtc_or_skip() {
        return;
    }
    println!("arch    kernel                   regs  stack  spill st/ld  smem");
    let mut failures = Vec::new();
    for src in SOURCES {
        for &arch in CUBIN_ARCHS {
            let cubin = compile_cubin(src, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                cubin.image.starts_with(b"\x7fELF"),
                "{}: not a cubin",
                src.name
            );
            let mut names: Vec<&str> = cubin.usage.iter().map(|k| k.kernel.as_str()).collect();
            names.sort_unstable();
            let mut want = src.kernels.to_vec();
            want.sort_unstable();
            assert_eq!(names, want, "{} for {arch}: ptxas's kernels", src.name);
            for k in &cubin.usage {
                println!(
                    "{arch:<7} {:<24} {:>4} {:>6} {:>6}/{:<5} {:>5}",
                    k.kernel, k.registers, k.stack, k.spill_stores, k.spill_loads, k.smem
                );
                failures.extend(k.violation().map(|v| format!("{arch}: {v}")));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_ptxas_report_is_read_per_kernel_and_a_spill_fails() {
    let log = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem, 384 bytes cmem[0]
ptxas info    : Compile time = 3.5 ms
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 1 barriers, 65536 bytes smem
";
    let usage = parse_ptxas_log(log).unwrap();
    let a = KernelUsage {
        kernel: "a".into(),
        registers: 40,
        spill_stores: 8,
        spill_loads: 4,
        stack: 16,
        smem: 128,
    };
    assert_eq!(usage[0], a);
    assert_eq!(
        usage[0].violation().unwrap(),
        "a spills (8 bytes stored, 4 bytes loaded)"
    );
    assert_eq!(
        usage[1].violation().unwrap(),
        "b uses 65536 bytes of shared memory (at most 49152)"
    );
    let warned = format!("{log}ptxas warning : Registers are spilled to local memory\n");
    assert_eq!(parse_ptxas_log(&warned), None);
}

/// The helpers every source shares live in one header (`kernels/flashloss.cuh`, given to
/// NVRTC with each program): a source includes it and defines none of them again.
#[test]
fn every_source_takes_the_shared_helpers_from_the_header() {
    use flashloss::cuda::kernels::HEADERS;
    assert_eq!(HEADERS.len(), 1);
    let (name, header) = HEADERS[0];
    for helper in ["bf16_bits;", "float load(", "void store(", "float logit("] {
        assert!(header.contains(helper), "{name} lacks {helper}");
        for src in SOURCES {
            assert!(
                !src.source.contains(helper),
                "{} defines {helper} again",
                src.name
            );
        }
    }
    for src in SOURCES {
        assert!(
            src.source.contains(&format!("#include \"{name}\"")),
            "{} does not include {name}",
            src.name
        );
    }
}
