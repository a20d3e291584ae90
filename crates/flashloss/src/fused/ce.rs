//! Fused linear cross-entropy on any backend's [`Head`]: the loss of
//! `docs/spec/losses.md` ("Cross-entropy": ignore_index, label smoothing, z-loss,
//! soft-cap, reductions) and its gradients w.r.t. hidden states, LM-head weight and
//! bias, straight from `[N, H]` and `[V, H]`, never holding `[N, V]`. A token-level
//! loss, so single-pass (6NHV) whenever the plan holds a useful row block. Per row,
//! `∂ℓ/∂s_j = (1 + 2λ_z·lse)·p_j - (1-ε)·[j = y] - ε/V`.

use super::passes::{Head, LinearGrads, check_head};
use super::plan::{FusedOptions, Plan};
use super::terms::RowGrad;
use super::two_pass::row_grad_passes;
use crate::cross_entropy::CrossEntropy;
use crate::error::{Error, Result};
use crate::range::check_ce_row;
use crate::rows::{RowInputs, RowStats, RowTransform, check_row_stats, check_targets};
use crate::sharding::VocabSplit;

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
    /// `grad_output ·` the gradients, where the entry point returns them in host
    /// memory (empty when they went into the head's buffers).
    pub grads: LinearGrads,
    /// The plan that ran.
    pub plan: Plan,
}

/// The cross-entropy of `head`'s logits `hidden · weightᵀ + bias` at `targets` `[N]`,
/// its gradients added into the head's buffers, within `opts.budget_bytes`.
/// `grad_rows` `[N]` (reduction `none` only) is the upstream gradient of each row's
/// loss; unset means ones.
pub fn ce_linear(
    head: &mut dyn Head,
    ce: &CrossEntropy,
    targets: &[i64],
    grad_rows: Option<&[f32]>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    ce_linear_lse(head, ce, targets, grad_rows, None, opts)
}

/// [`ce_linear`] whose gradients are those of `grad_output·L + Σ_i grad_lse_i·lse_i`:
/// `grad_lse` `[N]` is the upstream gradient of each row's log-sum-exp (Cut
/// Cross-Entropy's `return_lse`, e.g. for a z-loss of the caller's own), `lse_i` that of
/// the scaled logits `s_i` (soft-cap and temperature applied), in
/// [`CeLinearOutput::stats`]; ignored rows take none. `∂lse_i/∂s_ij = p_ij`, so the row's
/// `coef_p` grows by `grad_lse_i`.
pub fn ce_linear_lse(
    head: &mut dyn Head,
    ce: &CrossEntropy,
    targets: &[i64],
    grad_rows: Option<&[f32]>,
    grad_lse: Option<&[f32]>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    check_head(head, Some(opts.head_grad))?;
    let shape = head.shape();
    let rows = CeRows::new(
        ce,
        targets,
        shape.tokens,
        shape.vocab,
        opts.grad_output,
        grad_rows,
    )?
    .with_grad_lse(grad_lse)?;
    let plan = head.plan(opts, true)?;
    let out = ce_linear_checked(head, &rows, plan, None)?;
    head.check_grads(shape.tokens)?;
    Ok(out)
}

/// The per-row losses of `head`'s cross-entropy without gradients (reduction `none`'s
/// forward): one pass over the vocabulary for the row statistics (2NHV FLOPs), no
/// gradient buffers. The loss is summed as [`ce_linear`] sums it.
pub fn ce_row_losses(
    head: &mut dyn Head,
    ce: &CrossEntropy,
    targets: &[i64],
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    check_head(head, None)?;
    let shape = head.shape();
    let rows = CeRows::new(
        ce,
        targets,
        shape.tokens,
        shape.vocab,
        opts.grad_output,
        None,
    )?;
    let plan = head.plan(&opts.two_pass(), false)?;
    let inputs = rows.inputs(targets);
    let stats = head
        .passes(inputs, plan)?
        .row_states()?
        .finish(&inputs, shape.vocab);
    rows.output(stats, plan)
}

/// The fused CE of checked `rows` with `plan`; in a vocab-parallel run, `split` merges
/// the statistics of the head's shard with the other shards'.
pub(crate) fn ce_linear_checked(
    head: &mut dyn Head,
    rows: &CeRows,
    plan: Plan,
    split: Option<&VocabSplit>,
) -> Result<CeLinearOutput> {
    let vocab = head.shape().vocab;
    let local_targets = split.map(|s| s.local_targets(rows.targets));
    let inputs = rows.inputs(local_targets.as_deref().unwrap_or(rows.targets));
    let mut passes = head.passes(inputs, plan)?;
    let stats = row_grad_passes(passes.as_mut(), &plan, (&inputs, vocab), split, |i, st| {
        rows.row_grad(i, st)
    })?;
    drop(passes);
    rows.output(stats, plan)
}

/// The per-row side of cross-entropy, shared by the fused and the sharded kernels:
/// which rows count, their reduction weights and their gradient coefficients.
pub(crate) struct CeRows<'a> {
    ce: &'a CrossEntropy,
    targets: &'a [i64],
    live: Vec<bool>,
    transform: RowTransform,
    /// Rows that count (over all ranks in a token-parallel run).
    pub(crate) count: usize,
    weight: f64,
    grad_output: f32,
    grad_rows: Option<&'a [f32]>,
    grad_lse: Option<&'a [f32]>,
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
        check_targets(targets, Some(&live), n, vocab, n.max(1))?;
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
            transform: RowTransform::ce(ce),
            count,
            weight: ce.row_weight(count),
            grad_output,
            grad_rows,
            grad_lse: None,
            vocab,
        })
    }

    /// The same rows with an upstream gradient `grad_lse` `[N]` of each row's
    /// log-sum-exp (checked: length and finite values).
    pub(crate) fn with_grad_lse(self, grad_lse: Option<&'a [f32]>) -> Result<Self> {
        if let Some(g) = grad_lse {
            let n = self.targets.len();
            if g.len() != n {
                return Err(Error::ShapeMismatch {
                    arg: "grad_lse",
                    shape: format!("[N={n}]"),
                    expected: n,
                    actual: g.len(),
                });
            }
            if let Some(index) = g.iter().position(|x| !x.is_finite()) {
                let value = g[index] as f64;
                return Err(Error::NonFinite {
                    arg: "grad_lse",
                    index,
                    value,
                });
            }
        }
        Ok(CeRows { grad_lse, ..self })
    }

    /// The pass inputs of these rows: `targets` as the head's ids (shard-local in a
    /// vocab-parallel run).
    pub(crate) fn inputs<'p>(&'p self, targets: &'p [i64]) -> RowInputs<'p> {
        RowInputs {
            targets,
            live: &self.live,
            transform: self.transform,
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
        let scale = self
            .transform
            .grad_scale(self.row_weight(i) * self.grad_output as f64);
        let eps = c.label_smoothing;
        let lse_scale = self
            .grad_lse
            .map_or(0.0, |g| self.transform.grad_scale(g[i] as f64));
        RowGrad {
            stats: *st,
            coef_p: (scale * (1.0 + 2.0 * c.z_loss * st.lse as f64) + lse_scale) as f32,
            coef_h: 0.0,
            coef_uniform: (-scale * eps / self.vocab as f64) as f32,
            coef_target: (-scale * (1.0 - eps)) as f32,
            target: self.targets[i] as usize,
            support: None,
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
            let coef = self.row_grad(i, st);
            let coef =
                (coef.coef_p.abs() + coef.coef_uniform.abs() + coef.coef_target.abs()) as f64;
            check_ce_row(i, value, loss, coef, n.max(1))?;
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
