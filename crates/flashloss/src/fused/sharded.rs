//! Sharded fused LM-head losses over a [`Collective`], on any backend's [`Head`]: a
//! [`Grid`] of token groups × vocab groups. Token-parallel (one vocab group) gives each
//! rank some sequences and the whole head; vocab-parallel (one token group) gives each
//! rank every row and a shard `[V_r, H]` of the head; 2-D does both. Inputs are checked
//! on every rank and any failure becomes the same error everywhere ([`agree`]).
//!
//! The normalizers (B, token count, CE's counted rows) are all-reduced over token
//! groups first. A rank holding the whole vocabulary runs the ordinary fused step
//! (single-pass where the plan allows); vocabulary shards run two-pass and merge their
//! row statistics within the token group ([`super::two_pass`]), then all-reduce dH
//! there. dW and dbias are all-reduced over token groups, and the loss and metrics
//! summed. Per step: `4·(V_r·H + V_r)` bytes each way over token groups, `48·N` bytes
//! of states and `4·N·H` of dH over vocab groups.

use super::ce::{CeLinearOutput, CeRows, ce_linear_checked};
use super::grpo::{GrpoLinearOutput, check_batch, grpo_linear_checked};
use super::logp::{LogpCall, LogpRows, check_hooks_mode, forward_options, logp_checked};
use super::logp_request::{LogpOutput, LogpRequest, LogpUpstream};
use super::passes::{GradPart, Head, check_head};
use super::plan::{FusedOptions, Mode, Plan};
use crate::batch::GrpoBatch;
use crate::collective::agree;
use crate::cross_entropy::CrossEntropy;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::policy::{Normalizers, clips_per_sequence};
use crate::rows::RowStats;
use crate::sharding::{Grid, Shard, VocabSplit, global_normalizers, reduce_policy_outputs};
use crate::temperature::Temperature;

/// What a sharded step agrees on before it runs: the plan, and the vocabulary split of
/// a shard (none when the rank holds the whole vocabulary).
fn sharded_plan<'g>(
    grid: &'g Grid,
    head: &dyn Head,
    shard: Shard,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<(Plan, Option<VocabSplit<'g>>)> {
    let range = shard.range(head.shape().vocab)?;
    check_head(head, Some(opts.head_grad))?;
    if grid.vocab.world_size() == 1 && range.len() == shard.vocab {
        return Ok((head.plan(opts, single_pass_allowed)?, None));
    }
    if matches!(opts.mode, Mode::SinglePass | Mode::Compact) {
        return Err(Error::InvalidArgument {
            arg: "mode",
            reason: "vocab-parallel runs two-pass (the global lse comes before any gradient); use auto or two_pass".into(),
        });
    }
    let split = VocabSplit {
        comm: grid.vocab.as_ref(),
        range,
        vocab: shard.vocab,
    };
    Ok((head.plan(opts, false)?, Some(split)))
}

/// dH summed over the ranks that split the vocabulary, dW and dbias (a trainable
/// head's, as `plan` forms them) over those that split the rows (a group of one reduces
/// nothing); then the gradients are checked finite, and a failure on any rank is the
/// same error on every rank.
fn all_reduce_grads(
    grid: &Grid,
    head: &mut dyn Head,
    (plan, split): (&Plan, bool),
    seq_len: usize,
) -> Result<()> {
    if split && grid.vocab.world_size() > 1 {
        head.all_reduce(grid.vocab.as_ref(), GradPart::Hidden)?;
    }
    if grid.tokens.world_size() > 1 && plan.head_grad.has_dweight() {
        head.all_reduce(grid.tokens.as_ref(), GradPart::Head)?;
    }
    agree(grid.world, head.check_grads(seq_len))
}

/// GRPO on a [`Grid`]: each rank passes its token group's sequences `batch` and its
/// head (its vocab group's [`Shard`] of those rows). Returns the global loss and
/// metrics, the token group's statistics and (in the head's buffers) its dH, and the
/// shard's dW and dbias summed over token groups.
pub fn grpo_linear_sharded(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    opts: &FusedOptions,
) -> Result<GrpoLinearOutput> {
    let checked = check_batch(loss, batch, head.shape(), shard.vocab, opts)
        .and_then(|_| sharded_plan(grid, head, shard, opts, !loss.needs_two_pass()));
    let (plan, split) = agree(grid.world, checked)?;
    let local = Normalizers::local(batch);
    let tokens = grid.tokens.as_ref();
    let norm = global_normalizers(tokens, local)?;
    let out = grpo_linear_checked(
        head,
        loss,
        batch,
        (norm, Some(tokens)),
        opts,
        plan,
        split.as_ref(),
    );
    let (mut out, norm) = agree(grid.world, out)?;
    all_reduce_grads(grid, head, (&plan, split.is_some()), batch.seq_len)?;
    // Under a truncated support the tokens outside it were masked: the metrics' means
    // are over the tokens that remain (`norm` is already the step's, summed over `tokens`).
    let local = match &out.support {
        Some(s) => local.without(batch, &s.outside),
        None => local,
    };
    (out.loss, out.metrics) = reduce_policy_outputs(
        grid.tokens.as_ref(),
        out.loss,
        &out.metrics,
        (local, norm),
        clips_per_sequence(loss, batch),
    )?;
    Ok(out)
}

