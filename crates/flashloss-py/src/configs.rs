//! The loss configs as Python sees them before any call: their checks (the message a
//! kernel call or an FFI handler gives for the same config, naming the argument) and the
//! Rust defaults, which `flashloss._spec`'s argument classes are tested against.

use crate::spec::config_from_json;
use flashloss::fused::plan::DEFAULT_BUDGET_MIB;
use flashloss::{CeConfig, CrossEntropy, GrpoLoss, GrpoLossConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde::de::DeserializeOwned;

/// Checks a GRPO loss config (the JSON of `GrpoLossConfig`): a `ValueError` with the
/// message the kernels and the FFI handlers give (a trace-time check reports a bad
/// argument identically).
#[pyfunction]
pub fn check_grpo_config(config_json: &str) -> PyResult<()> {
    check(config_json, GrpoLoss::new)
}

/// Checks a cross-entropy config (the JSON of `CeConfig`): see [`check_grpo_config`].
#[pyfunction]
pub fn check_ce_config(config_json: &str) -> PyResult<()> {
    check(config_json, CrossEntropy::new)
}

/// `config_json` parsed as `C` (an error names its key) and validated by `new`.
fn check<C: DeserializeOwned, L>(
    config_json: &str,
    new: fn(C) -> flashloss::Result<L>,
) -> PyResult<()> {
    let config = config_from_json::<C>(config_json)?;
    new(config)
        .map(drop)
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `{"grpo": JSON of GrpoLossConfig::default(), "ce": JSON of CeConfig::default(),
/// "budget_mib": the CPU plan's default budget}`: the Rust defaults, one place each.
#[pyfunction]
pub fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let json = |v: serde_json::Result<String>| v.map_err(|e| PyValueError::new_err(e.to_string()));
    let d = PyDict::new(py);
    d.set_item(
        "grpo",
        json(serde_json::to_string(&GrpoLossConfig::default()))?,
    )?;
    d.set_item("ce", json(serde_json::to_string(&CeConfig::default()))?)?;
    d.set_item("budget_mib", DEFAULT_BUDGET_MIB)?;
    Ok(d)
}
