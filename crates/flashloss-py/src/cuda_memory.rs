//! PyTorch's CUDA memory for the native calls: [`TorchAllocator`] lends a call's device
//! buffers (its O(N) states and coefficients, the fused tiles) from PyTorch's caching
//! allocator on the call's stream (`torch.cuda.caching_allocator_alloc`), so
//! `torch.cuda.memory_allocated` counts them and PyTorch reuses them after the call; and
//! [`cuda_stats`] reads what the backend allocates itself and the host's waits.

use crate::device::run;
use flashloss::Error;
#[cfg(feature = "cuda")]
use flashloss::cuda::DeviceAllocator;
use pyo3::prelude::*;
use pyo3::types::PyDict;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// PyTorch's caching allocator on GPU `device` and stream `stream` (a `cudaStream_t`).
/// Each allocation and each release takes the GIL back for its length (the kernels run
/// without it).
#[cfg(feature = "cuda")]
pub(crate) struct TorchAllocator {
    alloc: Py<PyAny>,
    free: Py<PyAny>,
    device: usize,
    stream: usize,
}

#[cfg(feature = "cuda")]
impl TorchAllocator {
    /// The allocator of `device` and `stream` where the environment variable
    /// `FLASHLOSS_CUDA_BUFFERS` is `torch`; `None` (the backend's own allocations, the path
    /// run on a device) where it is unset or `backend`; an error naming it otherwise.
    pub(crate) fn lender(
        py: Python<'_>,
        device: usize,
        stream: usize,
    ) -> PyResult<Option<Arc<dyn DeviceAllocator>>> {
        match std::env::var("FLASHLOSS_CUDA_BUFFERS").as_deref() {
            Ok("torch") => {}
            Ok("backend") | Err(std::env::VarError::NotPresent) => return Ok(None),
            Ok(other) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "environment variable FLASHLOSS_CUDA_BUFFERS: expected `torch` or `backend`, got `{other}`"
                )));
            }
            Err(e) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "environment variable FLASHLOSS_CUDA_BUFFERS: {e}"
                )));
            }
        }
        let cuda = py.import("torch.cuda")?;
        Ok(Some(Arc::new(TorchAllocator {
            alloc: cuda.getattr("caching_allocator_alloc")?.unbind(),
            free: cuda.getattr("caching_allocator_delete")?.unbind(),
            device,
            stream,
        })))
    }
}

#[cfg(feature = "cuda")]
impl DeviceAllocator for TorchAllocator {
    fn alloc(&self, bytes: usize) -> flashloss::Result<u64> {
        Python::attach(|py| {
            let args = (bytes, self.device, self.stream);
            self.alloc.call1(py, args)?.extract::<u64>(py)
        })
        .map_err(|e| Error::Device {
            reason: format!(
                "torch.cuda.caching_allocator_alloc of {bytes} bytes on cuda:{} failed: {e}",
                self.device
            ),
        })
    }

    fn free(&self, ptr: u64) {
        // A failure here (the interpreter shutting down) leaves the block to PyTorch.
        Python::attach(|py| {
            let _ = self.free.call1(py, (ptr,));
        });
    }
}

/// `{"in_use_bytes", "peak_bytes", "workspace_bytes", "stream_syncs",
/// "copies_to_host"}` of GPU `ordinal` in this process: the bytes the backend allocates
/// itself (not PyTorch's: under `FLASHLOSS_CUDA_BUFFERS=torch` the calls' buffers are
/// PyTorch's, see `torch.cuda.memory_allocated`, and what stays is the cuBLAS workspace), the peak since the
/// last reset, the tiles kept between calls, and the host's waits on the GPU's streams
/// (stream synchronizations, copies from the device into host memory) since the last
/// reset. `reset` starts a new peak and counts from zero after reading.
#[pyfunction]
#[pyo3(signature = (ordinal=0, reset=false))]
pub fn cuda_stats<'py>(
    py: Python<'py>,
    ordinal: usize,
    reset: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let stats = run(py, || stats_of(ordinal, reset))?;
    let d = PyDict::new(py);
    for (key, value) in stats {
        d.set_item(key, value)?;
    }
    Ok(d)
}

#[cfg(feature = "cuda")]
fn stats_of(ordinal: usize, reset: bool) -> flashloss::Result<Vec<(&'static str, usize)>> {
    let device = crate::device::gpu(ordinal)?;
    let gpu = device.gpu().ok_or_else(|| Error::Device {
        reason: format!("cuda:{ordinal} is not a GPU device"),
    })?;
    let (memory, syncs) = (gpu.memory(), gpu.host_syncs());
    let stats = vec![
        ("in_use_bytes", memory.in_use()),
        ("peak_bytes", memory.peak()),
        ("workspace_bytes", device.workspace_bytes()?),
        ("stream_syncs", syncs.syncs()),
        ("copies_to_host", syncs.copies_to_host()),
    ];
    if reset {
        memory.reset_peak();
        syncs.reset();
    }
    Ok(stats)
}

#[cfg(not(feature = "cuda"))]
fn stats_of(_ordinal: usize, _reset: bool) -> flashloss::Result<Vec<(&'static str, usize)>> {
    Err(Error::InvalidArgument {
        arg: "ordinal",
        reason: "this build of flashloss runs CPU tensors only (no `cuda` feature)".into(),
    })
}
