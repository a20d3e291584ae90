//! Fused linear GRPO: the GRPO loss and its gradients w.r.t. hidden states, LM-head
//! weight and bias, straight from `[N, H]` and `[V, H]`, never holding `[N, V]`.
//! Token-level losses run single-pass (6NHV); sequence-level ratios and vespo, which
//! need every token's logp before any gradient, run two-pass (8NHV).

use super::fused_linear::{
    CpuPasses, FusedOptions, FusedPasses, LinearGrads, Plan, Problem, RowGrad, Workspace, plan,
};
use super::online_softmax::RowStats;
use crate::batch::{GrpoBatch, LinearInputs};
use crate::config::GrpoLoss;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers, PolicyOutput, policy_rows, policy_stage};

/// Loss, metrics, per-token outputs and the LM head's gradients.
#[derive(Debug, Clone)]
pub struct GrpoLinearOutput {
    /// The loss `L`.
    pub loss: f64,
    /// Batch metrics.
    pub metrics: GrpoMetrics,
    /// Per-row `logp`, `lse`, entropy (zeroed where masked).
    pub stats: Vec<RowStats>,
    /// Per-token KL as it enters the loss.
    pub kl: Vec<f32>,
    /// Per-token clip flags.
    pub clip: Vec<u8>,
    /// `grad_output ·` the gradients.
    pub grads: LinearGrads,
    /// The plan that ran (mode, block sizes).
    pub plan: Plan,
}

/// The [`RowGrad`] of each row in `rows`: `dz = (g/T)·[dlogp·(1[j=y] - p) - dentropy·p·(log p + H)]`.
pub(crate) fn row_grads(
    rows: std::ops::Range<usize>,
    stats: &[RowStats],
    policy: &PolicyOutput,
    targets: &[i64],
    scale: f32,
) -> Vec<RowGrad> {
    rows.map(|i| RowGrad {
        stats: stats[i],
        coef_p: -scale * policy.dlogp[i],
        coef_h: -scale * policy.dentropy[i],
        coef_uniform: 0.0,
        coef_target: scale * policy.dlogp[i],
        target: targets[i] as usize,
    })
    .collect()
}

/// Checks the head, the batch (ids in `[0, vocab)`), that the head has B·T rows, and
/// `grad_output`.
pub(crate) fn check_inputs<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    inputs: &LinearInputs<E>,
    vocab: usize,
    opts: &FusedOptions,
) -> Result<()> {
    inputs.validate()?;
    check_batch(loss, batch, inputs.tokens, vocab, opts)
}

/// Checks the batch against a head of `tokens` rows and `vocab` entries, and
/// `grad_output`.
pub(crate) fn check_batch(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    tokens: usize,
    vocab: usize,
    opts: &FusedOptions,
) -> Result<()> {
    if tokens != batch.rows() {
        return Err(Error::InvalidArgument {
            arg: "hidden",
            reason: format!(
                "has {} rows but the batch has B·T = {}·{} = {}",
                tokens,
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

/// The GRPO loss of `batch` (N = B·T rows) on logits `hidden · weightᵀ + bias`, with
/// its gradients, within `opts.budget_bytes` of workspace.
pub fn grpo_linear<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    grpo_linear_with(loss, batch, Normalizers::local(batch), inputs, opts)
}

/// [`grpo_linear`] with given (e.g. all-reduced) normalizers.
pub fn grpo_linear_with<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    let mut grads = LinearGrads::zeros(inputs);
    let step = grpo_linear_into(
        loss,
        batch,
        norm,
        inputs,
        opts,
        &mut Workspace::new(),
        &mut grads,
    )?;
    Ok(GrpoLinearOutput { grads, ..step })
}

/// The fused step that adds its gradients into caller-owned `grads` (gradient
/// accumulation across micro-batches) and reuses `ws` across calls. The returned
/// output's `grads` is empty.
pub fn grpo_linear_into<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
    ws: &mut Workspace,
    grads: &mut LinearGrads,
) -> Result<GrpoLinearOutput> {
    grads.check(inputs)?;
    check_inputs(loss, batch, inputs, inputs.vocab, opts)?;
    grpo_linear_checked(loss, batch, norm, inputs, opts, ws, grads)
}

/// [`grpo_linear_into`] on inputs already checked by [`check_inputs`] (and `grads`
/// by [`LinearGrads::check`]).
pub(crate) fn grpo_linear_checked<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    inputs: &LinearInputs<E>,
    opts: &FusedOptions,
    ws: &mut Workspace,
    grads: &mut LinearGrads,
) -> Result<GrpoLinearOutput> {
    let temperature = loss.config().temperature;
    let scale = (opts.grad_output as f64 / temperature) as f32;
    let widen = E::as_f32(inputs.weight).is_none();
    let plan = plan(
        inputs.tokens,
        inputs.hidden_size,
        inputs.vocab,
        widen,
        opts,
        !loss.needs_sequence_reduction(),
    )?;
    let problem = Problem {
        inputs,
        targets: batch.target_ids,
        live: batch.mask,
        inv_temp: (1.0 / temperature) as f32,
        softcap: None,
        mean_logit: false,
    };
    grpo_fused(
        loss,
        batch,
        norm,
        scale,
        &mut CpuPasses {
            problem,
            plan,
            ws,
            out: grads,
        },
    )
}

/// The fused GRPO step on any backend's passes: single-pass (each row block's policy
/// stage between its statistics and its gradients) or two-pass (the whole batch's
/// policy stage between pass A and pass B). `scale` is `grad_output / T`.
pub(crate) fn grpo_fused(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    scale: f32,
    passes: &mut impl FusedPasses,
) -> Result<GrpoLinearOutput> {
    let plan = passes.plan();
    let (stats, policy) = if plan.single_pass {
        let n = batch.rows();
        let mut policy = PolicyOutput::new(n);
        let mut logp = vec![0.0f32; n];
        let mut entropy = vec![0.0f32; n];
        let mut grads_of = |rows: std::ops::Range<usize>, stats: &[RowStats]| {
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
            row_grads(rows, stats, &policy, batch.target_ids, scale)
        };
        let stats = passes.single_pass(&mut grads_of)?;
        policy.finish(batch.mask, &entropy);
        (stats, policy)
    } else {
        let stats = passes.row_stats()?;
        let logp: Vec<f32> = stats.iter().map(|s| s.logp).collect();
        let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
        let policy = policy_stage(loss, batch, norm, &logp, &entropy);
        let all = row_grads(0..batch.rows(), &stats, &policy, batch.target_ids, scale);
        passes.accumulate_grads(&all)?;
        (stats, policy)
    };
    super::selective_log_softmax::check_row_stats(
        &stats,
        |i| batch.mask[i],
        batch.target_ids,
        batch.seq_len,
    )?;
    Ok(GrpoLinearOutput {
        loss: policy.loss,
        metrics: policy.metrics,
        stats,
        kl: policy.kl,
        clip: policy.clip,
        grads: LinearGrads::empty(),
        plan,
    })
}
