//! The logits-level GRPO loss as a candle `CustomOp1` on `logits [B·T, V]`.

use super::grpo_linear::GrpoStep;
use super::{contiguous, matrix_dims, wrap};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use flashloss::cpu::grpo_logits_forward;
use flashloss::{GrpoBatchData, GrpoLogitsForward, GrpoLoss, LogitsLayout};
use std::sync::{Arc, Mutex};

struct GrpoLogits {
    loss: GrpoLoss,
    inputs: GrpoBatchData,
    forward: Arc<Mutex<Option<GrpoLogitsForward>>>,
}

impl CustomOp1 for GrpoLogits {
    fn name(&self) -> &'static str {
        "flashloss-grpo-logits"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, v) = matrix_dims(layout, "logits")?;
        let shape = LogitsLayout::contiguous(self.inputs.batch, self.inputs.seq_len, v);
        let batch = self.inputs.batch();
        let fwd = match storage {
            CpuStorage::F32(_) => grpo_logits_forward(
                &self.loss,
                &batch,
                contiguous::<f32>(storage, layout, "logits")?,
                &shape,
            ),
            CpuStorage::BF16(_) => grpo_logits_forward(
                &self.loss,
                &batch,
                contiguous::<half::bf16>(storage, layout, "logits")?,
                &shape,
            ),
            s => candle_core::bail!("logits: must be f32 or bf16, got {:?}", s.dtype()),
        }
        .map_err(wrap)?;
        let loss = fwd.loss as f32;
        *self.forward.lock().expect("grpo logits lock") = Some(fwd);
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(&self, logits: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let guard = self.forward.lock().expect("grpo logits lock");
        let Some(fwd) = guard.as_ref() else {
            candle_core::bail!("{}: backward before forward", self.name())
        };
        let g = grad_res.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let z = logits
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut dz = vec![f32::NAN; z.len()];
        fwd.backward(&z, g, &mut dz).map_err(wrap)?;
        Ok(Some(
            Tensor::from_vec(dz, logits.shape(), logits.device())?.to_dtype(logits.dtype())?,
        ))
    }
}

/// The GRPO loss of `inputs` on `logits` `[B·T, V]` (f32 or bf16) as a scalar f32
/// tensor that backpropagates into the logits (the `[N, V]` gradient is written by
/// the kernel's backward, never built from autograd intermediates).
pub fn grpo_logits(
    logits: &Tensor,
    loss: &GrpoLoss,
    inputs: GrpoBatchData,
) -> Result<(Tensor, GrpoStep)> {
    let forward = Arc::new(Mutex::new(None));
    let op = GrpoLogits {
        loss: loss.clone(),
        inputs,
        forward: forward.clone(),
    };
    let out = logits.contiguous()?.apply_op1(op)?;
    let guard = forward.lock().expect("grpo logits lock");
    let fwd = guard.as_ref().expect("forward ran");
    let step = GrpoStep::from_stats(fwd.loss, fwd.metrics, &fwd.stats);
    Ok((out, step))
}
