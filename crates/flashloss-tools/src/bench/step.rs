//! The fused step both benches time: the configured loss on any backend's head.

use super::config::{BenchConfig, LossKind};
use flashloss::SupportFilter;
use flashloss::fused::{
    GatherIds, Head, LogpRequest, LogpRows, LogpUpstream, ce_linear, grpo_linear,
    logp_linear_grads_with,
};
use flashloss::policy::Normalizers;
use flashloss::{
    CrossEntropy, FusedOptions, GrpoBatch, GrpoLoss, GrpoLossConfig, Plan, Result, Temperature,
};

/// Which log-prob call a `logprobs` step makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogprobCall {
    /// The plain call.
    Plain,
    /// With the candidate sets.
    Gather,
    /// Under the truncated support.
    Support,
}

/// The rows of a `logprobs` step beyond the batch: upstream 1 on every row's `logp`
/// and, for the candidate-set call, `k` ids per row spread over the vocabulary with
/// cotangents; the truncated support of the support call, and the extra passes its
/// last step took.
pub(crate) struct LogprobRows {
    ones: Vec<f32>,
    ids: Vec<i64>,
    k: usize,
    cotangents: Vec<f32>,
    pub(crate) support: Option<SupportFilter>,
    pub(crate) extra_passes: std::cell::Cell<usize>,
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
            support: None,
            extra_passes: std::cell::Cell::new(0),
        }
    }

    /// The rows of a bench of `cfg` over `n` rows and `v` entries: `gather_k` candidates
    /// per row for a `logprobs` bench, the support for any loss but CE.
    pub(crate) fn of_bench(cfg: &BenchConfig, n: usize, v: usize) -> Self {
        let k = match cfg.loss {
            LossKind::Logprobs => cfg.gather_k,
            _ => 0,
        };
        let mut rows = LogprobRows::new(n, v, k);
        rows.support = cfg.support().filter(|_| cfg.loss != LossKind::Ce);
        rows
    }

    /// The fused calls a bench times, each under its report name: the plain one, then
    /// the candidate-set call (`k > 0`) and the call under the support, where set.
    pub(crate) fn bench_calls(&self) -> Vec<(&'static str, LogprobCall)> {
        let mut calls = vec![("fused", LogprobCall::Plain)];
        if self.k > 0 {
            calls.push(("fused_gather", LogprobCall::Gather));
        }
        if self.support.is_some() {
            calls.push(("fused_support", LogprobCall::Support));
        }
        calls
    }

    /// The extra passes `call`'s last step took (the support's, each forming the logits
    /// once more: `2NHV`), and the report's note on them (none for the other calls).
    pub(crate) fn extra_passes_of(&self, name: &str, call: LogprobCall) -> (usize, Option<String>) {
        match call {
            LogprobCall::Support => {
                let extra = self.extra_passes.get();
                let note = format!("{name}: {extra} extra passes over the vocabulary (2NHV each)");
                (extra, Some(note))
            }
            _ => (0, None),
        }
    }

    /// The request and upstream of `call`.
    fn call(&self, call: LogprobCall) -> (LogpRequest<'_>, LogpUpstream<'_>) {
        let gather = call == LogprobCall::Gather && self.k > 0;
        let request = LogpRequest {
            gather_ids: gather.then_some(GatherIds {
                ids: &self.ids,
                k: self.k,
            }),
            support: self.support.filter(|_| call == LogprobCall::Support),
            ..LogpRequest::default()
        };
        let upstream = LogpUpstream {
            gathered: gather.then_some(&self.cotangents[..]),
            ..LogpUpstream::new(&self.ones, None)
        };
        (request, upstream)
    }
}

/// One fused step of `kind` on `head` (GRPO of `batch`, under the truncated support for
/// the support call; CE at its target ids; or the log-prob gradient at them, as
/// `logprobs`' `call`): the loss
/// (for log-probs `Σ logp`) and the plan that ran. The gradients are added into the
/// head's buffers.
pub(crate) fn fused_step(
    head: &mut dyn Head,
    kind: LossKind,
    (grpo, ce): (&GrpoLoss, &CrossEntropy),
    (batch, norm): (&GrpoBatch, Normalizers),
    (logprobs, call): (&LogprobRows, LogprobCall),
    opts: &FusedOptions,
) -> Result<(f64, Plan)> {
    Ok(match kind {
        LossKind::Grpo => {
            // The support call: the same loss under the sampler's truncated support.
            let truncated = match logprobs.support.filter(|_| call == LogprobCall::Support) {
                Some(f) => Some(GrpoLoss::new(GrpoLossConfig {
                    top_k: f.top_k,
                    top_p: f.top_p,
                    min_p: f.min_p,
                    ..grpo.config().clone()
                })?),
                None => None,
            };
            let out = grpo_linear(head, truncated.as_ref().unwrap_or(grpo), batch, norm, opts)?;
            let extra = out.support.as_ref().map_or(0, |s| s.extra_passes);
            logprobs.extra_passes.set(extra);
            (out.loss, out.plan)
        }
        LossKind::Ce => {
            let out = ce_linear(head, ce, batch.target_ids, None, opts)?;
            (out.loss, out.plan)
        }
        LossKind::Logprobs => {
            let (request, upstream) = logprobs.call(call);
            // The plan the call makes (a truncated support runs two-pass).
            let plan = head.plan(opts, request.grads_single_pass_allowed())?;
            let rows = LogpRows {
                targets: batch.target_ids,
                mask: Some(batch.mask),
                temperature: Temperature::new(1.0)?,
            };
            let n = batch.target_ids.len();
            let out = logp_linear_grads_with(head, rows, &request, upstream, opts, n)?;
            let extra = out.support.as_ref().map_or(0, |s| s.extra_passes);
            logprobs.extra_passes.set(extra);
            let value = out.stats.iter().map(|s| s.logp as f64).sum();
            (value, plan)
        }
    })
}
