//! Fused linear cross-entropy on the GPU: the loss of `shared/spec/losses.md`
//! ("Cross-entropy") and the head's gradients from hidden states and weight on the
//! device, never holding `[N, V]`; the per-row stage is the CPU backend's.

use super::device::{Gpu, GpuElement};
use super::fused_linear::{GpuGrads, GpuHead, GpuPasses, GpuWorkspace, RowInputs, plan};
use crate::cpu::{CeLinearOutput, CeRows, FusedOptions, Plan, ce_fused};
use crate::cross_entropy::CrossEntropy;
use crate::error::Result;

/// The cross-entropy of a device head's logits at `targets` `[N]` (host), its
/// gradients added into `grads`; `grad_rows` as in [`crate::cpu::ce_linear_into`].
/// The returned output's `grads` is empty.
#[allow(clippy::too_many_arguments)]
pub fn ce_linear_into<E: GpuElement>(
    gpu: &Gpu,
    ce: &CrossEntropy,
    targets: &[i64],
    grad_rows: Option<&[f32]>,
    head: &GpuHead<E>,
    opts: &FusedOptions,
    ws: &mut GpuWorkspace,
    grads: &mut GpuGrads,
) -> Result<CeLinearOutput> {
    let plan = plan(head.tokens, head.vocab, E::DTYPE, opts, true)?;
    ce_linear_planned(gpu, ce, targets, grad_rows, head, opts, plan, ws, grads)
}

/// [`ce_linear_into`] with a given plan (the unfused baseline runs
/// [`super::materialized_plan`]).
#[allow(clippy::too_many_arguments)]
pub fn ce_linear_planned<E: GpuElement>(
    gpu: &Gpu,
    ce: &CrossEntropy,
    targets: &[i64],
    grad_rows: Option<&[f32]>,
    head: &GpuHead<E>,
    opts: &FusedOptions,
    plan: Plan,
    ws: &mut GpuWorkspace,
    grads: &mut GpuGrads,
) -> Result<CeLinearOutput> {
    let rows = CeRows::new(
        ce,
        targets,
        head.tokens,
        head.vocab,
        opts.grad_output,
        grad_rows,
    )?;
    let c = ce.config();
    let inputs = RowInputs {
        targets: rows.targets(),
        live: rows.live(),
        inv_temp: (1.0 / c.temperature) as f32,
        softcap: c.softcap.map(|x| x as f32),
        mean_logit: c.label_smoothing > 0.0,
    };
    let mut passes = GpuPasses::new(gpu, head, inputs, plan, ws, grads)?;
    ce_fused(&rows, &mut passes)
}
