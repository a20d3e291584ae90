//! The two passes of a fused step around its per-row stage, over a whole head or one
//! vocabulary shard of it ([`VocabSplit`]). On a shard (vocab-parallel), each rank's pass A gives
//! per-row partial softmax states of its `V_r` entries; they are all-gathered and
//! merged in rank order ([`merge_partial`]: `lse`, entropy, the
//! target logit from the shard that holds it, the logit sum), so every rank holds the
//! same global statistics; pass B then keeps each row's target term on the shard that
//! holds the target. Per step: `48·N` bytes of states gathered from each rank.

use super::passes::{FusedPasses, RowGrad};
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
