//! The GPU arm of the front door ([`crate::Device`]): a call's head in host memory
//! (copied to the device, the gradients added back into the caller's buffers) or in
//! borrowed device buffers (a framework's tensors, on its stream), run with the
//! device's kept [`GpuWorkspace`] (cuBLAS handle and tiles), which is bound to the
//! call's stream for the length of the call.

use super::cuda_head::CudaHead;
use super::device::{Gpu, GpuElement, device_error};
use super::grpo_logits::{grpo_logits_backward, grpo_logits_forward};
use super::head::{GpuGrads, GpuInputs, GpuWorkspace};
use super::memory::DeviceAllocator;
use crate::batch::{GrpoBatch, LinearInputs, LogitsLayout};
use crate::element::{DType, Element};
use crate::error::{Error, Result};
use crate::fused::{Head, HeadGrad, LinearGradsMut};
use crate::grpo_config::GrpoLoss;
use crate::grpo_logits::GrpoLogitsForward;
use crate::weight_layout::WeightLayout;
use half::bf16;
use std::sync::Arc;

/// Device addresses of an LM head (`hidden [N, H]`, `weight [V, H]` or `[H, V]`
/// ([`BorrowedHead::with_layout`]) in the call's element type, an f32 `bias [V]`) and of its f32 gradient buffers (no `dweight` or
/// `dbias` for a frozen head; none at all for a call without gradients, e.g. log-probs),
/// memory the caller owns, with the stream the caller orders its work on, and the
/// allocator that lends the call its buffers, if any ([`BorrowedHead::lent_by`]).
#[derive(Clone)]
pub struct BorrowedHead {
    stream: usize,
    hidden: u64,
    weight: u64,
    bias: Option<u64>,
    /// `None`: no gradient buffers ([`BorrowedHead::without_grads`]).
    dhidden: Option<u64>,
    dweight: Option<u64>,
    dbias: Option<u64>,
    tokens: usize,
    hidden_size: usize,
    vocab: usize,
    layout: WeightLayout,
    lender: Option<Arc<dyn DeviceAllocator>>,
}

impl std::fmt::Debug for BorrowedHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, h, v) = (self.tokens, self.hidden_size, self.vocab);
        let lent = self.lender.is_some();
        write!(
            f,
            "BorrowedHead([N={n}, H={h}, V={v}], lent buffers: {lent})"
        )
    }
}

impl BorrowedHead {
    /// A head of `tokens × hidden_size` hidden states and `vocab` weight rows.
    ///
    /// # Safety
    /// Every address must hold its buffer's elements (contiguous, on the GPU of the
    /// device it is given to) alive and untouched by anything else until the call that
    /// takes this head returns; `stream` (a `CUstream`) must be a live stream of that
    /// GPU's primary context; the gradient buffers hold f32 and may be added into.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        stream: usize,
        hidden: u64,
        weight: u64,
        bias: Option<u64>,
        dhidden: u64,
        dweight: Option<u64>,
        dbias: Option<u64>,
        (tokens, hidden_size, vocab): (usize, usize, usize),
    ) -> Self {
        BorrowedHead {
            stream,
            hidden,
            weight,
            bias,
            dhidden: Some(dhidden),
            dweight,
            dbias,
            tokens,
            hidden_size,
            vocab,
            layout: WeightLayout::VocabMajor,
            lender: None,
        }
    }

    /// A head without gradient buffers (a call that forms no gradient: log-probs).
    ///
    /// # Safety
    /// As [`BorrowedHead::new`]'s, for the head's buffers and `stream`.
    pub unsafe fn without_grads(
        stream: usize,
        (hidden, weight, bias): (u64, u64, Option<u64>),
        (tokens, hidden_size, vocab): (usize, usize, usize),
    ) -> Self {
        BorrowedHead {
            stream,
            hidden,
            weight,
            bias,
            dhidden: None,
            dweight: None,
            dbias: None,
            tokens,
            hidden_size,
            vocab,
            layout: WeightLayout::VocabMajor,
            lender: None,
        }
    }
}

impl BorrowedHead {
    /// The same head with its weight (and `dweight`) laid out as `layout` (`[V, H]` by
    /// default).
    pub fn with_layout(mut self, layout: WeightLayout) -> Self {
        self.layout = layout;
        self
    }

    /// The same head with every buffer the call allocates (its O(N) states and
    /// coefficients, the fused tiles) lent by `lender` for the length of the call (e.g.
    /// PyTorch's caching allocator on the call's stream) instead of the device's own
    /// allocations; the device keeps no tile from such a call.
    pub fn lent_by(mut self, lender: Arc<dyn DeviceAllocator>) -> Self {
        self.lender = Some(lender);
        self
    }
}

