//! Selective log-softmax (no gradient): per-row `logp` of the target, `lse` and entropy,
//! streaming the vocabulary once. The old- and reference-policy passes of GRPO, and the
//! forward of the GRPO kernel.

use super::online_softmax::{RowStats, VOCAB_TILE, row_state};
use crate::batch::LogitsLayout;
use crate::element::Element;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Checks that each live row's statistics are finite: a `-inf` target logit is an
/// [`Error::ImpossibleTarget`], NaN or `+inf` logits an [`Error::InvalidArgument`].
pub(crate) fn check_row_stats(
    stats: &[RowStats],
    live: impl Fn(usize) -> bool,
    target_ids: &[i64],
    seq_len: usize,
) -> Result<()> {
    for (row, st) in stats.iter().enumerate().filter(|(i, _)| live(*i)) {
        if st.logp == f32::NEG_INFINITY || st.lse == f32::NEG_INFINITY {
            return Err(Error::ImpossibleTarget {
                row,
                seq: row / seq_len,
                pos: row % seq_len,
                id: target_ids[row],
            });
        }
        if !(st.lse.is_finite() && st.logp.is_finite() && st.entropy.is_finite()) {
            return Err(Error::InvalidArgument {
                arg: "logits",
                reason: format!("row {row} holds NaN or +inf logits"),
            });
        }
    }
    Ok(())
}

/// Per-row statistics of `logits / temperature` at `target_ids` (`[B, T]`). Rows where
/// `mask` is false are skipped and get zeroed [`RowStats`].
pub fn selective_log_softmax<E: Element>(
    logits: &[E],
    layout: &LogitsLayout,
    target_ids: &[i64],
    mask: Option<&[bool]>,
    temperature: f64,
) -> Result<Vec<RowStats>> {
    layout.validate("logits", logits.len())?;
    let n = layout.rows();
    let shape = || format!("[B={}, T={}]", layout.batch, layout.seq_len);
    for (arg, len) in [
        ("target_ids", target_ids.len()),
        ("mask", mask.map_or(n, <[bool]>::len)),
    ] {
        if len != n {
            return Err(Error::ShapeMismatch {
                arg,
                shape: shape(),
                expected: n,
                actual: len,
            });
        }
    }
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::InvalidArgument {
            arg: "temperature",
            reason: format!("must be finite and > 0, got {temperature}"),
        });
    }
    let live = |i: usize| mask.is_none_or(|m| m[i]);
    for i in (0..n).filter(|&i| live(i)) {
        let id = target_ids[i];
        if id < 0 || id as u64 >= layout.vocab as u64 {
            return Err(Error::TokenOutOfRange {
                arg: "target_ids",
                index: i,
                seq: i / layout.seq_len,
                pos: i % layout.seq_len,
                id,
                vocab: layout.vocab,
            });
        }
    }
    let inv_temp = (1.0 / temperature) as f32;
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
