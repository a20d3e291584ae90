//! One entry point per loss over a [`Device`]: the fused LM-head losses on inputs in
//! host memory, run on the CPU or on a GPU (copied there and back), with the gradients
//! returned in host memory. Callers with device buffers build a `cuda::DeviceHead` and
//! call the drivers of [`crate::fused`] directly; the tools and the candle ops call
//! these.

use crate::batch::LogitsLayout;
use crate::batch::{GrpoBatch, LinearInputs};
use crate::config::GrpoLoss;
use crate::cpu::{HostHead, Workspace};
use crate::cross_entropy::CrossEntropy;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::fused::{
    self, CeLinearOutput, FusedOptions, Grid, GrpoLinearOutput, Head, LinearGrads, Shard,
};
use crate::grpo_logits::GrpoLogitsForward;
use crate::policy::Normalizers;
use crate::range::check_linear_grads;
use crate::rows::RowStats;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// Where a kernel runs.
#[derive(Clone)]
pub enum Device {
    /// The CPU backend (rayon over the global thread pool).
    Cpu,
    /// A GPU of the CUDA backend.
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::cuda::Gpu>),
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            #[cfg(feature = "cuda")]
            Device::Cuda(gpu) => write!(f, "cuda ({})", gpu.arch()),
        }
    }
}

