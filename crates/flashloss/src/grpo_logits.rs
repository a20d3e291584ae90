//! The logits-level GRPO loss, backend-neutral part: a backend streams each live row of
//! the logits `[B, T, V]` once for its statistics (selective log-softmax), the O(N)
//! policy stage runs here, and [`GrpoLogitsForward`] keeps what the backward needs
//! (`∂L/∂logp`, `∂L/∂H` per row). A backend's backward then writes
//! `dz_ij = (g/T)·[dlogp_i·(1[j=y_i] - p_ij) - dentropy_i·p_ij·(log p_ij + H_i)]` in the
//! logits' dtype in one more streaming pass, optionally over the logits themselves.
//!
//! Sharded ([`grpo_logits_forward_sharded`]), as the original system's `shard_map`: on
//! a [`Grid`], each rank holds its token group's sequences and a vocabulary shard
//! `[B, T, V_r]` of their logits; the partial row states are merged within the token
//! group, the normalizers (dapo's global token count, B) summed over token groups, and
//! the loss and metrics reduced over them. Each rank's backward writes its own shard.

use crate::batch::{GrpoBatch, LogitsLayout};
use crate::collective::agree;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::policy::{
    GrpoMetrics, Normalizers, clips_per_sequence, policy_stage, policy_stage_per_token,
};
use crate::range::{check_grad_coefs, check_policy_rows};
use crate::rows::{PartialStats, RowInputs, RowStats, RowTransform, check_row_stats};
use crate::sharding::{Grid, Shard};
use crate::sharding::{VocabSplit, global_normalizers, merge_partial, reduce_policy_outputs};

/// The forward's outputs, and what the backward needs (O(N) in all).
#[derive(Debug, Clone)]
pub struct GrpoLogitsForward {
    /// The loss `L`.
    pub loss: f64,
    /// Batch metrics.
    pub metrics: GrpoMetrics,
    /// Per-row `logp`, `lse`, entropy (zeroed where masked).
    pub stats: Vec<RowStats>,
    /// Per-token KL as it enters the loss.
    pub kl: Vec<f32>,
    /// Per-token clip flags ([`crate::policy::CLIP_LOW`] | [`crate::policy::CLIP_HIGH`]).
    pub clip: Vec<u8>,
    /// Each token's share of the loss (`w_i·ℓ_tot,i` with the entropy bonus's share;
    /// with per-token weights `g_i·ℓ_tot,i`), 0 where masked.
    pub token_loss: Vec<f64>,
    pub(crate) dlogp: Vec<f32>,
    pub(crate) dentropy: Vec<f32>,
    pub(crate) targets: Vec<i64>,
    pub(crate) layout: LogitsLayout,
    /// Temperature of the logits.
    pub(crate) transform: RowTransform,
}

impl GrpoLogitsForward {
    /// Checks that the batch matches the layout and is valid for `loss` with ids in
    /// `[0, vocab)` (the layout's V, or the whole vocabulary of a shard's).
    pub(crate) fn check_batch(
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        layout: &LogitsLayout,
        vocab: usize,
    ) -> Result<()> {
        if (layout.batch, layout.seq_len) != (batch.batch, batch.seq_len) {
            return Err(Error::InvalidArgument {
                arg: "logits",
                reason: format!(
                    "layout is [B={}, T={}] but the batch is [B={}, T={}]",
                    layout.batch, layout.seq_len, batch.batch, batch.seq_len
                ),
            });
        }
        loss.check_full_softmax("the logits-level GRPO kernel")?;
        batch.validate(vocab, loss)
    }

    /// The forward from any backend's per-row statistics: runs the policy stage and
    /// checks its per-row outputs against the f32 range (spec: "Numeric range"; the
    /// gradient's bound is checked by the backward, which knows `grad_output`).
    /// `grad_rows` `[N]` replaces the loss's reduction by `L = Σ_i g_i·ℓ_tot,i`
    /// ([`policy_stage_per_token`]).
    pub(crate) fn from_stats(
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        norm: Normalizers,
        stats: Vec<RowStats>,
        layout: &LogitsLayout,
        grad_rows: Option<&[f32]>,
    ) -> Result<Self> {
        let logp: Vec<f32> = stats.iter().map(|s| s.logp).collect();
        let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
        let policy = match grad_rows {
            None => policy_stage(loss, batch, norm, &logp, &entropy),
            Some(g) => policy_stage_per_token(loss, batch, &logp, &entropy, g),
        };
        let live = |i: usize| batch.mask[i];
        let n = batch.rows();
        check_policy_rows(&policy, |i| entropy[i], 0..n, live, batch.seq_len, None)?;
        Ok(GrpoLogitsForward {
            loss: policy.loss,
            metrics: policy.metrics,
            stats,
            kl: policy.kl,
            clip: policy.clip,
            token_loss: policy.token_loss,
            dlogp: policy.dlogp,
            dentropy: policy.dentropy,
            targets: batch.target_ids.to_vec(),
            layout: *layout,
            transform: RowTransform::grpo(loss),
        })
    }

