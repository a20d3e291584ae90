//! Fused linear cross-entropy: the loss of `shared/spec/losses.md` ("Cross-entropy")
//! and its gradients w.r.t. hidden states, LM-head weight and bias, straight from
//! `[N, H]` and `[V, H]`, never holding `[N, V]`. A token-level loss, so single-pass
//! (6NHV) whenever the budget holds a useful row block.

use super::fused_linear::{
    CpuPasses, FusedOptions, FusedPasses, LinearGrads, Plan, Problem, RowGrad, Workspace, plan,
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
    let rows = CeRows::new(
        ce,
        targets,
        inputs.tokens,
        inputs.vocab,
        opts.grad_output,
        grad_rows,
    )?;
    ce_rows_into(&rows, inputs, opts, ws, grads)
}

/// The fused CE of `rows` on a whole head: single-pass or two-pass as planned.
pub(crate) fn ce_rows_into<E: Element>(
    rows: &CeRows,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
    ws: &mut Workspace,
    grads: &mut LinearGrads,
) -> Result<CeLinearOutput> {
    let widen = E::as_f32(inputs.weight).is_none();
    let plan = plan(
        inputs.tokens,
        inputs.hidden_size,
        inputs.vocab,
        widen,
        opts,
        true,
    )?;
    ce_fused(
        rows,
        &mut CpuPasses {
            problem: rows.problem(inputs),
            plan,
            ws,
            out: grads,
        },
    )
}

/// The fused CE of `rows` on any backend's passes, single-pass or two-pass as planned.
pub(crate) fn ce_fused(rows: &CeRows, passes: &mut impl FusedPasses) -> Result<CeLinearOutput> {
    let plan = passes.plan();
    let stats = if plan.single_pass {
        let mut grads_of = |range: std::ops::Range<usize>, stats: &[RowStats]| {
            range.map(|i| rows.row_grad(i, &stats[i])).collect()
        };
        passes.single_pass(&mut grads_of)?
    } else {
        let stats = passes.row_stats()?;
        let all: Vec<RowGrad> = (0..stats.len())
            .map(|i| rows.row_grad(i, &stats[i]))
            .collect();
        passes.accumulate_grads(&all)?;
        stats
    };
    rows.output(stats, plan)
}

/// The per-row side of cross-entropy, shared by the fused and the sharded kernels:
/// which rows count, their reduction weights and their gradient coefficients.
pub(crate) struct CeRows<'a> {
    ce: &'a CrossEntropy,
    targets: &'a [i64],
    live: Vec<bool>,
    /// Rows that count (over all ranks in a token-parallel run).
    pub(crate) count: usize,
    weight: f64,
    grad_output: f32,
    grad_rows: Option<&'a [f32]>,
    vocab: usize,
}

impl<'a> CeRows<'a> {
    /// Checks targets (`[N]` for a head of `inputs.tokens` = N rows, ids in
    /// `[0, vocab)` where counted), `grad_rows` and `grad_output`. The mean is over
    /// the rows counted here (see [`CeRows::with_count`]).
    pub(crate) fn new(
        ce: &'a CrossEntropy,
        targets: &'a [i64],
        n: usize,
        vocab: usize,
        grad_output: f32,
        grad_rows: Option<&'a [f32]>,
    ) -> Result<Self> {
        let live: Vec<bool> = targets.iter().map(|&y| ce.counts(y)).collect();
        check_targets(
            targets,
            Some(&live),
            n,
            vocab,
            n.max(1),
            ce.config().temperature,
        )?;
        ce.check_grad_rows(grad_rows, n)?;
        if !grad_output.is_finite() {
            return Err(Error::NonFinite {
                arg: "grad_output",
                index: 0,
                value: grad_output as f64,
            });
        }
        let count = live.iter().filter(|&&l| l).count();
        Ok(CeRows {
            ce,
            targets,
            live,
            count,
            weight: ce.row_weight(count),
            grad_output,
            grad_rows,
            vocab,
        })
    }

