//! `flashloss.jax`'s native part: XLA FFI handlers ([`handlers`]) over a hand-written
//! mirror of the FFI C API ([`ffi`], [`frame`]), handed to Python as capsules of their
//! function pointers for `jax.ffi.register_ffi_target`: the whole-head ones (and the
//! truncated-support log-probs of [`support`]), and the vocabulary-split ones of
//! [`vocab`] (GRPO, log-probs) and [`ce_vocab`]. JAX itself is
//! not a dependency of the build: the handlers speak the C ABI that jaxlib loads.

mod ce_vocab;
#[cfg(feature = "cuda")]
mod cuda;
pub(crate) mod ffi;
pub(crate) mod frame;
mod handlers;
mod support;
mod vocab;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `{target name: capsule of the handler's function pointer}` (the capsule's pointer is
/// the function pointer itself, as `register_ffi_target` expects) of the handlers of
/// `platform`: "cpu", or "CUDA" (empty in a build without the `cuda` feature).
#[pyfunction]
#[pyo3(signature = (platform="cpu"))]
pub fn jax_targets<'py>(py: Python<'py>, platform: &str) -> PyResult<Bound<'py, PyDict>> {
    let handlers = match platform {
        "cpu" => [
            handlers::targets(),
            vocab::targets(),
            ce_vocab::targets(),
            support::targets(),
        ]
        .concat(),
        #[cfg(feature = "cuda")]
        "CUDA" => cuda::targets(),
        _ => Vec::new(),
    };
    let d = PyDict::new(py);
    for (name, handler) in handlers {
        // SAFETY: a capsule of a static function pointer, with no destructor.
        let capsule = unsafe {
            let ptr =
                pyo3::ffi::PyCapsule_New(handler as *mut std::ffi::c_void, std::ptr::null(), None);
            Bound::from_owned_ptr_or_err(py, ptr)?
        };
        d.set_item(name, capsule)?;
    }
    Ok(d)
}

/// `{struct: (size, {field: offset})}` of the mirrored C structs (checked against the
/// installed header by the tests).
#[pyfunction]
pub fn jax_abi_layout(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, size, fields) in ffi::layout() {
        let f = PyDict::new(py);
        for (field, offset) in fields {
            f.set_item(field, offset)?;
        }
        d.set_item(name, (size, f))?;
    }
    Ok(d)
}