/// The device's workspace (made on first use on `base`, the device's own GPU, so that its
/// cuBLAS workspace is never lent), bound to `gpu`'s stream.
fn workspace<'w>(
    base: &Gpu,
    gpu: &Gpu,
    ws: &'w mut Option<GpuWorkspace>,
) -> Result<&'w mut GpuWorkspace> {
    if ws.is_none() {
        *ws = Some(GpuWorkspace::new(base)?);
    }
    let ws = ws.as_mut().expect("made above");
    ws.bind(gpu)?;
    Ok(ws)
}

/// `inputs` viewed as elements of type `T` (`as_t`: the slice itself when `E` is `T`).
fn cast<'a, E, T>(
    inputs: &LinearInputs<'a, E>,
    as_t: fn(&'a [E]) -> Option<&'a [T]>,
) -> Option<LinearInputs<'a, T>> {
    Some(LinearInputs {
        hidden: as_t(inputs.hidden)?,
        weight: as_t(inputs.weight)?,
        bias: match inputs.bias {
            Some(b) => Some(as_t(b)?),
            None => None,
        },
        tokens: inputs.tokens,
        hidden_size: inputs.hidden_size,
        vocab: inputs.vocab,
        layout: inputs.layout,
    })
}

/// Runs `work` on a device copy of host `inputs` (f32 or bf16; f16 widened to f32); the
/// gradients (when `grads` has buffers) are added back into `grads`.
pub(crate) fn run_on_host_buffers<E: Element, R>(
    gpu: &Gpu,
    ws: &mut Option<GpuWorkspace>,
    inputs: &LinearInputs<E>,
    grads: LinearGradsMut,
    work: impl FnOnce(&mut dyn Head) -> Result<R>,
) -> Result<R> {
    fn typed<T: GpuElement, R>(
        gpu: &Gpu,
        ws: &mut Option<GpuWorkspace>,
        inputs: &LinearInputs<T>,
        grads: LinearGradsMut,
        work: impl FnOnce(&mut dyn Head) -> Result<R>,
    ) -> Result<R> {
        let head = GpuInputs::upload(gpu, inputs)?;
        let with_grads = !(grads.dhidden.is_empty() && grads.dweight.is_empty());
        // Host buffers without dW are a frozen head's (the driver checks them against
        // the options).
        let head_grad = match grads.dweight.is_empty() {
            true => HeadGrad::Frozen,
            false => HeadGrad::Full,
        };
        let mut device_grads = match with_grads {
            true => {
                grads.check(inputs, head_grad)?;
                Some(GpuGrads::zeros(gpu, &head, head_grad)?)
            }
            false => None,
        };
        let out = work(&mut CudaHead {
            gpu,
            head: &head,
            ws: workspace(gpu, gpu, ws)?,
            grads: device_grads.as_mut(),
            materialized: false,
        })?;
        if let Some(d) = device_grads {
            let host = d.download(gpu)?;
            let add = |dst: &mut [f32], src: &[f32]| {
                dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
            };
            add(grads.dhidden, &host.dhidden);
            add(grads.dweight, &host.dweight);
            if let (Some(dst), Some(src)) = (grads.dbias, host.dbias.as_deref()) {
                add(dst, src);
            }
        }
        Ok(out)
    }
    if let Some(inputs) = cast(inputs, E::as_f32) {
        return typed::<f32, R>(gpu, ws, &inputs, grads, work);
    }
    if let Some(inputs) = cast(inputs, E::as_bf16) {
        return typed::<bf16, R>(gpu, ws, &inputs, grads, work);
    }
    // f16: widened to f32 (exact) on the host, so its products run on the widened
    // operands, as the CPU's do.
    let widen = |x: &[E]| -> Vec<f32> { x.iter().map(|v| v.to_f32()).collect() };
    let (hidden, weight) = (widen(inputs.hidden), widen(inputs.weight));
    let bias = inputs.bias.map(widen);
    let wide = LinearInputs {
        hidden: &hidden,
        weight: &weight,
        bias: bias.as_deref(),
        tokens: inputs.tokens,
        hidden_size: inputs.hidden_size,
        vocab: inputs.vocab,
        layout: inputs.layout,
    };
    typed::<f32, R>(gpu, ws, &wide, grads, work)
}

