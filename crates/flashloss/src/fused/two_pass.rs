//! The two passes of a fused step around its per-row stage, over a whole head or one
//! vocabulary shard of it ([`VocabSplit`]). On a shard (vocab-parallel), each rank's pass A gives
//! per-row partial softmax states of its `V_r` entries; they are all-gathered and
//! merged in rank order ([`merge_partial`]: `lse`, entropy, the
//! target logit from the shard that holds it, the logit sum), so every rank holds the
//! same global statistics; pass B then keeps each row's target term on the shard that
//! holds the target. Per step: `48·N` bytes of states gathered from each rank.

use super::passes::FusedPasses;
use super::plan::Plan;
use super::terms::RowGrad;
use crate::error::Result;
use crate::rows::{RowInputs, RowStats};
use crate::sharding::{VocabSplit, merge_partial};

/// Pass A: every row's statistics over a head of `vocab` entries, or over the whole
/// vocabulary of `split` merged from its shards.
pub(crate) fn stats_pass(
    passes: &mut dyn FusedPasses,
    rows: &RowInputs,
    vocab: usize,
    split: Option<&VocabSplit>,
) -> Result<Vec<RowStats>> {
    let local = passes.row_states()?;
    Ok(match split {
        None => local.finish(rows, vocab),
        Some(s) => merge_partial(s.comm, &local, rows.transform.inv_temp)?.finish(rows, s.vocab),
    })
}

/// Pass B with every row's gradient (target ids of the whole vocabulary), restricted to
/// `split`'s shard when there is one.
pub(crate) fn grads_pass(
    passes: &mut dyn FusedPasses,
    grads: Vec<RowGrad>,
    split: Option<&VocabSplit>,
) -> Result<()> {
    let grads = match split {
        Some(s) => grads.into_iter().map(|g| g.on_shard(&s.range)).collect(),
        None => grads,
    };
    passes.accumulate_grads(&grads)
}

/// The passes of a token-level loss whose row gradient `row_grad(i, stats_i)` needs only
/// that row's statistics: one pass where `plan` is single-pass (each row block's
/// gradients formed from its statistics inside it), else [`stats_pass`] then
/// [`grads_pass`]. Returns every row's statistics.
pub(crate) fn row_grad_passes(
    passes: &mut dyn FusedPasses,
    plan: &Plan,
    (rows, vocab): (&RowInputs, usize),
    split: Option<&VocabSplit>,
    row_grad: impl Fn(usize, &RowStats) -> RowGrad,
) -> Result<Vec<RowStats>> {
    if plan.single_pass {
        return passes.single_pass(&mut |range, stats: &[RowStats]| {
            range.map(|i| row_grad(i, &stats[i])).collect()
        });
    }
    let stats = stats_pass(passes, rows, vocab, split)?;
    let grads = (0..stats.len()).map(|i| row_grad(i, &stats[i])).collect();
    grads_pass(passes, grads, split)?;
    Ok(stats)
}
