//! The logits-level GRPO loss as a candle `CustomOp1` on `logits [B·T, V]`: the forward
//! runs the kernel's forward and backward in one call (the `[N, V]` gradient at an upstream
//! gradient of 1), the backward scales it.

use super::grpo_linear::GrpoStep;
use super::head_op::{contiguous, device, matrix_dims, wrap};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, WithDType};
use flashloss::{Element, GrpoBatchData, GrpoLogitsForward, GrpoLoss, LogitsLayout};
use std::sync::{Arc, Mutex};

/// What the forward leaves for the backward: its outputs and `∂L/∂z` (at an upstream
/// gradient of 1).
type Saved = Option<(GrpoLogitsForward, Tensor)>;

struct GrpoLogits {
    loss: GrpoLoss,
    inputs: GrpoBatchData,
    saved: Arc<Mutex<Saved>>,
}

impl GrpoLogits {
    /// The loss and gradient of `logits` in one kernel call ([`flashloss::Device::grpo_logits`]).
    fn run<E: Element + WithDType>(
        &self,
        logits: &[E],
        shape: &LogitsLayout,
        dims: (usize, usize),
    ) -> Result<(GrpoLogitsForward, Tensor)> {
        let batch = self.inputs.batch();
        let mut dz = vec![E::from_f32(f32::NAN); logits.len()];
        let fwd = device()
            .grpo_logits(&self.loss, &batch, logits, shape, 1.0, &mut dz)
            .map_err(wrap)?;
        Ok((fwd, Tensor::from_vec(dz, dims, &candle_core::Device::Cpu)?))
    }
}

impl CustomOp1 for GrpoLogits {
    fn name(&self) -> &'static str {
        "flashloss-grpo-logits"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = matrix_dims(layout, "logits")?;
        let shape = LogitsLayout::contiguous(self.inputs.batch, self.inputs.seq_len, v);
        let (fwd, dz) = match storage {
            CpuStorage::F32(_) => self.run(
                contiguous::<f32>(storage, layout, "logits")?,
                &shape,
                (n, v),
            ),
            CpuStorage::BF16(_) => self.run(
                contiguous::<half::bf16>(storage, layout, "logits")?,
                &shape,
                (n, v),
            ),
            s => candle_core::bail!("logits: must be f32 or bf16, got {:?}", s.dtype()),
        }?;
        let loss = fwd.loss as f32;
        *self.saved.lock().expect("grpo logits lock") = Some((fwd, dz));
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(&self, logits: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let guard = self.saved.lock().expect("grpo logits lock");
        let Some((_, dz)) = guard.as_ref() else {
            candle_core::bail!("{}: backward before forward", self.name())
        };
        let g = grad_res.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let dz = if g == 1.0 {
            dz.clone()
        } else {
            (dz.to_dtype(DType::F32)? * g as f64)?
        };
        Ok(Some(dz.to_dtype(logits.dtype())?.reshape(logits.shape())?))
    }
}

/// The GRPO loss of `inputs` on `logits` `[B·T, V]` (f32 or bf16) as a scalar f32
/// tensor that backpropagates into the logits (the `[N, V]` gradient is written by
/// the kernel, never built from autograd intermediates).
pub fn grpo_logits(
    logits: &Tensor,
    loss: &GrpoLoss,
    inputs: GrpoBatchData,
) -> Result<(Tensor, GrpoStep)> {
    let saved = Arc::new(Mutex::new(None));
    let op = GrpoLogits {
        loss: loss.clone(),
        inputs,
        saved: saved.clone(),
    };
    let out = logits.contiguous()?.apply_op1(op)?;
    let guard = saved.lock().expect("grpo logits lock");
    let (fwd, _) = guard.as_ref().expect("forward ran");
    let step = GrpoStep::from_stats(fwd.loss, fwd.metrics, &fwd.stats);
    Ok((out, step))
}
