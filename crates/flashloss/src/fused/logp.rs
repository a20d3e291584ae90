//! Fused selective log-softmax of an LM head: per-row `logp` of the target, `lse` and
//! entropy of `s = (hidden · weightᵀ + bias) / T`, streaming the vocabulary once per row
//! block (2NHV FLOPs, no gradient: the old- and reference-policy passes of GRPO), and
//! its gradient for upstream `(g_logp, g_H)` per row ([`logp_linear_grads`]): with
//! `p = softmax(s)`,
//!
//! `∂logp/∂z_j = (1[j=y] - p_j)/T`, `∂H/∂z_j = -p_j·(log p_j + H)/T`,
//!
//! the GRPO row gradient with `dlogp = g_logp`, `dentropy = g_H`
//! ([`RowTransform::grpo_coefs`]): a token-level loss, so single-pass where the plan
//! allows (6NHV; 4NHV on a frozen head), on any backend's [`Head`].

use super::passes::{Head, RowGrad, check_head};
use super::plan::{FusedOptions, HeadGrad, Mode, Plan};
use super::two_pass::{grads_pass, stats_pass};
use crate::error::{Error, Result};
use crate::rows::{RowInputs, RowStats, RowTransform, check_row_stats, check_targets};
use crate::sharding::VocabSplit;
use crate::temperature::Temperature;

/// Per-row statistics of `head`'s logits divided by `temperature`, at `target_ids`
/// `[N]`; rows where `mask` is false are skipped (zeroed stats). `seq_len` only names
/// positions in errors (use N for a flat batch). The workspace fits `budget_bytes`.
pub fn logp_linear(
    head: &mut dyn Head,
    target_ids: &[i64],
    mask: Option<&[bool]>,
    temperature: Temperature,
    budget_bytes: usize,
    seq_len: usize,
) -> Result<Vec<RowStats>> {
    check_head(head, None)?;
    let shape = head.shape();
    let n = shape.tokens;
    let seq_len = seq_len.clamp(1, n.max(1));
    check_targets(target_ids, mask, n, shape.vocab, seq_len)?;
    let all = vec![true; if mask.is_none() { n } else { 0 }];
    let live = mask.unwrap_or(&all);
    let opts = FusedOptions {
        bf16_products: Default::default(),
        mode: Mode::TwoPass,
        budget_bytes,
        grad_output: 1.0,
        head_grad: HeadGrad::Full,
    };
    let plan = head.plan(&opts, false)?;
    let rows = RowInputs {
        targets: target_ids,
        live,
        transform: RowTransform::with_temperature(temperature),
    };
    let stats = head
        .passes(rows, plan)?
        .row_states()?
        .finish(&rows, shape.vocab);
    check_row_stats(&stats, |i| live[i], target_ids, seq_len)?;
    Ok(stats)
}

/// The rows of a log-prob call: target ids `[N]` (of the whole vocabulary), the rows
/// that take part (`None`: all) and the temperature.
#[derive(Debug, Clone, Copy)]
pub struct LogpRows<'a> {
    /// Target ids `[N]`.
    pub targets: &'a [i64],
    /// Rows computed `[N]` (the others get zero statistics and zero gradient).
    pub mask: Option<&'a [bool]>,
    /// The logits are divided by it.
    pub temperature: Temperature,
}

/// The upstream gradients of a log-prob call's outputs: `∂L/∂logp_i` and `∂L/∂H_i`
/// `[N]` (`None`: the entropy is not used).
#[derive(Debug, Clone, Copy)]
pub struct LogpUpstream<'a> {
    /// `∂L/∂logp_i`.
    pub logp: &'a [f32],
    /// `∂L/∂H_i`.
    pub entropy: Option<&'a [f32]>,
}

/// Checked rows of a log-prob gradient: which are live, their transform and row
/// gradients.
pub(crate) struct LogpGradRows<'a> {
    rows: LogpRows<'a>,
    upstream: LogpUpstream<'a>,
    live: Vec<bool>,
    transform: RowTransform,
    grad_output: f64,
    pub(crate) seq_len: usize,
}

