//! Fused selective log-softmax of an LM head (no gradient): per-row `logp` of the
//! target, `lse` and entropy of `(hidden · weightᵀ + bias) / T`, streaming the
//! vocabulary once per row block (2NHV FLOPs). The old- and reference-policy passes of
//! GRPO, on any backend's [`Head`].

use super::passes::{Head, check_head};
use super::plan::{FusedOptions, Mode};
use crate::error::Result;
use crate::rows::{RowInputs, RowStats, RowTransform, check_row_stats, check_targets};
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
    check_head(head, false)?;
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
