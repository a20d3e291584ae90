//! No-grad fused linear log-probabilities: per-token `logp`, `lse` and entropy from
//! hidden states and the LM head (old- and reference-policy passes).

use super::fused_linear::{FusedOptions, Mode, Problem, Workspace, plan, row_stats};
use super::online_softmax::RowStats;
use super::selective_log_softmax::{check_row_stats, check_targets};
use crate::batch::LinearInputs;
use crate::element::Element;
use crate::error::Result;

/// Per-row statistics of `hidden · weightᵀ + bias` divided by `temperature`, at
/// `target_ids` `[N]`; rows where `mask` is false are skipped (zeroed stats).
/// `seq_len` only names positions in errors (use N for a flat batch).
pub fn logp_linear<E: Element>(
    inputs: &LinearInputs<E>,
    target_ids: &[i64],
    mask: Option<&[bool]>,
    temperature: f64,
    budget_bytes: usize,
    seq_len: usize,
) -> Result<Vec<RowStats>> {
    inputs.validate()?;
    let n = inputs.tokens;
    let seq_len = seq_len.clamp(1, n);
    check_targets(target_ids, mask, n, inputs.vocab, seq_len, temperature)?;
    let all = vec![true; if mask.is_none() { n } else { 0 }];
    let live_rows = mask.unwrap_or(&all);
    let live = |i: usize| live_rows[i];
    let opts = FusedOptions {
        mode: Mode::TwoPass,
        budget_bytes,
        grad_output: 1.0,
    };
    let widen = E::as_f32(inputs.weight).is_none();
    let plan = plan(n, inputs.hidden_size, inputs.vocab, widen, &opts, false)?;
    let p = Problem {
        inputs,
        targets: target_ids,
        live: live_rows,
        inv_temp: (1.0 / temperature) as f32,
        softcap: None,
        mean_logit: false,
    };
    let stats = row_stats(&p, &plan, &mut Workspace::new());
    check_row_stats(&stats, live, target_ids, seq_len)?;
    Ok(stats)
}
