//! Fused linear GRPO on the GPU: the loss and the head's gradients straight from
//! hidden states and weight on the device, never holding `[N, V]` (the passes of
//! [`super::fused_linear`], the policy stage of the CPU backend in between).
//! Token-level losses run single-pass (6NHV) when the budget holds a useful row block;
//! sequence-level ratios and vespo run two-pass (8NHV).

use super::device::{Gpu, GpuElement};
use super::fused_linear::{GpuGrads, GpuHead, GpuPasses, GpuWorkspace, RowInputs, plan};
use crate::batch::GrpoBatch;
use crate::config::GrpoLoss;
use crate::cpu::{FusedOptions, GrpoLinearOutput, check_grpo_batch, grpo_fused};
use crate::error::Result;
use crate::policy::Normalizers;

/// The GRPO loss of `batch` (N = B·T rows, per-token inputs on the host) on logits
/// `hidden · weightᵀ + bias` of a device head, its gradients added into `grads`, within
/// `opts.budget_bytes` of device workspace. The returned output's `grads` is empty.
#[allow(clippy::too_many_arguments)]
pub fn grpo_linear_into<E: GpuElement>(
    gpu: &Gpu,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    head: &GpuHead<E>,
    opts: &FusedOptions,
    ws: &mut GpuWorkspace,
    grads: &mut GpuGrads,
) -> Result<GrpoLinearOutput> {
    let plan = plan(
        head.tokens,
        head.vocab,
        E::DTYPE,
        opts,
        !loss.needs_sequence_reduction(),
    )?;
    grpo_linear_planned(gpu, loss, batch, norm, head, opts, plan, ws, grads)
}

/// [`grpo_linear_into`] with a given plan (the unfused baseline runs
/// [`super::materialized_plan`]).
#[allow(clippy::too_many_arguments)]
pub fn grpo_linear_planned<E: GpuElement>(
    gpu: &Gpu,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    head: &GpuHead<E>,
    opts: &FusedOptions,
    plan: crate::cpu::Plan,
    ws: &mut GpuWorkspace,
    grads: &mut GpuGrads,
) -> Result<GrpoLinearOutput> {
    check_grpo_batch(loss, batch, head.tokens, head.vocab, opts)?;
    let temperature = loss.config().temperature;
    let rows = RowInputs {
        targets: batch.target_ids,
        live: batch.mask,
        inv_temp: (1.0 / temperature) as f32,
        softcap: None,
        mean_logit: false,
    };
    let scale = (opts.grad_output as f64 / temperature) as f32;
    let mut passes = GpuPasses::new(gpu, head, rows, plan, ws, grads)?;
    grpo_fused(loss, batch, norm, scale, &mut passes)
}
