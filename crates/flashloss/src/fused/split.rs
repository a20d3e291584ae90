//! The two passes of a fused step as separate calls, for a caller that runs the
//! collective between them itself (JAX's `lax.pmax`/`psum` inside `shard_map`, where the
//! kernel cannot call back into the framework): pass A gives each row's partial softmax
//! state over the head's vocabulary shard ([`partial_row_states`]); the caller merges the
//! shards (as [`crate::sharding::merge_partial`] does), runs the per-row stage, and pass B
//! adds the gradients of one [`RowGrad`] per row ([`accumulate_row_grads`]). Both check
//! the head and the rows like every driver. Cross-entropy's rows have their own forms
//! ([`ce_partial_row_states`], [`ce_accumulate_row_grads`]): its row transform (soft-cap,
//! logit sums for label smoothing) and its row stage (loss and coefficients).

use super::ce::{CeLinearOutput, CeRows};
use super::passes::{Head, check_head};
use super::plan::FusedOptions;
use super::terms::RowGrad;
use crate::cross_entropy::CrossEntropy;
use crate::error::{Error, Result};
use crate::rows::{PartialStats, RowInputs, RowStats};
use crate::sharding::{Shard, local_ids};

/// Checks `rows` against a head of `n` rows and `v` vocabulary entries: targets in
/// `[-1, v)` where live (-1: another shard holds the target).
fn check_rows(rows: &RowInputs, n: usize, v: usize) -> Result<()> {
    for (arg, len) in [("targets", rows.targets.len()), ("live", rows.live.len())] {
        if len != n {
            return Err(Error::ShapeMismatch {
                arg,
                shape: format!("[N={n}]"),
                expected: n,
                actual: len,
            });
        }
    }
    let bad = (0..n).find(|&i| rows.live[i] && !(-1..v as i64).contains(&rows.targets[i]));
    match bad {
        Some(i) => Err(Error::InvalidArgument {
            arg: "targets",
            reason: format!(
                "local id {} at row {i} is outside [-1, {v}) (-1: another shard holds it)",
                rows.targets[i]
            ),
        }),
        None => Ok(()),
    }
}

/// Pass A over `head`'s vocabulary: every live row's partial state (max, `Σexp`,
/// `Σexp·s`, the target's raw logit where the head holds it, 0 elsewhere).
pub fn partial_row_states(
    head: &mut dyn Head,
    rows: RowInputs,
    opts: &FusedOptions,
) -> Result<PartialStats> {
    check_head(head, None)?;
    let s = head.shape();
    check_rows(&rows, s.tokens, s.vocab)?;
    let plan = head.plan(&opts.two_pass(), false)?;
    head.passes(rows, plan)?.row_states()
}

/// Pass B: adds the gradients of `grads` (one per row; targets local to the head, a
/// zero `coef_target` where another shard holds it) into the head's buffers, then
/// checks them finite (`seq_len` places a `dH` row in its sequence).
pub fn accumulate_row_grads(
    head: &mut dyn Head,
    rows: RowInputs,
    grads: &[RowGrad],
    opts: &FusedOptions,
    seq_len: usize,
) -> Result<()> {
    check_head(head, Some(opts.head_grad))?;
    let s = head.shape();
    check_rows(&rows, s.tokens, s.vocab)?;
    if grads.len() != s.tokens {
        return Err(Error::ShapeMismatch {
            arg: "grads",
            shape: format!("[N={}]", s.tokens),
            expected: s.tokens,
            actual: grads.len(),
        });
    }
    if let Some(i) = grads
        .iter()
        .position(|g| g.coef_target != 0.0 && g.target >= s.vocab)
    {
        return Err(Error::InvalidArgument {
            arg: "grads",
            reason: format!(
                "row {i}'s target {} is outside the head's {} entries",
                grads[i].target, s.vocab
            ),
        });
    }
    let plan = head.plan(&opts.two_pass(), false)?;
    head.passes(rows, plan)?.accumulate_grads(grads)?;
    head.check_grads(seq_len)
}

/// Pass A of cross-entropy on `head`, the [`Shard`] of the vocabulary it holds:
/// `targets` `[N]` are ids of the whole vocabulary (checked against it; ignored rows
/// skipped), the row transform is the loss's (soft-cap, temperature), and the states
/// carry the logit sums that label smoothing needs.
pub fn ce_partial_row_states(
    head: &mut dyn Head,
    shard: Shard,
    ce: &CrossEntropy,
    targets: &[i64],
    opts: &FusedOptions,
) -> Result<PartialStats> {
    check_head(head, None)?;
    let n = head.shape().tokens;
    let rows = CeRows::new(ce, targets, n, shard.vocab, 1.0, None)?;
    let local = local_ids(targets, &shard.range(head.shape().vocab)?);
    let plan = head.plan(&opts.two_pass(), false)?;
    head.passes(rows.inputs(&local), plan)?.row_states()
}

/// Cross-entropy's row stage and pass B on `head` (a [`Shard`]) from every row's
/// statistics over the whole vocabulary (`stats`, merged by the caller): adds this
/// shard's gradients of `grad_output·L + Σ_i grad_lse_i·lse_i` (`L` weighted by
/// `grad_rows` `[N]` for reduction `none`; `grad_lse` `[N]` as in
/// [`super::ce::ce_linear_lse`]) into the head's buffers and returns the loss and the
/// per-row losses (the same on every shard).
pub fn ce_accumulate_row_grads(
    head: &mut dyn Head,
    shard: Shard,
    ce: &CrossEntropy,
    targets: &[i64],
    (grad_rows, grad_lse): (Option<&[f32]>, Option<&[f32]>),
    stats: Vec<RowStats>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    check_head(head, Some(opts.head_grad))?;
    let n = head.shape().tokens;
    let rows = CeRows::new(ce, targets, n, shard.vocab, opts.grad_output, grad_rows)?
        .with_grad_lse(grad_lse)?;
    if stats.len() != n {
        return Err(Error::ShapeMismatch {
            arg: "stats",
            shape: format!("[N={n}]"),
            expected: n,
            actual: stats.len(),
        });
    }
    let range = shard.range(head.shape().vocab)?;
    let local = local_ids(targets, &range);
    let grads: Vec<RowGrad> = (0..n)
        .map(|i| rows.row_grad(i, &stats[i]).on_shard(&range))
        .collect();
    let plan = head.plan(&opts.two_pass(), false)?;
    let out = rows.output(stats, plan)?;
    let zero = |g: &RowGrad| [g.coef_p, g.coef_h, g.coef_uniform, g.coef_target] == [0.0; 4];
    if !grads.iter().all(zero) {
        // (all zero: the per-row losses of reduction `none`'s forward; nothing to add)
        head.passes(rows.inputs(&local), plan)?
            .accumulate_grads(&grads)?;
    }
    head.check_grads(n)?;
    Ok(out)
}