    /// `∂L/∂logp_i` per row.
    pub fn dlogp(&self) -> &[f32] {
        &self.dlogp
    }

    /// `∂L/∂H_i` per row.
    pub fn dentropy(&self) -> &[f32] {
        &self.dentropy
    }

    /// Checks a backward's logits length and `grad_output`, and that no row's gradient
    /// can leave the f32 range (spec: "Numeric range").
    pub(crate) fn check(&self, logits_len: usize, grad_output: f32) -> Result<()> {
        self.layout.validate("logits", logits_len)?;
        if !grad_output.is_finite() {
            return Err(Error::NonFinite {
                arg: "grad_output",
                index: 0,
                value: grad_output as f64,
            });
        }
        let scale = self.transform.grad_scale(grad_output as f64);
        let seq_len = self.layout.seq_len;
        check_grad_coefs(&self.dlogp, &self.dentropy, &self.stats, seq_len, scale)
    }
}

/// The logits-level GRPO forward on a [`Grid`]: this rank's token group's `batch` and
/// the [`Shard`] of the vocabulary its logits `[B, T, V_r]` (laid out as `layout`)
/// hold; `row_states(targets)` is the backend's pass over them (targets shard-local,
/// -1 where another shard holds the target). Every rank of a token group gets the
/// same statistics; the loss and metrics are global. The returned forward's backward
/// writes this rank's shard of the gradient.
pub(crate) fn grpo_logits_forward_sharded(
    grid: &Grid,
    shard: Shard,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    layout: &LogitsLayout,
    row_states: impl FnOnce(&[i64]) -> PartialStats,
) -> Result<GrpoLogitsForward> {
    let checked = GrpoLogitsForward::check_batch(loss, batch, layout, shard.vocab)
        .and_then(|_| shard.range(layout.vocab));
    let range = agree(grid.world, checked)?;
    let local = Normalizers::local(batch);
    let norm = global_normalizers(grid.tokens.as_ref(), local)?;
    let split = VocabSplit {
        comm: grid.vocab.as_ref(),
        range,
        vocab: shard.vocab,
    };
    let targets = split.local_targets(batch.target_ids);
    let rows = RowInputs {
        targets: &targets,
        live: batch.mask,
        transform: RowTransform::grpo(loss),
    };
    let partial = row_states(&targets);
    agree(grid.world, check_partial(&partial, batch.mask))?;
    let stats =
        merge_partial(split.comm, &partial, rows.transform.inv_temp)?.finish(&rows, shard.vocab);
    let checked = check_row_stats(&stats, |i| batch.mask[i], batch.target_ids, batch.seq_len);
    agree(grid.world, checked)?;
    let fwd = GrpoLogitsForward::from_stats(loss, batch, norm, stats, layout, None);
    let mut fwd = agree(grid.world, fwd)?;
    fwd.targets = targets;
    (fwd.loss, fwd.metrics) = reduce_policy_outputs(
        grid.tokens.as_ref(),
        fwd.loss,
        &fwd.metrics,
        (local, norm),
        clips_per_sequence(loss, batch),
    )?;
    Ok(fwd)
}

/// Checks a shard's partial states before they are merged, so that NaN or `+inf`
/// logits are reported by the rank that holds them.
fn check_partial(partial: &PartialStats, live: &[bool]) -> Result<()> {
    let bad = |st: &crate::rows::OnlineSoftmax| {
        st.max == f32::INFINITY || st.max.is_nan() || st.sum.is_nan() || st.weighted.is_nan()
    };
    match (0..partial.states.len()).find(|&i| live[i] && bad(&partial.states[i])) {
        Some(row) => Err(Error::InvalidArgument {
            arg: "logits",
            reason: format!("row {row} holds NaN or +inf logits"),
        }),
        None => Ok(()),
    }
}
