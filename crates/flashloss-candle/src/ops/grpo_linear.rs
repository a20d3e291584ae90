//! The fused linear GRPO loss as a candle `CustomOp2` on `(hidden, weight)`.

use super::head_op::{HeadLoss, HeadOp, SavedGrads, device, wrap};
use candle_core::{Result, Tensor};
use flashloss::device::GrpoCall;
use flashloss::policy::GrpoMetrics;
use flashloss::{Element, FusedOptions, GrpoBatchData, GrpoLoss, LinearInputs, RowStats};
use std::sync::{Arc, Mutex};

/// What a GRPO forward reports besides the loss tensor.
#[derive(Debug, Clone, Default)]
pub struct GrpoStep {
    /// The loss `L`.
    pub loss: f64,
    /// KL, clip ratios, entropy (masked means).
    pub metrics: GrpoMetrics,
    /// Per-token `logp` `[B, T]` (0 where masked).
    pub logp: Vec<f32>,
    /// Per-token entropy `[B, T]` (0 where masked).
    pub entropy: Vec<f32>,
}

impl GrpoStep {
    /// The step of a kernel's loss, metrics and per-row statistics.
    pub(crate) fn from_stats(loss: f64, metrics: GrpoMetrics, stats: &[RowStats]) -> Self {
        GrpoStep {
            loss,
            metrics,
            logp: stats.iter().map(|s| s.logp).collect(),
            entropy: stats.iter().map(|s| s.entropy).collect(),
        }
    }
}

struct FusedGrpoLinear {
    loss: GrpoLoss,
    inputs: GrpoBatchData,
    budget_bytes: usize,
    step: Arc<Mutex<GrpoStep>>,
}

impl HeadLoss for FusedGrpoLinear {
    const NAME: &'static str = "flashloss-grpo-linear";

    fn run<E: Element>(&self, inputs: &LinearInputs<E>, grads: &SavedGrads) -> Result<f32> {
        let opts = FusedOptions {
            budget_bytes: Some(self.budget_bytes),
            ..FusedOptions::default()
        };
        let batch = self.inputs.batch();
        let out = device()
            .with_host_grads(inputs, GrpoCall::new(&self.loss, &batch, &opts))
            .map_err(wrap)?;
        grads.store(out.grads.dhidden, out.grads.dweight);
        *self.step.lock().expect("grpo step lock") =
            GrpoStep::from_stats(out.loss, out.metrics, &out.stats);
        Ok(out.loss as f32)
    }
}

/// The GRPO loss of `inputs` on logits `hidden · weightᵀ` (hidden `[B·T, H]`, weight
/// `[V, H]`, f32 or bf16), as a scalar f32 tensor that backpropagates into both, with
/// the step's metrics and per-token log-probs. The fused kernel runs within
/// `budget_bytes` of logit workspace.
pub fn grpo_linear(
    hidden: &Tensor,
    weight: &Tensor,
    loss: &GrpoLoss,
    inputs: GrpoBatchData,
    budget_bytes: usize,
) -> Result<(Tensor, GrpoStep)> {
    let step = Arc::new(Mutex::new(GrpoStep::default()));
    let op = HeadOp {
        loss: FusedGrpoLinear {
            loss: loss.clone(),
            inputs,
            budget_bytes,
            step: step.clone(),
        },
        grads: SavedGrads::default(),
    };
    let out = hidden.contiguous()?.apply_op2(&weight.contiguous()?, op)?;
    let step = step.lock().expect("grpo step lock").clone();
    Ok((out, step))
}