/// Runs `work` on a [`CudaHead`] over the borrowed buffers of `b` (elements of
/// `dtype`), on the caller's stream, and waits for that stream so that errors of the
/// kernels surface here and the kept workspace is idle before it goes back to the
/// device's own stream. With a lender, the call's buffers and tiles are lent by it and
/// given back before returning, error or not (the tiles kept from earlier calls are let
/// go first, so that the call's come from the lender).
pub(crate) fn run_on_borrowed<R>(
    base: &Gpu,
    ws: &mut Option<GpuWorkspace>,
    b: BorrowedHead,
    dtype: DType,
    work: impl FnOnce(&mut dyn Head) -> Result<R>,
) -> Result<R> {
    fn typed<T: GpuElement, R>(
        base: &Gpu,
        ws: &mut Option<GpuWorkspace>,
        b: BorrowedHead,
        work: impl FnOnce(&mut dyn Head) -> Result<R>,
    ) -> Result<R> {
        let (n, h, v) = (b.tokens, b.hidden_size, b.vocab);
        // SAFETY: `BorrowedHead::new`'s contract: live buffers of these sizes on this
        // GPU, and a live stream of its primary context, for the length of the call.
        let gpu = unsafe { base.on_borrowed_stream(b.stream as cudarc::driver::sys::CUstream) };
        let gpu = match b.lender.clone() {
            Some(lender) => gpu.lending(lender),
            None => gpu,
        };
        // SAFETY: as above.
        let (head, mut grads) = unsafe {
            let head = GpuInputs::<T> {
                hidden: gpu.borrow(b.hidden, n * h),
                weight: gpu.borrow(b.weight, v * h),
                bias: b.bias.map(|p| gpu.borrow(p, v)),
                tokens: n,
                hidden_size: h,
                vocab: v,
                layout: b.layout,
            };
            let grads = b.dhidden.map(|dhidden| GpuGrads {
                dhidden: gpu.borrow(dhidden, n * h),
                dweight: b.dweight.map(|p| gpu.borrow(p, v * h)),
                dbias: b.dbias.map(|p| gpu.borrow(p, v)),
            });
            (head, grads)
        };
        let result = workspace(base, &gpu, ws).and_then(|kept| {
            if gpu.is_lending() {
                kept.release_tiles();
            }
            work(&mut CudaHead {
                gpu: &gpu,
                head: &head,
                ws: kept,
                grads: grads.as_mut(),
                materialized: false,
            })
        });
        let synced = gpu.synchronize();
        if let (true, Some(kept)) = (gpu.is_lending(), ws.as_mut()) {
            kept.release_tiles();
        }
        // The workspace goes back to the device's own stream, which outlives it.
        let rebound = match ws.as_mut() {
            Some(kept) => kept.bind(base),
            None => Ok(()),
        };
        let out = result?;
        synced?;
        rebound?;
        Ok(out)
    }
    let previous = cudarc::driver::result::ctx::get_current()
        .map_err(|e| device_error("cuCtxGetCurrent", e))?;
    let out = match dtype {
        DType::F32 => typed::<f32, R>(base, ws, b, work),
        DType::Bf16 => typed::<bf16, R>(base, ws, b, work),
        DType::F16 => Err(Error::InvalidArgument {
            arg: "hidden",
            reason: "the CUDA backend takes f32 or bf16, not F16 (widen float16 first)".into(),
        }),
    };
    if let Some(ctx) = previous {
        // SAFETY: `ctx` was current on this thread when the call began.
        unsafe { cudarc::driver::result::ctx::set_current(ctx) }
            .map_err(|e| device_error("cuCtxSetCurrent", e))?;
    }
    out
}

/// The logits-level step on a device copy of host `logits` (f32 or bf16, f16 as f32; the
/// copies are exact), turned into the gradient in place on the device and copied into `dlogits`
/// (dense `[N, V]`).
pub(crate) fn grpo_logits_host<E: Element>(
    gpu: &Gpu,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
    grad_output: f32,
    dlogits: &mut [E],
) -> Result<GrpoLogitsForward> {
    fn typed<T: GpuElement, E: Element>(
        gpu: &Gpu,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &[E],
        layout: &LogitsLayout,
        grad_output: f32,
        dlogits: &mut [E],
    ) -> Result<GrpoLogitsForward> {
        layout.validate_dense("dlogits", dlogits.len())?;
        let z: Vec<T> = logits.iter().map(|v| T::from_f32(v.to_f32())).collect();
        let mut device_logits = gpu.upload(&z)?;
        let fwd = grpo_logits_forward(gpu, loss, batch, &device_logits, layout)?;
        grpo_logits_backward(gpu, &fwd, &mut device_logits, grad_output, None)?;
        let grad = gpu.download(&device_logits)?;
        dlogits
            .iter_mut()
            .zip(grad)
            .for_each(|(o, g)| *o = E::from_f32(g.to_f32()));
        Ok(fwd)
    }
    match E::DTYPE {
        DType::F32 => typed::<f32, E>(gpu, loss, batch, logits, layout, grad_output, dlogits),
        DType::Bf16 => typed::<bf16, E>(gpu, loss, batch, logits, layout, grad_output, dlogits),
        // f16 host logits go up widened to f32 (exact), the gradient comes back rounded.
        DType::F16 => typed::<f32, E>(gpu, loss, batch, logits, layout, grad_output, dlogits),
    }
}
