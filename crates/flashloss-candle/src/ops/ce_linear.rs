//! The fused linear cross-entropy as a candle `CustomOp2` on `(hidden, weight)`.

use super::head_op::{HeadLoss, HeadOp, SavedGrads, device, wrap};
use candle_core::{Result, Tensor};
use flashloss::device::CeCall;
use flashloss::{CrossEntropy, Element, FusedOptions, LinearInputs, Reduction};

struct FusedCeLinear {
    ce: CrossEntropy,
    targets: Vec<i64>,
    budget_bytes: usize,
}

impl HeadLoss for FusedCeLinear {
    const NAME: &'static str = "flashloss-ce-linear";

    fn run<E: Element>(&self, inputs: &LinearInputs<E>, grads: &SavedGrads) -> Result<f32> {
        let opts = FusedOptions {
            budget_bytes: Some(self.budget_bytes),
            ..FusedOptions::default()
        };
        let out = device()
            .with_host_grads(inputs, CeCall::new(&self.ce, &self.targets, &opts))
            .map_err(wrap)?;
        grads.store(out.grads.dhidden, out.grads.dweight);
        Ok(out.loss as f32)
    }
}

/// The cross-entropy of logits `hidden · weightᵀ` (hidden `[N, H]`, weight `[V, H]`)
/// at `targets` `[N]` (rows at `ignore_index` take no part), reduced by mean or sum,
/// as a scalar f32 tensor that backpropagates into both. Reduction `none` is not an
/// op output: use the kernel (`flashloss::cpu::ce_linear_into`) with per-row gradients.
pub fn ce_linear(
    hidden: &Tensor,
    weight: &Tensor,
    ce: &CrossEntropy,
    targets: Vec<i64>,
    budget_bytes: usize,
) -> Result<Tensor> {
    if ce.config().reduction == Reduction::None {
        candle_core::bail!("ce.reduction: the candle op returns a scalar; use mean or sum")
    }
    let op = HeadOp {
        loss: FusedCeLinear {
            ce: ce.clone(),
            targets,
            budget_bytes,
        },
        grads: SavedGrads::default(),
    };
    hidden.contiguous()?.apply_op2(&weight.contiguous()?, op)
}
