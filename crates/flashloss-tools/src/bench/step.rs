//! The fused step both benches time: the configured loss on any backend's head.

use super::config::LossKind;
use flashloss::fused::{Head, ce_linear, grpo_linear};
use flashloss::policy::Normalizers;
use flashloss::{CrossEntropy, FusedOptions, GrpoBatch, GrpoLoss, Plan, Result};

/// One fused step of `kind` on `head` (GRPO of `batch`, or CE at its target ids): the
/// loss and the plan that ran. The gradients are added into the head's buffers.
pub(crate) fn fused_step(
    head: &mut dyn Head,
    kind: LossKind,
    (grpo, ce): (&GrpoLoss, &CrossEntropy),
    batch: &GrpoBatch,
    norm: Normalizers,
    opts: &FusedOptions,
) -> Result<(f64, Plan)> {
    Ok(match kind {
        LossKind::Grpo => {
            let out = grpo_linear(head, grpo, batch, norm, opts)?;
            (out.loss, out.plan)
        }
        LossKind::Ce => {
            let out = ce_linear(head, ce, batch.target_ids, None, opts)?;
            (out.loss, out.plan)
        }
    })
}
