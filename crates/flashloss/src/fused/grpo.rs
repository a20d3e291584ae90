//! Fused linear GRPO on any backend's [`Head`]: the loss and its gradients w.r.t.
//! hidden states, LM-head weight and bias, straight from `[N, H]` and `[V, H]`, never
//! holding `[N, V]`. Token-level losses run single-pass when the plan allows (each row
//! block's policy stage between its statistics and its gradients, 6NHV); sequence-level
//! ratios and vespo, which need every token's logp before any gradient, run two-pass
//! (the whole batch's policy stage between pass A and pass B, 8NHV). Per row,
//! `dz = (g/T)·[dlogp·(1[j=y] - p) - dentropy·p·(log p + H)]`.

use super::grpo_support::{grpo_support, without_outside};
use super::logp_request::SupportStats;
use super::passes::{FusedPasses, Head, LinearGrads, check_head};
use super::plan::{FusedOptions, Plan};
use super::terms::RowGrad;
use super::two_pass::{grads_pass, stats_pass};
use crate::batch::{GrpoBatch, HeadShape};
use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::policy::{GrpoMetrics, Normalizers, PolicyOutput, policy_rows, policy_stage};
use crate::range::check_policy_rows;
use crate::rows::{RowInputs, RowStats, RowTransform, check_row_stats};
use crate::sharding::VocabSplit;
use std::ops::Range;

/// Loss, metrics, per-token outputs and the plan that ran.
#[derive(Debug, Clone)]
pub struct GrpoLinearOutput {
    /// The loss `L`.
    pub loss: f64,
    /// Batch metrics.
    pub metrics: GrpoMetrics,
    /// Per-row `logp`, `lse`, entropy (zeroed where masked; a token masked by a
    /// truncated support keeps `logp = -inf`, `lse^K` and its entropy).
    pub stats: Vec<RowStats>,
    /// Per-token KL as it enters the loss.
    pub kl: Vec<f32>,
    /// Per-token clip flags.
    pub clip: Vec<u8>,
    /// `grad_output ·` the gradients, where the entry point returns them in host
    /// memory (empty when they went into the head's buffers).
    pub grads: LinearGrads,
    /// The plan that ran (mode, block sizes).
    pub plan: Plan,
    /// Under the sampler's truncated support (the loss config's `top_k`/`top_p`/
    /// `min_p`): its outputs; `stats` then hold `logp^K` and `lse^K`, and the tokens
    /// whose target is outside it were masked.
    pub support: Option<SupportStats>,
}

/// The [`RowGrad`] of each row in `rows`:
/// `dz = scale·[dlogp·(1[j=y] - p) - dentropy·p·(log p + H)]`, `scale = g/T`
/// ([`RowTransform::grpo_coefs`]).
pub(crate) fn row_grads(
    rows: Range<usize>,
    stats: &[RowStats],
    policy: &PolicyOutput,
    targets: &[i64],
    transform: &RowTransform,
    grad_output: f64,
) -> Vec<RowGrad> {
    rows.map(|i| {
        let c = transform.grpo_coefs(grad_output, policy.dlogp[i], policy.dentropy[i]);
        RowGrad {
            stats: stats[i],
            coef_p: c.p,
            coef_h: c.h,
            coef_uniform: 0.0,
            coef_target: c.target,
            target: targets[i] as usize,
            support: None,
        }
    })
    .collect()
}

/// Checks the batch against a head of `shape` whose whole vocabulary has `vocab`
/// entries (ids in `[0, vocab)`, B·T rows), and `grad_output`.
pub(crate) fn check_batch(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    shape: HeadShape,
    vocab: usize,
    opts: &FusedOptions,
) -> Result<()> {
    if shape.tokens != batch.rows() {
        return Err(Error::InvalidArgument {
            arg: "hidden",
            reason: format!(
                "has {} rows but the batch has B·T = {}·{} = {}",
                shape.tokens,
                batch.batch,
                batch.seq_len,
                batch.rows()
            ),
        });
    }
    batch.validate(vocab, loss)?;
    if !opts.grad_output.is_finite() {
        return Err(Error::NonFinite {
            arg: "grad_output",
            index: 0,
            value: opts.grad_output as f64,
        });
    }
    Ok(())
}

/// The GRPO loss of `batch` (N = B·T rows) on logits `hidden · weightᵀ + bias` of
/// `head`, with normalizers `norm` of the batch's mask (local, or all-reduced in a
/// sharded run; under a truncated support the tokens outside it are taken off them);
/// the gradients are added into the head's buffers, within `opts.budget_bytes`.
pub fn grpo_linear(
    head: &mut dyn Head,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    check_head(head, Some(opts.head_grad))?;
    let shape = head.shape();
    check_batch(loss, batch, shape, shape.vocab, opts)?;
    let plan = head.plan(opts, !loss.needs_two_pass())?;
    let (out, _) = grpo_linear_checked(head, loss, batch, (norm, None), opts, plan, None)?;
    head.check_grads(batch.seq_len)?;
    Ok(out)
}

