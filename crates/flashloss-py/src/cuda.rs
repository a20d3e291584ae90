//! CUDA tensors (the `cuda` feature): the head and its gradients stay in PyTorch's
//! device memory (borrowed, neither copied nor freed here) and the kernels run on
//! PyTorch's current stream, so their work is ordered with PyTorch's. Per-token inputs
//! and outputs (`[N]`-sized) are host buffers. One [`Gpu`] (kernels loaded once) per
//! device per process.

use flashloss::cuda::{DeviceHead, Gpu, GpuElement, GpuGrads, GpuHead, GpuWorkspace};
use flashloss::fused::Head;
use flashloss::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Device addresses of a head and of its f32 gradient buffers (all on one GPU).
#[derive(Debug, Clone, Copy)]
pub struct DevicePtrs {
    pub ordinal: usize,
    /// PyTorch's current stream on that device (`torch.cuda.current_stream().cuda_stream`).
    pub stream: usize,
    pub hidden: u64,
    pub weight: u64,
    /// f32 bias `[V]`.
    pub bias: Option<u64>,
    pub dhidden: u64,
    pub dweight: u64,
    pub dbias: Option<u64>,
    pub tokens: usize,
    pub hidden_size: usize,
    pub vocab: usize,
}

fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let mut gpus = GPUS
        .get_or_init(Mutex::default)
        .lock()
        .map_err(|_| Error::Device {
            reason: "a previous call panicked while opening a GPU".into(),
        })?;
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Arc::new(Gpu::new(ordinal)?);
    gpus.insert(ordinal, g.clone());
    Ok(g)
}

/// Runs `work` on a [`DeviceHead`] over the borrowed buffers of `p`, on PyTorch's stream.
pub fn with_device_head<E: GpuElement, R>(
    p: DevicePtrs,
    work: impl FnOnce(&mut dyn Head) -> Result<R>,
) -> Result<R> {
    let base = gpu(p.ordinal)?;
    let (n, h, v) = (p.tokens, p.hidden_size, p.vocab);
    // SAFETY: the Python side passes PyTorch's current stream of this device and
    // contiguous tensors of these sizes and dtypes (checked there and in `Tensor`),
    // which it keeps alive, and does not touch, for the length of the call; the
    // gradient buffers are fresh allocations.
    unsafe {
        let gpu = base.on_borrowed_stream(p.stream as cudarc::driver::sys::CUstream);
        let head = GpuHead::<E> {
            hidden: gpu.borrow(p.hidden, n * h),
            weight: gpu.borrow(p.weight, v * h),
            bias: p.bias.map(|b| gpu.borrow(b, v)),
            tokens: n,
            hidden_size: h,
            vocab: v,
        };
        let mut grads = GpuGrads {
            dhidden: gpu.borrow(p.dhidden, n * h),
            dweight: gpu.borrow(p.dweight, v * h),
            dbias: p.dbias.map(|b| gpu.borrow(b, v)),
        };
        let mut ws = GpuWorkspace::new(&gpu)?;
        let result = work(&mut DeviceHead {
            gpu: &gpu,
            head: &head,
            ws: &mut ws,
            grads: &mut grads,
            materialized: false,
        });
        // The gradients are PyTorch's once the stream reaches this point; wait so that
        // errors of the kernels surface here.
        gpu.synchronize()?;
        result
    }
}
