//! The process's devices and the GIL-free runner every native call goes through: the
//! CPU device, each GPU opened once, and [`run`] (a flashloss error or a panic as a
//! `ValueError`). A leaf: it imports no module of this crate.

use flashloss::Device;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::LazyLock;

/// Runs `work` without the GIL; a flashloss error or a panic becomes a `ValueError`.
pub(crate) fn run<T: Send>(
    py: Python<'_>,
    work: impl FnOnce() -> flashloss::Result<T> + Send,
) -> PyResult<T> {
    let result = py.detach(|| catch_unwind(AssertUnwindSafe(work)));
    match result {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(PyValueError::new_err(e.to_string())),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(PyValueError::new_err(format!(
                "flashloss internal error (please report it): {what}"
            )))
        }
    }
}

/// The CPU device of this process.
pub(crate) fn cpu() -> &'static Device {
    static CPU: LazyLock<Device> = LazyLock::new(Device::cpu);
    &CPU
}

/// GPU `ordinal`'s device, opened once per process (kernels loaded once).
#[cfg(feature = "cuda")]
pub(crate) fn gpu(ordinal: usize) -> flashloss::Result<&'static Device> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static GPUS: LazyLock<Mutex<HashMap<usize, &'static Device>>> = LazyLock::new(Mutex::default);
    let mut gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = gpus.get(&ordinal) {
        return Ok(d);
    }
    let device: &'static Device = Box::leak(Box::new(Device::cuda(ordinal)?));
    gpus.insert(ordinal, device);
    Ok(device)
}
