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
//!
//! A [`LogpRequest`] adds `Σp²`, candidate sets (`super::gather`) and the truncated
//! support; upstream gradients of `lse` (`∂lse/∂z_j = p_j/T`) and of the candidates'
//! log-probs join the same row gradient (`coef_p`) and, for the candidates' one-hot
//! terms, pass B's [`SparseGrads`]. With a truncated support (`super::support`) the
//! upstream of `logp` is that of `logp^K`: its dense term `-g_logp·p^K_j` on the support
//! is a [`super::SupportTerm`] and the target term stays where the target is in the
//! support. Candidate sets and the support use the pass hooks: a gradient call with
//! candidate sets alone is single-pass where the plan allows (the candidates gathered
//! from each tile as it is formed, their one-hot terms added to each block's `dZ`); the
//! support and the calls without gradients run two-pass.

use super::gather::{GatherVisitor, finish_gathered, sparse_terms};
use super::logp_request::{GatherIds, LogpOutput, LogpRequest, LogpUpstream, SupportStats};
use super::passes::{FusedPasses, Head, SinglePassHooks, SparseGrads, check_head};
use super::plan::{FusedOptions, Mode, Plan};
use super::support::{RowSupport, SupportCall, SupportRun, VisitBoth};
use super::terms::RowGrad;
use super::two_pass::{grads_pass, row_grad_passes};
use crate::error::{Error, Result};
use crate::rows::{RowInputs, RowStats, RowTransform, check_row_stats, check_targets};
use crate::sharding::{VocabSplit, merge_partial};
use crate::temperature::Temperature;
use std::ops::Range;

/// Per-row statistics of `head`'s logits divided by `temperature`, at `target_ids`
/// `[N]`; rows where `mask` is false are skipped (zeroed stats). `seq_len` only names
/// positions in errors (use N for a flat batch). The workspace fits `budget_bytes`
/// (`None`: the backend's default).
pub fn logp_linear(
    head: &mut dyn Head,
    target_ids: &[i64],
    mask: Option<&[bool]>,
    temperature: Temperature,
    budget_bytes: impl Into<Option<usize>>,
    seq_len: usize,
) -> Result<Vec<RowStats>> {
    let rows = LogpRows {
        targets: target_ids,
        mask,
        temperature,
    };
    let request = LogpRequest::default();
    Ok(logp_linear_with(head, rows, &request, budget_bytes, seq_len)?.stats)
}

/// [`logp_linear`] with what `request` asks beyond the statistics (two-pass: pass A
/// alone, with the candidate sets gathered in it).
pub fn logp_linear_with(
    head: &mut dyn Head,
    rows: LogpRows,
    request: &LogpRequest,
    budget_bytes: impl Into<Option<usize>>,
    seq_len: usize,
) -> Result<LogpOutput> {
    check_head(head, None)?;
    let shape = head.shape();
    let opts = forward_options(budget_bytes.into());
    let call = LogpCall::new(
        (rows, *request, None),
        shape.tokens,
        shape.vocab,
        &opts,
        seq_len,
    )?;
    let plan = head.plan(&opts, false)?;
    logp_checked(head, &call, plan, None)
}

/// The options of a call without gradients: two-pass in `budget_bytes` (`None`: the
/// backend's default).
pub(crate) fn forward_options(budget_bytes: Option<usize>) -> FusedOptions {
    FusedOptions::forward(budget_bytes)
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

/// A checked log-prob call: its rows (which are live), request, upstream gradients
/// (none without a gradient) and transform.
pub(crate) struct LogpCall<'a> {
    rows: LogpRows<'a>,
    request: LogpRequest<'a>,
    upstream: Option<LogpUpstream<'a>>,
    pub(crate) live: Vec<bool>,
    transform: RowTransform,
    grad_output: f64,
    pub(crate) seq_len: usize,
}

