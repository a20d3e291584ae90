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

/// Checks `target_ids` and `mask` (`[N]`, N = B·T with T = `seq_len`), ids in
/// `[0, vocab)` where the mask is set, and `temperature` finite and > 0.
pub(crate) fn check_targets(
    target_ids: &[i64],
    mask: Option<&[bool]>,
    n: usize,
    vocab: usize,
    seq_len: usize,
    temperature: f64,
) -> Result<()> {
    let shape = || format!("[B={}, T={seq_len}]", n / seq_len);
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
    if let Some(i) = (0..n).find(|&i| live(i) && !(0..vocab as i64).contains(&target_ids[i])) {
        return Err(Error::TokenOutOfRange {
            arg: "target_ids",
            index: i,
            seq: i / seq_len,
            pos: i % seq_len,
            id: target_ids[i],
            vocab,
        });
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
    let live = |i: usize| mask.is_none_or(|m| m[i]);
    check_targets(
        target_ids,
        mask,
        n,
        layout.vocab,
        layout.seq_len,
        temperature,
    )?;
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
