//! `flashloss._native`: the fused losses of the `flashloss` crate for PyTorch tensors,
//! called by `flashloss.torch` (which owns the autograd side). Every function borrows
//! the tensors' memory (no copy), writes the gradients into tensors the caller
//! allocated, runs with the GIL released, and turns every error, and any panic, into a
//! `ValueError` with flashloss's message.

mod args;
mod configs;
mod cuda_memory;
mod device;
mod dist;
mod front;
mod info;
mod jax;
mod logits;
mod logprobs;
mod losses;
mod policy;
mod spec;
mod tensor;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("cuda_build", cfg!(feature = "cuda"))?;
    m.add_function(wrap_pyfunction!(info::cpu_bf16_products, m)?)?;
    m.add_function(wrap_pyfunction!(info::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_memory::cuda_stats, m)?)?;
    m.add_function(wrap_pyfunction!(losses::grpo_linear, m)?)?;
    m.add_function(wrap_pyfunction!(losses::ce_linear, m)?)?;
    m.add_function(wrap_pyfunction!(losses::ce_rows, m)?)?;
    m.add_function(wrap_pyfunction!(logprobs::logp_linear, m)?)?;
    m.add_function(wrap_pyfunction!(logits::grpo_logits, m)?)?;
    m.add_function(wrap_pyfunction!(policy::grpo_policy, m)?)?;
    m.add_function(wrap_pyfunction!(logits::grpo_logits_per_token, m)?)?;
    m.add_function(wrap_pyfunction!(logprobs::logp_linear_grads, m)?)?;
    m.add_function(wrap_pyfunction!(jax::jax_targets, m)?)?;
    m.add_function(wrap_pyfunction!(jax::jax_abi_layout, m)?)?;
    m.add_function(wrap_pyfunction!(configs::check_grpo_config, m)?)?;
    m.add_function(wrap_pyfunction!(configs::check_ce_config, m)?)?;
    m.add_function(wrap_pyfunction!(configs::defaults, m)?)?;
    Ok(())
}