/// Cross-entropy on a [`Grid`]: each rank passes its token group's `targets` and its
/// head (its vocab group's [`Shard`] of those rows). The counted rows, loss and z-loss
/// are summed over token groups (the mean divides by the rows counted on all of them);
/// statistics are merged and dH all-reduced within the token group; dW and dbias are
/// all-reduced over token groups. `grad_rows` (reduction `none` only) as in
/// [`super::ce_linear`]: the upstream gradient of each of this rank's rows.
pub fn ce_linear_sharded(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    ce: &CrossEntropy,
    targets: &[i64],
    grad_rows: Option<&[f32]>,
    opts: &FusedOptions,
) -> Result<CeLinearOutput> {
    let shape = head.shape();
    let checked = CeRows::new(
        ce,
        targets,
        shape.tokens,
        shard.vocab,
        opts.grad_output,
        grad_rows,
    )
    .and_then(|rows| Ok((rows, sharded_plan(grid, head, shard, opts, true)?)));
    let (rows, (plan, split)) = agree(grid.world, checked)?;
    let mut count = [rows.count as f64];
    grid.tokens.all_reduce_sum_f64(&mut count)?;
    let rows = rows.with_count(count[0] as usize);
    let out = ce_linear_checked(head, &rows, plan, split.as_ref());
    let mut out = agree(grid.world, out)?;
    all_reduce_grads(grid, head, (&plan, split.is_some()), shape.tokens)?;
    let mut sums = [out.loss, out.z_loss];
    grid.tokens.all_reduce_sum_f64(&mut sums)?;
    (out.loss, out.z_loss) = (sums[0], sums[1]);
    Ok(out)
}

/// Per-row statistics (`logp`, `lse`, entropy; no gradient) of a head split over the
/// vocab groups of `grid`: pass A on this rank's [`Shard`], the partial states merged
/// in rank order. Every rank of a token group gets the same statistics of its rows.
#[allow(clippy::too_many_arguments)]
pub fn logp_linear_sharded(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
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
    let out = logp_linear_sharded_with(grid, head, shard, rows, &request, budget_bytes, seq_len)?;
    Ok(out.stats)
}

/// [`logp_linear_sharded`] with what `request` asks (see [`super::logp_linear_with`]):
/// each rank gathers the candidates its shard holds, and the ranks sum them.
pub fn logp_linear_sharded_with(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    rows: LogpRows,
    request: &LogpRequest,
    budget_bytes: impl Into<Option<usize>>,
    seq_len: usize,
) -> Result<LogpOutput> {
    let n = head.shape().tokens;
    let opts = forward_options(budget_bytes.into());
    let checked = check_head(head, None)
        .and_then(|_| shard.range(head.shape().vocab))
        .and_then(|range| {
            let call = LogpCall::new((rows, *request, None), n, shard.vocab, &opts, seq_len)?;
            Ok((range, call, head.plan(&opts, false)?))
        });
    let (range, call, plan) = agree(grid.world, checked)?;
    let split = VocabSplit {
        comm: grid.vocab.as_ref(),
        range,
        vocab: shard.vocab,
    };
    agree(grid.world, logp_checked(head, &call, plan, Some(&split)))
}

/// The gradient of a log-prob call on a [`Grid`] (see [`super::logp_linear_grads`]):
/// each rank passes its token group's `rows` and `upstream` gradients and its head (its
/// vocab group's [`Shard`] of those rows). Returns the rows' statistics over the whole
/// vocabulary; dH (in the head's buffers) is summed within the token group, the
/// shard's dW and dbias (a trainable head's) over token groups.
pub fn logp_linear_grads_sharded(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    rows: LogpRows,
    upstream: LogpUpstream,
    opts: &FusedOptions,
    seq_len: usize,
) -> Result<Vec<RowStats>> {
    let request = LogpRequest::default();
    let out = logp_linear_grads_sharded_with(
        grid,
        head,
        shard,
        (rows, &request, upstream),
        opts,
        seq_len,
    )?;
    Ok(out.stats)
}

/// [`logp_linear_grads_sharded`] with what `request` asks and the upstream gradients of
/// `lse` and the candidates (see [`super::logp_linear_grads_with`]); the candidates'
/// one-hot terms go to the shard holding their ids.
pub fn logp_linear_grads_sharded_with(
    grid: &Grid,
    head: &mut dyn Head,
    shard: Shard,
    (rows, request, upstream): (LogpRows, &LogpRequest, LogpUpstream),
    opts: &FusedOptions,
    seq_len: usize,
) -> Result<LogpOutput> {
    let n = head.shape().tokens;
    let checked = LogpCall::new(
        (rows, *request, Some(upstream)),
        n,
        shard.vocab,
        opts,
        seq_len,
    )
    .and_then(|call| {
        check_hooks_mode(&call, opts)?;
        let plan = sharded_plan(grid, head, shard, opts, call.single_pass_allowed())?;
        Ok((call, plan))
    });
    let (call, (plan, split)) = agree(grid.world, checked)?;
    let out = logp_checked(head, &call, plan, split.as_ref());
    let out = agree(grid.world, out)?;
    all_reduce_grads(grid, head, (&plan, split.is_some()), call.seq_len)?;
    Ok(out)
}