impl Device {
    /// GPU `ordinal` (a build with the `cuda` feature and an NVIDIA driver).
    pub fn cuda(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            Ok(Device::Cuda(Arc::new(crate::cuda::Gpu::new(ordinal)?)))
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::InvalidArgument {
                arg: "device",
                reason: format!(
                    "cuda:{ordinal} needs a build with `--features cuda` (this one has the CPU backend only)"
                ),
            })
        }
    }

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    pub fn parse(name: &str) -> Result<Device> {
        match name {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Device::cuda(0),
            _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Device::cuda(ordinal),
                _ => Err(Error::InvalidArgument {
                    arg: "device",
                    reason: format!("unknown device {name:?}: use cpu, cuda or cuda:N"),
                }),
            },
        }
    }

    /// Runs `run` on a head of `inputs` on this device, with zeroed gradients; returns
    /// its result and the gradients in host memory.
    fn with_head<E: Element, R>(
        &self,
        inputs: &LinearInputs<E>,
        run: impl FnOnce(&mut dyn Head) -> Result<R>,
    ) -> Result<(R, LinearGrads)> {
        match self {
            Device::Cpu => {
                let mut grads = LinearGrads::zeros(inputs);
                let out = run(&mut HostHead {
                    inputs,
                    ws: &mut Workspace::new(),
                    grads: grads.view(),
                })?;
                Ok((out, grads))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(gpu) => gpu_head::with_device_head(gpu, inputs, run),
        }
    }

    /// The GRPO loss of `batch` (N = B·T rows) on logits `hidden · weightᵀ + bias`,
    /// with normalizers `norm` (usually [`Normalizers::local`]), and `grad_output ·` its
    /// gradients in `grads`.
    pub fn grpo_linear<E: Element>(
        &self,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        norm: Normalizers,
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<GrpoLinearOutput> {
        let (out, grads) = self.with_head(inputs, |head| {
            fused::grpo_linear(head, loss, batch, norm, opts)
        })?;
        let (dh, dw, db) = (&grads.dhidden, &grads.dweight, grads.dbias.as_deref());
        check_linear_grads(dh, dw, db, inputs.hidden_size, batch.seq_len)?;
        Ok(GrpoLinearOutput { grads, ..out })
    }

    /// The cross-entropy of `hidden · weightᵀ + bias` at `targets` `[N]`, with its
    /// gradients; `grad_rows` as in [`fused::ce_linear`].
    pub fn ce_linear<E: Element>(
        &self,
        ce: &CrossEntropy,
        targets: &[i64],
        grad_rows: Option<&[f32]>,
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        let (out, grads) = self.with_head(inputs, |head| {
            fused::ce_linear(head, ce, targets, grad_rows, opts)
        })?;
        let (dh, dw, db) = (&grads.dhidden, &grads.dweight, grads.dbias.as_deref());
        check_linear_grads(dh, dw, db, inputs.hidden_size, targets.len())?;
        Ok(CeLinearOutput { grads, ..out })
    }

    /// Per-row `logp`, `lse` and entropy of `(hidden · weightᵀ + bias) / temperature`
    /// at `targets` (see [`fused::logp_linear`]).
    pub fn logp_linear<E: Element>(
        &self,
        inputs: &LinearInputs<E>,
        targets: &[i64],
        mask: Option<&[bool]>,
        temperature: f64,
        budget_bytes: usize,
        seq_len: usize,
    ) -> Result<Vec<RowStats>> {
        let (stats, _) = self.with_head(inputs, |head| {
            fused::logp_linear(head, targets, mask, temperature, budget_bytes, seq_len)
        })?;
        Ok(stats)
    }

    /// The logits-level GRPO loss of `batch` on host logits `[B, T, V]` laid out as
    /// `layout`, forward and backward: `grad_output · ∂L/∂z` is written into `dlogits`
    /// (dense `[N, V]`), or over `logits` when `dlogits` is `None`. Returns the
    /// forward's outputs (loss, metrics, per-row statistics).
    pub fn grpo_logits<E: Element>(
        &self,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &mut [E],
        layout: &LogitsLayout,
        grad_output: f32,
        dlogits: Option<&mut [E]>,
    ) -> Result<GrpoLogitsForward> {
        match self {
            Device::Cpu => {
                let fwd = crate::cpu::grpo_logits_forward(loss, batch, logits, layout)?;
                match dlogits {
                    Some(d) => fwd.backward(logits, grad_output, d)?,
                    None => fwd.backward_in_place(logits, grad_output)?,
                }
                Ok(fwd)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(gpu) => {
                gpu_head::grpo_logits(gpu, loss, batch, logits, layout, grad_output, dlogits)
            }
        }
    }

    /// GRPO on a [`Grid`] of ranks: this rank's token group's `batch` and its head
    /// `inputs`, the [`Shard`] of the vocabulary its weight rows hold (see
    /// [`fused::grpo_linear_sharded`]).
    pub fn grpo_linear_sharded<E: Element>(
        &self,
        grid: &Grid,
        shard: Shard,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<GrpoLinearOutput> {
        let (out, grads) = self.with_head(inputs, |head| {
            fused::grpo_linear_sharded(grid, head, shard, loss, batch, opts)
        })?;
        Ok(GrpoLinearOutput { grads, ..out })
    }

    /// Cross-entropy on a [`Grid`] of ranks (see [`fused::ce_linear_sharded`]).
    pub fn ce_linear_sharded<E: Element>(
        &self,
        grid: &Grid,
        shard: Shard,
        ce: &CrossEntropy,
        targets: &[i64],
        inputs: &LinearInputs<E>,
        opts: &FusedOptions,
    ) -> Result<CeLinearOutput> {
        let (out, grads) = self.with_head(inputs, |head| {
            fused::ce_linear_sharded(grid, head, shard, ce, targets, opts)
        })?;
        Ok(CeLinearOutput { grads, ..out })
    }
}

#[cfg(feature = "cuda")]
mod gpu_head {
    use super::*;
    use crate::cuda::{
        DeviceHead, Gpu, GpuElement, GpuGrads, GpuHead, GpuWorkspace, grpo_logits_backward,
        grpo_logits_forward,
    };
    use crate::element::DType;
    use half::bf16;

    /// The logits-level step on a device copy of `logits` (f32 or bf16; the copies are
    /// exact), the gradient copied back into `dlogits` or `logits`.
    pub(super) fn grpo_logits<E: Element>(
        gpu: &Gpu,
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        logits: &mut [E],
        layout: &LogitsLayout,
        grad_output: f32,
        dlogits: Option<&mut [E]>,
    ) -> Result<GrpoLogitsForward> {
        fn typed<T: GpuElement, E: Element>(
            gpu: &Gpu,
            loss: &GrpoLoss,
            batch: &GrpoBatch,
            logits: &mut [E],
            layout: &LogitsLayout,
            grad_output: f32,
            dlogits: Option<&mut [E]>,
        ) -> Result<GrpoLogitsForward> {
            let to_t = |x: &[E]| -> Vec<T> { x.iter().map(|v| T::from_f32(v.to_f32())).collect() };
            let mut device_logits = gpu.upload(&to_t(logits))?;
            let fwd = grpo_logits_forward(gpu, loss, batch, &device_logits, layout)?;
            let (grad, out) = match dlogits {
                Some(d) => {
                    let mut device_d = gpu.upload(&to_t(d))?;
                    let g = Some(&mut device_d);
                    grpo_logits_backward(gpu, &fwd, &mut device_logits, grad_output, g)?;
                    (gpu.download(&device_d)?, d)
                }
                None => {
                    grpo_logits_backward(gpu, &fwd, &mut device_logits, grad_output, None)?;
                    (gpu.download(&device_logits)?, logits)
                }
            };
            out.iter_mut()
                .zip(grad)
                .for_each(|(o, g)| *o = E::from_f32(g.to_f32()));
            Ok(fwd)
        }
        match E::DTYPE {
            DType::F32 => typed::<f32, E>(gpu, loss, batch, logits, layout, grad_output, dlogits),
            DType::Bf16 => typed::<bf16, E>(gpu, loss, batch, logits, layout, grad_output, dlogits),
        }
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
        })
    }

    /// `run` on a device copy of `inputs` (f32 or bf16), the gradients copied back.
    pub(super) fn with_device_head<E: Element, R>(
        gpu: &Gpu,
        inputs: &LinearInputs<E>,
        run: impl FnOnce(&mut dyn Head) -> Result<R>,
    ) -> Result<(R, LinearGrads)> {
        fn typed<T: GpuElement, R>(
            gpu: &Gpu,
            inputs: &LinearInputs<T>,
            run: impl FnOnce(&mut dyn Head) -> Result<R>,
        ) -> Result<(R, LinearGrads)> {
            let head = GpuHead::upload(gpu, inputs)?;
            let mut ws = GpuWorkspace::new(gpu)?;
            let mut grads = GpuGrads::zeros(gpu, &head)?;
            let out = run(&mut DeviceHead {
                gpu,
                head: &head,
                ws: &mut ws,
                grads: &mut grads,
                materialized: false,
            })?;
            Ok((out, grads.download(gpu)?))
        }
        if let Some(inputs) = cast(inputs, E::as_f32) {
            return typed::<f32, R>(gpu, &inputs, run);
        }
        match cast(inputs, E::as_bf16) {
            Some(inputs) => typed::<half::bf16, R>(gpu, &inputs, run),
            None => Err(Error::InvalidArgument {
                arg: "hidden",
                reason: format!("the CUDA backend takes f32 or bf16, not {:?}", E::DTYPE),
            }),
        }
    }
}
