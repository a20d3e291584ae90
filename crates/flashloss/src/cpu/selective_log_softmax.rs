//! Selective log-softmax (no gradient): per-row `logp` of the target, `lse` and entropy,
//! streaming the vocabulary once. The old- and reference-policy passes of GRPO, and the
//! forward of the GRPO kernel.

use super::online_softmax::{VOCAB_TILE, row_state};
use crate::batch::LogitsLayout;
use crate::element::Element;
use crate::error::Result;
use crate::rows::{
    OnlineSoftmax, PartialStats, RowStats, RowTransform, check_row_stats, check_targets,
};
use crate::temperature::Temperature;
use rayon::prelude::*;

/// Per-row statistics of `logits / temperature` at `target_ids` (`[B, T]`). Rows where
/// `mask` is false are skipped and get zeroed [`RowStats`].
pub fn selective_log_softmax<E: Element>(
    logits: &[E],
    layout: &LogitsLayout,
    target_ids: &[i64],
    mask: Option<&[bool]>,
    temperature: Temperature,
) -> Result<Vec<RowStats>> {
    layout.validate("logits", logits.len())?;
    let n = layout.rows();
    let live = |i: usize| mask.is_none_or(|m| m[i]);
    check_targets(target_ids, mask, n, layout.vocab, layout.seq_len)?;
    let inv_temp = RowTransform::with_temperature(temperature).inv_temp;
    let stats: Vec<RowStats> = (0..n)
        .into_par_iter()
        .map_init(
            || vec![0.0f32; VOCAB_TILE],
            |tile, i| {
                if !live(i) {
                    return RowStats::default();
                }
                let start = layout.offset(i);
                let row = &logits[start..start + layout.vocab];
                let state = row_state(row, inv_temp, tile);
                let target = row[target_ids[i] as usize].to_f32();
                RowStats::finish(&state, target)
            },
        )
        .collect();
    check_row_stats(&stats, live, target_ids, layout.seq_len)?;
    Ok(stats)
}

/// Partial softmax states of each live row of a (validated) logits shard `[B, T, V_r]`,
/// `targets` as shard-local ids (-1 where another shard holds the target): what a
/// vocab-parallel run merges across ranks.
pub(crate) fn logits_row_states<E: Element>(
    logits: &[E],
    layout: &LogitsLayout,
    targets: &[i64],
    live: &[bool],
    inv_temp: f32,
) -> PartialStats {
    let v = layout.vocab;
    let (states, target_logits): (Vec<OnlineSoftmax>, Vec<f32>) = (0..layout.rows())
        .into_par_iter()
        .map_init(
            || vec![0.0f32; VOCAB_TILE],
            |tile, i| {
                if !live[i] {
                    return (OnlineSoftmax::empty(inv_temp), 0.0);
                }
                let row = &logits[layout.offset(i)..layout.offset(i) + v];
                let target = usize::try_from(targets[i]).ok().filter(|&t| t < v);
                let z_y = target.map_or(0.0, |t| row[t].to_f32());
                (row_state(row, inv_temp, tile), z_y)
            },
        )
        .unzip();
    let n = states.len();
    PartialStats {
        states,
        target_logits,
        sums: vec![0.0; n],
    }
}
