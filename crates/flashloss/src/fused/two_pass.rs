//! The two passes of a fused step around its per-row stage, over a whole head or one
//! vocabulary shard of it. On a shard (vocab-parallel), each rank's pass A gives
//! per-row partial softmax states of its `V_r` entries; they are all-gathered and
//! merged in rank order ([`crate::rows::OnlineSoftmax::merge`]: `lse`, entropy, the
//! target logit from the shard that holds it, the logit sum), so every rank holds the
//! same global statistics; pass B then keeps each row's target term on the shard that
//! holds the target. Per step: `40·N` bytes of states gathered from each rank.

use super::passes::{FusedPasses, RowGrad};
use crate::collective::Collective;
use crate::error::Result;
use crate::rows::{OnlineSoftmax, PartialStats, RowInputs, RowStats};
use std::ops::Range;

/// Where a head's vocabulary sits in a vocab-parallel run: entries `range` of a
/// vocabulary of `vocab`, the ranks of `comm` holding the other shards of the same rows.
pub(crate) struct VocabSplit<'c> {
    /// The ranks that hold the same rows (one shard each).
    pub(crate) comm: &'c dyn Collective,
    /// This shard's entries.
    pub(crate) range: Range<usize>,
    /// V of the whole head.
    pub(crate) vocab: usize,
}

impl VocabSplit<'_> {
    /// Target ids as shard-local ids (-1 where another shard holds the target).
    pub(crate) fn local_targets(&self, targets: &[i64]) -> Vec<i64> {
        targets
            .iter()
            .map(|&y| {
                if y >= 0 && self.range.contains(&(y as usize)) {
                    y - self.range.start as i64
                } else {
                    -1
                }
            })
            .collect()
    }
}

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

/// Merges every rank's partial states in rank order: the same global states on all.
pub(crate) fn merge_partial(
    comm: &dyn Collective,
    local: &PartialStats,
    inv_temp: f32,
) -> Result<PartialStats> {
    let n = local.states.len();
    let mut packed = Vec::with_capacity(5 * n);
    for i in 0..n {
        let st = &local.states[i];
        packed.extend([
            st.max as f64,
            st.sum,
            st.weighted,
            local.target_logits[i] as f64,
            local.sums[i],
        ]);
    }
    let gathered = comm.all_gather_f64(&packed)?;
    let mut out = PartialStats::empty(n, inv_temp);
    for part in &gathered {
        for (i, row) in part.chunks_exact(5).enumerate().take(n) {
            out.states[i].merge(OnlineSoftmax {
                inv_temp,
                max: row[0] as f32,
                sum: row[1],
                weighted: row[2],
            });
            out.target_logits[i] += row[3] as f32;
            out.sums[i] += row[4];
        }
    }
    Ok(out)
}
