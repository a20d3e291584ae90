//! What the native library tells Python about this machine: the products a bf16 head
//! runs on the CPU ([`flashloss::cpu::bf16_products_choice`]).

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
