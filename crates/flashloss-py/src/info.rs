//! What the native library tells Python about itself and this machine: what was compiled
//! in ([`build_info`]) and the products a bf16 head runs on the CPU
//! ([`flashloss::cpu::bf16_products_choice`]).

use crate::device::run;
use flashloss::Bf16Products;
use flashloss::cpu::{Bf16Reason, bf16_products_choice};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `{"runs": "widened" | "avx512bf16", "by": "option" | "environment" | "no_avx512bf16"
/// | "measured", "rates": {"widened": GFLOP/s, "avx512bf16": GFLOP/s} | None}`: what a
/// bf16 head runs on the CPU for the setting `bf16_products` (`auto`: the environment
/// variable `FLASHLOSS_BF16_PRODUCTS` where set, else the faster path, measured once per
/// process; `rates` is that measurement where it decided). A `ValueError` for an unknown
/// setting, a bad variable, or `avx512bf16` on a CPU without AVX512-BF16.
#[pyfunction]
#[pyo3(signature = (bf16_products="auto"))]
pub fn cpu_bf16_products<'py>(
    py: Python<'py>,
    bf16_products: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let asked = Bf16Products::from_name(bf16_products).ok_or_else(|| {
        PyValueError::new_err(format!(
            "bf16_products: {bf16_products:?} is not one of auto, widened, avx512bf16"
        ))
    })?;
    let choice = run(py, || bf16_products_choice(asked))?;
    let d = PyDict::new(py);
    d.set_item("runs", choice.runs.name())?;
    let by = match choice.by {
        Bf16Reason::Option => "option",
        Bf16Reason::Environment => "environment",
        Bf16Reason::NoAvx512Bf16 => "no_avx512bf16",
        Bf16Reason::Measured => "measured",
    };
    d.set_item("by", by)?;
    match choice.rates {
        Some(r) => {
            let rates = PyDict::new(py);
            rates.set_item("widened", r.widened_gflops)?;
            rates.set_item("avx512bf16", r.avx512bf16_gflops)?;
            d.set_item("rates", rates)?;
        }
        None => d.set_item("rates", py.None())?,
    }
    Ok(d)
}

/// The x86 features the CPU kernels dispatch on at run time, in that order.
#[cfg(target_arch = "x86_64")]
fn cpu_features() -> Vec<&'static str> {
    let mut found = Vec::new();
    macro_rules! probe {
        ($($f:tt),*) => {$(if std::arch::is_x86_feature_detected!($f) { found.push($f); })*};
    }
    probe!("avx2", "fma", "avx512f", "avx512bw", "avx512bf16");
    found
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_features() -> Vec<&'static str> {
    Vec::new()
}

/// `{"version", "cuda": bool, "cuda_driver": bool | None, "cpu_features": [...]}`: whether
/// this build has the CUDA backend (`cuda`), whether this machine's NVIDIA driver
/// (`libcuda.so`) loads (`cuda_driver`; None in a build without CUDA), and the CPU
/// features found at run time that the CPU kernels dispatch on.
#[pyfunction]
pub fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("cuda", cfg!(feature = "cuda"))?;
    #[cfg(feature = "cuda")]
    d.set_item("cuda_driver", flashloss::cuda::driver_present())?;
    #[cfg(not(feature = "cuda"))]
    d.set_item("cuda_driver", py.None())?;
    d.set_item("cpu_features", cpu_features())?;
    Ok(d)
}
