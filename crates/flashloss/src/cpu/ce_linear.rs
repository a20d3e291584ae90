//! Fused linear cross-entropy: the loss of `shared/spec/losses.md` ("Cross-entropy")
//! and its gradients w.r.t. hidden states, LM-head weight and bias, straight from
//! `[N, H]` and `[V, H]`, never holding `[N, V]`. A token-level loss, so single-pass
//! (6NHV) whenever the budget holds a useful row block.

use super::fused_linear::{
    FusedOptions, LinearGrads, Plan, Problem, RowGrad, Workspace, accumulate_grads, plan,
    row_stats, single_pass,
};
use super::online_softmax::RowStats;
use super::selective_log_softmax::{check_row_stats, check_targets};
use crate::batch::LinearInputs;
use crate::cross_entropy::CrossEntropy;
use crate::element::Element;
use crate::error::{Error, Result};

/// Loss, per-row outputs and the LM head's gradients.
#[derive(Debug, Clone)]
pub struct CeLinearOutput {
    /// The reduced loss; for reduction `none`, `Σ_i grad_rows_i·ℓ_i` (what the
    /// gradients are of).
    pub loss: f64,
    /// The z-loss part of `loss`.
    pub z_loss: f64,
    /// Rows that are not ignored.
    pub count: usize,
    /// Per-row `ℓ_i` (0 where ignored).
    pub row_loss: Vec<f32>,
    /// Per-row `logp`, `lse`, entropy of the scaled logits (zeroed where ignored).
    pub stats: Vec<RowStats>,
    /// `grad_output ·` the gradients (empty from [`ce_linear_into`]).
    pub grads: LinearGrads,
    /// The plan that ran.
    pub plan: Plan,
}

/// The cross-entropy of `hidden · weightᵀ + bias` at `targets` `[N]`, with its
/// gradients, within `opts.budget_bytes` of workspace. Reduction `none` takes unit
/// upstream gradients per row (see [`ce_linear_into`] for others).
pub fn ce_linear<E: Element>(
    ce: &CrossEntropy,
    targets: &[i64],
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    let mut grads = LinearGrads::zeros(inputs);
    let step = ce_linear_into(
        ce,
        targets,
        None,
        inputs,
        opts,
        &mut Workspace::new(),
        &mut grads,
    )?;
    Ok(CeLinearOutput { grads, ..step })
}

/// The fused step that adds its gradients into caller-owned `grads` and reuses `ws`.
/// `grad_rows` `[N]` (reduction `none` only) is the upstream gradient of each row's
/// loss; unset means ones. The returned output's `grads` is empty.
pub fn ce_linear_into<E: Element>(
    ce: &CrossEntropy,
    targets: &[i64],
    grad_rows: Option<&[f32]>,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
    ws: &mut Workspace,
    grads: &mut LinearGrads,
) -> Result<CeLinearOutput> {
    inputs.validate()?;
    grads.check(inputs)?;
    let c = ce.config();
    let (n, v) = (inputs.tokens, inputs.vocab);
    let live: Vec<bool> = targets.iter().map(|&y| ce.counts(y)).collect();
    check_targets(targets, Some(&live), n, v, n, c.temperature)?;
    ce.check_grad_rows(grad_rows, n)?;
    if !opts.grad_output.is_finite() {
        return Err(Error::NonFinite {
            arg: "grad_output",
            index: 0,
            value: opts.grad_output as f64,
        });
    }
    let count = live.iter().filter(|&&l| l).count();
    let weight = ce.row_weight(count);
    let widen = E::as_f32(inputs.weight).is_none();
    let plan = plan(n, inputs.hidden_size, v, widen, opts, true)?;
    let p = Problem {
        inputs,
        targets,
        live: &live,
        inv_temp: (1.0 / c.temperature) as f32,
        softcap: c.softcap.map(|x| x as f32),
        mean_logit: c.label_smoothing > 0.0,
    };
    let upstream =
        |i: usize| weight * opts.grad_output as f64 * grad_rows.map_or(1.0, |g| g[i] as f64);
    // ∂ℓ/∂s_j = (1 + 2λ_z·lse)·p_j - (1-ε)·[j = y] - ε/V, and ∂s/∂z = slope / T.
    let row_grad = |i: usize, st: &RowStats| {
        if !live[i] {
            return RowGrad::default();
        }
        let scale = upstream(i) / c.temperature;
        let eps = c.label_smoothing;
        RowGrad {
            stats: *st,
            coef_p: (scale * (1.0 + 2.0 * c.z_loss * st.lse as f64)) as f32,
            coef_h: 0.0,
            coef_uniform: (-scale * eps / v as f64) as f32,
            coef_target: (-scale * (1.0 - eps)) as f32,
            target: targets[i] as usize,
        }
    };
    let stats = if plan.single_pass {
        let mut grads_of = |rows: std::ops::Range<usize>, stats: &[RowStats]| {
            rows.map(|i| row_grad(i, &stats[i])).collect()
        };
        single_pass(&p, &plan, &mut grads_of, ws, grads)
    } else {
        let stats = row_stats(&p, &plan, ws);
        let all: Vec<RowGrad> = (0..n).map(|i| row_grad(i, &stats[i])).collect();
        accumulate_grads(&p, &plan, &all, ws, grads);
        stats
    };
    check_row_stats(&stats, |i| live[i], targets, n)?;

    let (mut loss, mut z_loss) = (0.0, 0.0);
    let mut row_loss = vec![0.0f32; n];
    for i in (0..n).filter(|&i| live[i]) {
        let st = &stats[i];
        let lse = st.lse as f64;
        let z_term = c.z_loss * lse * lse;
        let smooth = lse - st.mean_logit as f64;
        let value =
            (1.0 - c.label_smoothing) * -(st.logp as f64) + c.label_smoothing * smooth + z_term;
        row_loss[i] = value as f32;
        let u = weight * grad_rows.map_or(1.0, |g| g[i] as f64);
        loss += u * value;
        z_loss += u * z_term;
    }
    Ok(CeLinearOutput {
        loss,
        z_loss,
        count,
        row_loss,
        stats,
        grads: LinearGrads::empty(),
        plan,
    })
}
