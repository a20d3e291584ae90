//! The fused step both benches time: the configured loss on any backend's head.

use super::config::LossKind;
use flashloss::fused::{
    GatherIds, Head, LogpRequest, LogpRows, LogpUpstream, ce_linear, grpo_linear,
    logp_linear_grads_with,
};
use flashloss::policy::Normalizers;
use flashloss::{CrossEntropy, FusedOptions, GrpoBatch, GrpoLoss, Plan, Result, Temperature};

/// The rows of a `logprobs` step beyond the batch: upstream 1 on every row's `logp`
/// and, for the candidate-set call, `k` ids per row spread over the vocabulary with
/// cotangents.
pub(crate) struct LogprobRows {
    ones: Vec<f32>,
    ids: Vec<i64>,
    k: usize,
    cotangents: Vec<f32>,
}

impl LogprobRows {
    /// For `n` rows of a vocabulary of `v` entries, `k` candidates per row.
    pub(crate) fn new(n: usize, v: usize, k: usize) -> Self {
        let ids = (0..n * k).map(|at| ((at * 7919 + at / k.max(1) * 104_729) % v) as i64);
        LogprobRows {
            ones: vec![1.0; n],
            ids: ids.collect(),
            k,
            cotangents: (0..n * k).map(|at| 0.01 * (at % 5) as f32).collect(),
        }
    }

    /// The request and upstream of the plain call, or of the candidate-set call.
    fn call(&self, gather: bool) -> (LogpRequest<'_>, LogpUpstream<'_>) {
        let gather = gather && self.k > 0;
        let request = LogpRequest {
            gather_ids: gather.then_some(GatherIds {
                ids: &self.ids,
                k: self.k,
            }),
            ..LogpRequest::default()
        };
        let upstream = LogpUpstream {
            gathered: gather.then_some(&self.cotangents[..]),
            ..LogpUpstream::new(&self.ones, None)
        };
        (request, upstream)
    }
}

/// One fused step of `kind` on `head` (GRPO of `batch`, CE at its target ids, or the
/// log-prob gradient at them, with `logprobs`' candidates where `gather`): the loss
/// (for log-probs `Σ logp`) and the plan that ran. The gradients are added into the
/// head's buffers.
pub(crate) fn fused_step(
    head: &mut dyn Head,
    kind: LossKind,
    (grpo, ce): (&GrpoLoss, &CrossEntropy),
    (batch, norm): (&GrpoBatch, Normalizers),
    (logprobs, gather): (&LogprobRows, bool),
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
        LossKind::Logprobs => {
            let (request, upstream) = logprobs.call(gather);
            // The plan the call makes (candidate sets run two-pass).
            let plan = head.plan(opts, !request.needs_hooks())?;
            let rows = LogpRows {
                targets: batch.target_ids,
                mask: Some(batch.mask),
                temperature: Temperature::new(1.0)?,
            };
            let n = batch.target_ids.len();
            let out = logp_linear_grads_with(head, rows, &request, upstream, opts, n)?;
            let value = out.stats.iter().map(|s| s.logp as f64).sum();
            (value, plan)
        }
    })
}