/// [`grpo_linear`] on inputs already checked, with `plan`; in a vocab-parallel run,
/// `split` merges the statistics of the head's shard with the other shards'. `norm`:
/// the normalizers, and the token groups they were summed over (a sharded run's).
/// Returns the output and the normalizers the policy stage ran with (under a truncated
/// support, `norm` less the tokens outside it).
pub(crate) fn grpo_linear_checked(
    head: &mut dyn Head,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    (norm, tokens): (Normalizers, Option<&dyn Collective>),
    opts: &FusedOptions,
    plan: Plan,
    split: Option<&VocabSplit>,
) -> Result<(GrpoLinearOutput, Normalizers)> {
    let vocab = head.shape().vocab;
    let transform = RowTransform::grpo(loss);
    let local_targets = split.map(|s| s.local_targets(batch.target_ids));
    let rows = RowInputs {
        targets: local_targets.as_deref().unwrap_or(batch.target_ids),
        live: batch.mask,
        transform,
    };
    let g = opts.grad_output as f64;
    let scale = transform.grad_scale(g);
    let mut passes = match head.passes(rows, plan) {
        Ok(passes) => passes,
        Err(e) => {
            // Under a support the token group all-reduces the masked tokens' counts: a
            // rank that fails here takes part, so that its peers fail instead of hang.
            if loss.support().is_some() {
                let _ = without_outside(norm, tokens, batch, Err(&e));
            }
            return Err(e);
        }
    };
    let mut support = None;
    let mut ran_with = norm;
    let (stats, policy) = if let Some(filter) = loss.support() {
        let range = split.map_or(0..vocab, |s| s.range.clone());
        let whole = split.map_or(vocab, |s| s.vocab);
        let run = grpo_support(
            passes.as_mut(),
            (loss, batch, filter),
            (norm, tokens),
            (&rows, opts),
            (range, whole, split),
        )?;
        (support, ran_with) = (Some(run.support), run.norm);
        (run.stats, run.policy)
    } else if plan.single_pass {
        single_pass(passes.as_mut(), loss, batch, norm, &transform, g)?
    } else {
        let stats = stats_pass(passes.as_mut(), &rows, vocab, split)?;
        let logp: Vec<f32> = stats.iter().map(|s| s.logp).collect();
        let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
        let policy = policy_stage(loss, batch, norm, &logp, &entropy);
        let live = |i: usize| batch.mask[i];
        let (n, t) = (batch.rows(), batch.seq_len);
        check_row_stats(&stats, live, batch.target_ids, t)?;
        check_policy_rows(&policy, |i| entropy[i], 0..n, live, t, Some(scale))?;
        let targets = batch.target_ids;
        let grads = row_grads(0..batch.rows(), &stats, &policy, targets, &transform, g);
        grads_pass(passes.as_mut(), grads, split)?;
        (stats, policy)
    };
    drop(passes);
    let outside = |i: usize| support.as_ref().is_some_and(|s| s.outside[i]);
    let live = |i: usize| batch.mask[i] && !outside(i);
    check_row_stats(&stats, live, batch.target_ids, batch.seq_len)?;
    let entropy = |i: usize| stats[i].entropy;
    check_policy_rows(&policy, entropy, 0..batch.rows(), live, batch.seq_len, None)?;
    let out = GrpoLinearOutput {
        loss: policy.loss,
        metrics: policy.metrics,
        stats,
        kl: policy.kl,
        clip: policy.clip,
        grads: LinearGrads::empty(),
        plan,
        support,
    };
    Ok((out, ran_with))
}

/// Single pass: each row block's policy stage between its statistics and its gradients.
fn single_pass(
    passes: &mut dyn FusedPasses,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    transform: &RowTransform,
    grad_output: f64,
) -> Result<(Vec<RowStats>, PolicyOutput)> {
    let scale = transform.grad_scale(grad_output);
    let n = batch.rows();
    let mut policy = PolicyOutput::new(n);
    let mut logp = vec![0.0f32; n];
    let mut entropy = vec![0.0f32; n];
    // The first row out of range (spec: "Numeric range"): from there on no gradient is
    // added, and the error is returned once the pass ends.
    let mut out_of_range: Option<Error> = None;
    let mut grads_of = |rows: Range<usize>, stats: &[RowStats]| {
        for i in rows.clone() {
            logp[i] = stats[i].logp;
            entropy[i] = stats[i].entropy;
        }
        policy_rows(
            loss,
            batch,
            norm,
            &logp,
            &entropy,
            rows.clone(),
            &mut policy,
        );
        if out_of_range.is_none() {
            // Rows whose statistics are not finite are reported by `check_row_stats`.
            let finite = |s: &RowStats| s.lse.is_finite() && s.logp.is_finite();
            let live =
                |i: usize| batch.mask[i] && finite(&stats[i]) && stats[i].entropy.is_finite();
            let entropy = |i: usize| stats[i].entropy;
            let t = batch.seq_len;
            let checked = check_policy_rows(&policy, entropy, rows.clone(), live, t, Some(scale));
            out_of_range = checked.err();
        }
        if out_of_range.is_some() {
            return vec![RowGrad::default(); rows.len()];
        }
        row_grads(
            rows,
            stats,
            &policy,
            batch.target_ids,
            transform,
            grad_output,
        )
    };
    let stats = passes.single_pass(&mut grads_of)?;
    if let Some(err) = out_of_range {
        check_row_stats(&stats, |i| batch.mask[i], batch.target_ids, batch.seq_len)?;
        return Err(err);
    }
    policy.finish(loss, batch, &entropy);
    Ok((stats, policy))
}