impl<'a> LogpCall<'a> {
    /// Checks targets (ids in `[0, vocab)` where live), mask, the request and the
    /// upstream gradients (`[N]`, `[N, K]` for the candidates'; finite where live) for a
    /// head of `n` rows.
    pub(crate) fn new(
        (rows, request, upstream): (LogpRows<'a>, LogpRequest<'a>, Option<LogpUpstream<'a>>),
        n: usize,
        vocab: usize,
        opts: &FusedOptions,
        seq_len: usize,
    ) -> Result<Self> {
        let seq_len = seq_len.clamp(1, n.max(1));
        check_targets(rows.targets, rows.mask, n, vocab, seq_len)?;
        let live: Vec<bool> = (0..n).map(|i| rows.mask.is_none_or(|m| m[i])).collect();
        request.check(n, vocab, &live, seq_len)?;
        if let Some(up) = &upstream {
            check_upstream(up, &request, &live)?;
        }
        if !opts.grad_output.is_finite() {
            let value = opts.grad_output as f64;
            return Err(Error::NonFinite {
                arg: "grad_output",
                index: 0,
                value,
            });
        }
        Ok(LogpCall {
            rows,
            request,
            upstream,
            live,
            transform: RowTransform::with_temperature(rows.temperature),
            grad_output: opts.grad_output as f64,
            seq_len,
        })
    }

    /// The same call with `upstream` gradients (checked as [`LogpCall::new`] does).
    pub(crate) fn with_upstream(&self, upstream: LogpUpstream<'a>) -> Result<LogpCall<'a>> {
        check_upstream(&upstream, &self.request, &self.live)?;
        Ok(LogpCall {
            rows: self.rows,
            request: self.request,
            upstream: Some(upstream),
            live: self.live.clone(),
            transform: self.transform,
            grad_output: self.grad_output,
            seq_len: self.seq_len,
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

    /// Whether the call's passes need the pass hooks.
    pub(crate) fn needs_hooks(&self) -> bool {
        self.request.needs_hooks()
    }

    /// Whether the call may run single-pass: one without the pass hooks, or a gradient
    /// call whose only hook is candidate sets.
    pub(crate) fn single_pass_allowed(&self) -> bool {
        !self.needs_hooks() || (self.upstream.is_some() && self.request.grads_single_pass_allowed())
    }

    /// Row i's gradient, with `scale = g/T`: `dz = scale·[g_logp·(1[j=y] - p) -
    /// g_H·p·(log p + H) + g_lse·p - (Σ_k c_k)·p]` (the candidates' one-hot terms are
    /// [`LogpCall::sparse`]'s); with the row's truncated `support`, `g_logp`'s terms are
    /// `g_logp·(1[j=y] - p^K_j)·1[j∈K]` instead (none where `y ∉ K`).
    fn row_grad(&self, i: usize, stats: &RowStats, support: Option<&RowSupport>) -> RowGrad {
        let Some(up) = self.upstream.filter(|_| self.live[i]) else {
            return RowGrad::default();
        };
        let scale = self.transform.grad_scale(self.grad_output);
        let at = |g: Option<&[f32]>| g.map_or(0.0, |g| g[i] as f64);
        let g_logp = up.logp[i] as f64;
        let gathered = match (up.gathered, &self.request.gather_ids) {
            (Some(c), Some(ids)) => c[i * ids.k..(i + 1) * ids.k]
                .iter()
                .map(|&x| x as f64)
                .sum(),
            _ => 0.0,
        };
        let (dense_logp, target_logp) = match support {
            None => (g_logp, g_logp),
            Some(s) if s.outside => (0.0, 0.0),
            Some(_) => (0.0, g_logp),
        };
        RowGrad {
            stats: *stats,
            coef_p: (scale * (at(up.lse) - dense_logp - gathered)) as f32,
            coef_h: (-scale * at(up.entropy)) as f32,
            coef_uniform: 0.0,
            coef_target: (scale * target_logp) as f32,
            target: self.rows.targets[i] as usize,
            support: support.and_then(|s| s.grad(scale * g_logp)),
        }
    }

    /// The candidates' one-hot terms `scale·c_ik` at `k_ik` (ids of the whole
    /// vocabulary), where there are cotangents.
    fn sparse(&self) -> Option<SparseGrads> {
        let up = self.upstream?;
        let (ids, grads) = (self.request.gather_ids.as_ref()?, up.gathered?);
        let scale = self.transform.grad_scale(self.grad_output);
        Some(sparse_terms(ids, grads, scale, &self.live))
    }

    /// The call's outputs from every row's statistics, the gathered log-probs and the
    /// truncated support's.
    fn output(
        &self,
        stats: Vec<RowStats>,
        gathered: Option<Vec<f32>>,
        support: Option<SupportStats>,
    ) -> Result<LogpOutput> {
        let inv_temp = self.transform.inv_temp;
        let live = |i: usize| self.live[i];
        let max_logit = (stats.iter().enumerate())
            .map(|(i, st)| if live(i) { st.max * inv_temp } else { 0.0 })
            .collect();
        let sum_p2 = self
            .request
            .sum_p2
            .then(|| stats.iter().map(|st| st.sum_p2).collect());
        if let Some(i) =
            (0..stats.len()).find(|&i| self.request.sum_p2 && stats[i].sum_p2.is_nan() && live(i))
        {
            return Err(Error::Unsupported {
                feature: "sum_p2",
                reason: format!(
                    "the statistics pass did not form Σexp(2s) (row {i}), which every \
                     backend forms when asked: an internal error, please report it"
                ),
            });
        }
        Ok(LogpOutput {
            stats,
            max_logit,
            sum_p2,
            gathered,
            support,
        })
    }
}

/// Checks upstream gradients: `[N]` each (`[N, K]` for the candidates', which need
/// `gather_ids`), finite where the row is live.
fn check_upstream(up: &LogpUpstream, request: &LogpRequest, live: &[bool]) -> Result<()> {
    let n = live.len();
    let k = match (up.gathered, &request.gather_ids) {
        (Some(_), None) => {
            return Err(Error::InvalidArgument {
                arg: "grad_gathered",
                reason: "given without gather_ids".into(),
            });
        }
        (_, ids) => ids.map_or(1, |g| g.k),
    };
    let named = [
        ("grad_logp", Some(up.logp), 1),
        ("grad_entropy", up.entropy, 1),
        ("grad_lse", up.lse, 1),
        ("grad_gathered", up.gathered, k),
    ];
    for (arg, values, per_row) in named {
        let Some(values) = values else { continue };
        if values.len() != n * per_row {
            let shape = match per_row {
                1 => format!("[N={n}]"),
                k => format!("[N={n}, K={k}]"),
            };
            return Err(Error::ShapeMismatch {
                arg,
                shape,
                expected: n * per_row,
                actual: values.len(),
            });
        }
        let bad = (0..values.len()).find(|&at| live[at / per_row] && !values[at].is_finite());
        if let Some(index) = bad {
            let value = values[index] as f64;
            return Err(Error::NonFinite { arg, index, value });
        }
    }
    Ok(())
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
    let request = LogpRequest::default();
    Ok(logp_linear_grads_with(head, rows, &request, upstream, opts, seq_len)?.stats)
}

/// [`logp_linear_grads`] with `request`'s outputs and the upstream gradients of `lse`
/// and of the candidates' log-probs (`upstream.lse`, `upstream.gathered`); returns the
/// outputs. Single-pass where the plan allows and the request asks no truncated support.
pub fn logp_linear_grads_with(
    head: &mut dyn Head,
    rows: LogpRows,
    request: &LogpRequest,
    upstream: LogpUpstream,
    opts: &FusedOptions,
    seq_len: usize,
) -> Result<LogpOutput> {
    check_head(head, Some(opts.head_grad))?;
    let shape = head.shape();
    let call = (rows, *request, Some(upstream));
    let call = LogpCall::new(call, shape.tokens, shape.vocab, opts, seq_len)?;
    check_hooks_mode(&call, opts)?;
    let plan = head.plan(opts, call.single_pass_allowed())?;
    let out = logp_checked(head, &call, plan, None)?;
    head.check_grads(call.seq_len)?;
    Ok(out)
}

/// A call that may not run single-pass (a truncated support) runs two-pass: asking for
/// a single pass is an error naming it.
pub(crate) fn check_hooks_mode(call: &LogpCall, opts: &FusedOptions) -> Result<()> {
    match opts.mode {
        Mode::SinglePass | Mode::Compact if !call.single_pass_allowed() => {
            Err(Error::InvalidArgument {
                arg: "mode",
                reason: "top_k/top_p/min_p run two-pass; use two_pass or auto".into(),
            })
        }
        _ => Ok(()),
    }
}

/// A log-prob call on checked rows with `plan` (two-pass unless
/// [`LogpCall::single_pass_allowed`]). A gradient call without hooks is token-level
/// ([`row_grad_passes`], single-pass where the plan is); a single-pass one with
/// candidate sets is [`gather_single_pass`]; otherwise pass A (gathering the candidates
/// and the support), and pass B where the call has upstream gradients. In a
/// vocab-parallel run, `split` merges the statistics of the head's shard with the other
/// shards' and sums the gathered logits.
pub(crate) fn logp_checked(
    head: &mut dyn Head,
    call: &LogpCall,
    plan: Plan,
    split: Option<&VocabSplit>,
) -> Result<LogpOutput> {
    let vocab = head.shape().vocab;
    let targets = call.rows.targets;
    let local_targets = split.map(|s| s.local_targets(targets));
    let inputs = call.inputs(local_targets.as_deref().unwrap_or(targets));
    let mut passes = head.passes(inputs, plan)?;
    let token_level = !call.needs_hooks() && (plan.single_pass || call.upstream.is_some());
    let (stats, gathered, support) = if token_level {
        let row_grad = |i, stats: &RowStats| call.row_grad(i, stats, None);
        let inputs = (&inputs, vocab);
        let stats = row_grad_passes(passes.as_mut(), &plan, inputs, split, row_grad)?;
        (stats, None, None)
    } else if plan.single_pass {
        let ids = (call.request.gather_ids.as_ref())
            .filter(|_| call.single_pass_allowed() && split.is_none());
        let Some(ids) = ids else {
            return Err(Error::InvalidArgument {
                arg: "plan",
                reason: "a single pass cannot take top_k/top_p/min_p, a forward call's \
                         gather_ids or a vocabulary shard"
                    .into(),
            });
        };
        let (stats, gathered) = gather_single_pass(passes.as_mut(), call, (ids, vocab))?;
        (stats, gathered, None)
    } else {
        let range = split.map_or(0..vocab, |s| s.range.clone());
        let (stats, gathered, support) = pass_a(passes.as_mut(), call, (&inputs, range), split)?;
        if call.upstream.is_some() {
            let rows = support.as_ref().and_then(|s| s.rows.as_deref());
            pass_b(passes.as_mut(), call, (&stats, rows), split)?;
        }
        (stats, gathered, support)
    };
    drop(passes);
    check_row_stats(&stats, |i| call.live[i], targets, call.seq_len)?;
    let support = support.map(|s| s.stats(&stats, &call.live));
    call.output(stats, gathered, support)
}

/// A gradient call with candidate sets `ids` (and no support) in one pass over a whole
/// head of `vocab` entries: the candidates' logits are gathered from each tile as it is
/// formed and their one-hot terms join each block's `dZ`. Returns every row's
/// statistics and the candidates' log-probs.
fn gather_single_pass(
    passes: &mut dyn FusedPasses,
    call: &LogpCall,
    (ids, vocab): (&GatherIds, usize),
) -> Result<(Vec<RowStats>, Option<Vec<f32>>)> {
    let mut visitor = GatherVisitor::new(ids, &call.live, &(0..vocab));
    let sparse = call.sparse();
    let hooks = SinglePassHooks {
        visitor: Some(&mut visitor),
        sparse: sparse.as_ref(),
    };
    let stats = passes.single_pass_hooked(
        &mut |range, stats: &[RowStats]| range.map(|i| call.row_grad(i, &stats[i], None)).collect(),
        hooks,
    )?;
    let (targets, inv_temp) = (call.rows.targets, call.transform.inv_temp);
    let gathered = finish_gathered(&stats, &visitor.z, (ids, targets), (inv_temp, &call.live));
    Ok((stats, Some(gathered)))
}

/// What pass A gives: every row's statistics, the candidates' log-probs and the
/// truncated support.
pub(crate) type PassA = (Vec<RowStats>, Option<Vec<f32>>, Option<SupportRun>);

/// Pass A over the head's vocabulary `range` of the whole vocabulary (gathering the
/// candidates it holds, and the truncated support's top keys): every row's statistics
/// (merged over `split`'s shards), the candidates' log-probs (their logits summed over
/// the shards) and every row's support (after its extra passes).
pub(crate) fn pass_a(
    passes: &mut dyn FusedPasses,
    call: &LogpCall,
    (inputs, range): (&RowInputs, Range<usize>),
    split: Option<&VocabSplit>,
) -> Result<PassA> {
    let gather = call.request.gather_ids.as_ref();
    let mut visitor = gather.map(|ids| GatherVisitor::new(ids, &call.live, &range));
    let support = SupportCall::new(call.request.support, split.map_or(range.len(), |s| s.vocab));
    let mut buffers = (support.as_ref()).and_then(|s| s.buffers(inputs, range.clone()));
    let local = match (visitor.as_mut(), buffers.as_mut()) {
        (Some(v), Some(b)) => passes.row_states_visiting(&mut VisitBoth(v, b))?,
        (Some(v), None) => passes.row_states_visiting(v)?,
        (None, Some(b)) => passes.row_states_visiting(b)?,
        (None, None) => passes.row_states()?,
    };
    let (states, vocab) = match split {
        None => (local, range.len()),
        Some(s) => (
            merge_partial(s.comm, &local, inputs.transform.inv_temp)?,
            s.vocab,
        ),
    };
    let stats = states.finish(inputs, vocab);
    let gathered = match (visitor, gather) {
        (Some(mut v), Some(ids)) => {
            if let Some(s) = split {
                s.comm.all_reduce_sum_f32(&mut v.z)?;
            }
            let (targets, inv_temp) = (call.rows.targets, inputs.transform.inv_temp);
            Some(finish_gathered(
                &stats,
                &v.z,
                (ids, targets),
                (inv_temp, &call.live),
            ))
        }
        _ => None,
    };
    let support = match support {
        Some(s) => {
            let targets = call.rows.targets;
            Some(s.run(passes, (buffers, &states), (inputs, targets), split)?)
        }
        None => None,
    };
    Ok((stats, gathered, support))
}

/// Pass B: every row's gradient from its statistics (and its truncated support's, where
/// the call has one), with the candidates' one-hot terms where there are cotangents, on
/// `split`'s shard where there is one.
pub(crate) fn pass_b(
    passes: &mut dyn FusedPasses,
    call: &LogpCall,
    (stats, support): (&[RowStats], Option<&[RowSupport]>),
    split: Option<&VocabSplit>,
) -> Result<()> {
    let grads: Vec<RowGrad> = (0..stats.len())
        .map(|i| call.row_grad(i, &stats[i], support.map(|s| &s[i])))
        .collect();
    let Some(sparse) = call.sparse() else {
        return grads_pass(passes, grads, split);
    };
    match split {
        None => passes.accumulate_grads_sparse(&grads, &sparse),
        Some(s) => {
            let grads: Vec<RowGrad> = grads.into_iter().map(|g| g.on_shard(&s.range)).collect();
            passes.accumulate_grads_sparse(&grads, &sparse.on_shard(&s.range))
        }
    }
}
