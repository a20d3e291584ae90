//! The front door from Python: a call on the [`Device`] of the tensors' device
//! ([`crate::device`]: one per process and device, kept between calls, so its workspace
//! is reused from step to step), with the call's LM head as [`HeadArgs`]: host slices of CPU tensors, or (a build with the
//! `cuda` feature) PyTorch's device buffers, borrowed, on PyTorch's current stream.

use crate::args::{Grads, HeadTensors, TorchElement};
#[cfg(feature = "cuda")]
use crate::device::gpu;
use crate::device::{cpu, run};
use crate::tensor::arg_error;
use flashloss::fused::LinearGradsMut;
use flashloss::{Device, HeadArgs};
use pyo3::prelude::*;

/// `$body` with `$E` the kernels' element type of tensor dtype `$dtype` (f32, bf16 or
/// f16).
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            $crate::tensor::DType::F32 => {
                type $E = f32;
                $body
            }
            $crate::tensor::DType::F16 => {
                type $E = half::f16;
                $body
            }
            _ => {
                type $E = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_element;

/// Runs `call` on the head's device with the head (and `grads`, when the loss has
/// gradients) as [`HeadArgs`] of element type `E`, without the GIL.
pub(crate) fn call_head<E: TorchElement, R: Send>(
    py: Python<'_>,
    head: &HeadTensors,
    grads: Option<&mut Grads>,
    stream: usize,
    call: impl FnOnce(&Device, HeadArgs<E>) -> flashloss::Result<R> + Send,
) -> PyResult<R> {
    if let Some(ordinal) = head.hidden.cuda {
        return call_borrowed(py, ordinal, head, grads, stream, call);
    }
    let inputs = head.inputs::<E>()?;
    let grads = match grads {
        // SAFETY: the gradient tensors are fresh allocations of the Python side.
        Some(g) => unsafe { g.view()? },
        None => LinearGradsMut {
            dhidden: &mut [],
            dweight: &mut [],
            dbias: None,
        },
    };
    let args = HeadArgs::Host {
        inputs: &inputs,
        grads,
    };
    run(py, || call(cpu(), args))
}

/// [`call_head`] on device tensors: borrowed, with PyTorch's `stream`.
#[cfg(feature = "cuda")]
fn call_borrowed<E: TorchElement, R: Send>(
    py: Python<'_>,
    ordinal: usize,
    head: &HeadTensors,
    grads: Option<&mut Grads>,
    stream: usize,
    call: impl FnOnce(&Device, HeadArgs<E>) -> flashloss::Result<R> + Send,
) -> PyResult<R> {
    let device = gpu(ordinal).map_err(|e| arg_error("hidden", e))?;
    let shape = (head.tokens, head.hidden_size, head.vocab);
    // The call's buffers from PyTorch's caching allocator, on PyTorch's stream.
    let lender = crate::cuda_memory::TorchAllocator::lender(py, ordinal, stream)?;
    let lend = |b: flashloss::cuda::BorrowedHead| match lender.clone() {
        Some(l) => b.lent_by(l),
        None => b,
    };
    let Some(g) = grads else {
        // SAFETY: as below, for the head's tensors (a call without gradients).
        let borrowed = unsafe {
            flashloss::cuda::BorrowedHead::without_grads(
                stream,
                (
                    head.hidden.device_ptr(),
                    head.weight.device_ptr(),
                    head.bias.as_ref().map(|b| b.device_ptr()),
                ),
                shape,
            )
        };
        return run(py, || call(device, HeadArgs::Cuda(lend(borrowed))));
    };
    // SAFETY: the Python side passes PyTorch's current stream of this device and
    // contiguous tensors of these sizes and dtypes (checked there and in `Tensor`),
    // which it keeps alive, and does not touch, for the length of the call; the
    // gradient buffers are fresh f32 allocations.
    let borrowed = unsafe {
        flashloss::cuda::BorrowedHead::new(
            stream,
            head.hidden.device_ptr(),
            head.weight.device_ptr(),
            head.bias.as_ref().map(|b| b.device_ptr()),
            g.hidden.device_ptr(),
            g.weight.as_ref().map(|w| w.device_ptr()),
            g.bias.as_ref().map(|b| b.device_ptr()),
            shape,
        )
    };
    run(py, || call(device, HeadArgs::Cuda(lend(borrowed))))
}

/// Without the `cuda` feature no tensor is on a GPU (`Tensor::new` refuses them).
#[cfg(not(feature = "cuda"))]
fn call_borrowed<E: TorchElement, R: Send>(
    _py: Python<'_>,
    _ordinal: usize,
    head: &HeadTensors,
    _grads: Option<&mut Grads>,
    _stream: usize,
    _call: impl FnOnce(&Device, HeadArgs<E>) -> flashloss::Result<R> + Send,
) -> PyResult<R> {
    Err(arg_error(
        head.hidden.arg,
        "is on a GPU; this build runs CPU tensors",
    ))
}