impl<'a> LogpGradRows<'a> {
    /// Checks targets (ids in `[0, vocab)` where live), mask and upstream gradients
    /// (`[N]`, finite where live) for a head of `n` rows.
    pub(crate) fn new(
        (rows, upstream): (LogpRows<'a>, LogpUpstream<'a>),
        n: usize,
        vocab: usize,
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<Self> {
        let seq_len = seq_len.clamp(1, n.max(1));
        check_targets(rows.targets, rows.mask, n, vocab, seq_len)?;
        let live: Vec<bool> = (0..n).map(|i| rows.mask.is_none_or(|m| m[i])).collect();
        let named = [
            ("grad_logp", Some(upstream.logp)),
            ("grad_entropy", upstream.entropy),
        ];
        for (arg, values) in named {
            let Some(values) = values else { continue };
            if values.len() != n {
                return Err(Error::ShapeMismatch {
                    arg,
                    shape: format!("[N={n}]"),
                    expected: n,
                    actual: values.len(),
                });
            }
            if let Some(i) = (0..n).find(|&i| live[i] && !values[i].is_finite()) {
                let value = values[i] as f64;
                return Err(Error::NonFinite {
                    arg,
                    index: i,
                    value,
                });
            }
        }
        if !opts.grad_output.is_finite() {
            let value = opts.grad_output as f64;
            return Err(Error::NonFinite {
                arg: "grad_output",
                index: 0,
                value,
            });
        }
        Ok(LogpGradRows {
            rows,
            upstream,
            live,
            transform: RowTransform::with_temperature(rows.temperature),
            grad_output: opts.grad_output as f64,
            seq_len,
        })
    }

    /// The pass inputs: `targets` as the head's ids (shard-local in a vocab-parallel run).
    pub(crate) fn inputs<'p>(&'p self, targets: &'p [i64]) -> RowInputs<'p> {
        RowInputs {
            targets,
            live: &self.live,
            transform: self.transform,
        }
    }

    /// Row i's gradient: `dz = (g/T)·[g_logp·(1[j=y] - p) - g_H·p·(log p + H)]`.
    fn row_grad(&self, i: usize, stats: &RowStats) -> RowGrad {
        if !self.live[i] {
            return RowGrad::default();
        }
        let g_entropy = self.upstream.entropy.map_or(0.0, |e| e[i]);
        let c = (self.transform).grpo_coefs(self.grad_output, self.upstream.logp[i], g_entropy);
        RowGrad {
            stats: *stats,
            coef_p: c.p,
            coef_h: c.h,
            coef_uniform: 0.0,
            coef_target: c.target,
            target: self.rows.targets[i] as usize,
            support: None,
        }
    }
}

/// The gradient of `Σ_i g_logp_i·logp_i + g_H_i·H_i` (`upstream`) of `head`'s
/// log-probs at `rows` w.r.t. hidden, weight and bias (as `opts.head_grad` asks), added
/// into the head's buffers; returns every row's statistics (as [`logp_linear`] gives
/// them). `seq_len` places rows in errors.
pub fn logp_linear_grads(
    head: &mut dyn Head,
    rows: LogpRows,
    upstream: LogpUpstream,
    opts: &FusedOptions,
    seq_len: usize,
) -> Result<Vec<RowStats>> {
    check_head(head, Some(opts.head_grad))?;
    let shape = head.shape();
    let grad_rows = LogpGradRows::new((rows, upstream), shape.tokens, shape.vocab, opts, seq_len)?;
    let plan = head.plan(opts, true)?;
    let stats = logp_grads_checked(head, &grad_rows, plan, None)?;
    head.check_grads(grad_rows.seq_len)?;
    Ok(stats)
}

/// [`logp_linear_grads`] on checked rows with `plan`; in a vocab-parallel run, `split`
/// merges the statistics of the head's shard with the other shards'.
pub(crate) fn logp_grads_checked(
    head: &mut dyn Head,
    rows: &LogpGradRows,
    plan: Plan,
    split: Option<&VocabSplit>,
) -> Result<Vec<RowStats>> {
    let vocab = head.shape().vocab;
    let targets = rows.rows.targets;
    let local_targets = split.map(|s| s.local_targets(targets));
    let inputs = rows.inputs(local_targets.as_deref().unwrap_or(targets));
    let mut passes = head.passes(inputs, plan)?;
    let stats = if plan.single_pass {
        passes.single_pass(&mut |range, stats: &[RowStats]| {
            range.map(|i| rows.row_grad(i, &stats[i])).collect()
        })?
    } else {
        let stats = stats_pass(passes.as_mut(), &inputs, vocab, split)?;
        let all: Vec<RowGrad> = (0..stats.len())
            .map(|i| rows.row_grad(i, &stats[i]))
            .collect();
        grads_pass(passes.as_mut(), all, split)?;
        stats
    };
    drop(passes);
    check_row_stats(&stats, |i| rows.live[i], targets, rows.seq_len)?;
    Ok(stats)
}