    /// Target ids `[N]`.
    #[cfg(feature = "cuda")]
    pub(crate) fn targets(&self) -> &[i64] {
        self.targets
    }

    /// Rows that count `[N]`.
    #[cfg(feature = "cuda")]
    pub(crate) fn live(&self) -> &[bool] {
        &self.live
    }

    /// The fused problem of these rows on a whole head.
    pub(crate) fn problem<'p, E: Element>(
        &'p self,
        inputs: &'p LinearInputs<'p, E>,
    ) -> Problem<'p, E> {
        self.problem_on(inputs, self.targets)
    }

    /// The fused problem on `inputs` (a whole head, or a vocabulary shard with
    /// `targets` as shard-local ids, -1 where another shard owns the target).
    pub(crate) fn problem_on<'p, E: Element>(
        &'p self,
        inputs: &'p LinearInputs<'p, E>,
        targets: &'p [i64],
    ) -> Problem<'p, E> {
        let c = self.ce.config();
        Problem {
            inputs,
            targets,
            live: &self.live,
            inv_temp: (1.0 / c.temperature) as f32,
            softcap: c.softcap.map(|x| x as f32),
            mean_logit: c.label_smoothing > 0.0,
        }
    }

    /// The same rows with the mean taken over `count` rows (counted on all ranks of a
    /// token-parallel run).
    pub(crate) fn with_count(self, count: usize) -> Self {
        CeRows {
            count,
            weight: self.ce.row_weight(count),
            ..self
        }
    }

    /// `∂L/∂ℓ_i` without the upstream `grad_output`.
    fn row_weight(&self, i: usize) -> f64 {
        self.weight * self.grad_rows.map_or(1.0, |g| g[i] as f64)
    }

    /// Row i's gradient: `∂ℓ/∂s_j = (1 + 2λ_z·lse)·p_j - (1-ε)·[j = y] - ε/V`, and
    /// `∂s/∂z = slope / T` (the slope is applied by the tile kernel).
    pub(crate) fn row_grad(&self, i: usize, st: &RowStats) -> RowGrad {
        if !self.live[i] {
            return RowGrad::default();
        }
        let c = self.ce.config();
        let scale = self.row_weight(i) * self.grad_output as f64 / c.temperature;
        let eps = c.label_smoothing;
        RowGrad {
            stats: *st,
            coef_p: (scale * (1.0 + 2.0 * c.z_loss * st.lse as f64)) as f32,
            coef_h: 0.0,
            coef_uniform: (-scale * eps / self.vocab as f64) as f32,
            coef_target: (-scale * (1.0 - eps)) as f32,
            target: self.targets[i] as usize,
        }
    }

    /// Checks the statistics and sums the loss: `ℓ = (1-ε)·(-logp) + ε·(lse - mean s)
    /// + λ_z·lse²` per row, weighted.
    pub(crate) fn output(&self, stats: Vec<RowStats>, plan: Plan) -> Result<CeLinearOutput> {
        let n = self.targets.len();
        check_row_stats(&stats, |i| self.live[i], self.targets, n.max(1))?;
        let c = self.ce.config();
        let (mut loss, mut z_loss) = (0.0, 0.0);
        let mut row_loss = vec![0.0f32; n];
        for i in (0..n).filter(|&i| self.live[i]) {
            let st = &stats[i];
            let lse = st.lse as f64;
            let z_term = c.z_loss * lse * lse;
            let smooth = lse - st.mean_logit as f64;
            let value =
                (1.0 - c.label_smoothing) * -(st.logp as f64) + c.label_smoothing * smooth + z_term;
            row_loss[i] = value as f32;
            loss += self.row_weight(i) * value;
            z_loss += self.row_weight(i) * z_term;
        }
        Ok(CeLinearOutput {
            loss,
            z_loss,
            count: self.count,
            row_loss,
            stats,
            grads: LinearGrads::empty(),
            plan,
        })
    }
}
