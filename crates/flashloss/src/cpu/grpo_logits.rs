//! The fused logits-level GRPO kernel. Forward: one streaming pass over each live row
//! (selective log-softmax) keeping only per-row statistics, then the O(N) policy stage.
//! Backward: one more streaming pass writing
//! `dz_ij = (g/T)·[dlogp_i·(1[j=y_i] - p_ij) - dentropy_i·p_ij·(log p_ij + H_i)]`
//! in the logits' dtype, optionally over the logits themselves. No `[N, V]` temporary.

use super::online_softmax::VOCAB_TILE;
use super::selective_log_softmax::{logits_row_states, selective_log_softmax};
use super::simd;
use crate::batch::{GrpoBatch, LogitsLayout};
use crate::collective::agree;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::grpo_logits::GrpoLogitsForward;
use crate::policy::Normalizers;
use crate::rows::RowTransform;
use crate::sharding::{Grid, Shard};
use crate::temperature::Temperature;
use rayon::prelude::*;

/// Forward of the GRPO loss on logits `[B, T, V]` laid out as `layout`.
pub fn grpo_logits_forward<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
) -> Result<GrpoLogitsForward> {
    grpo_logits_forward_with(loss, batch, Normalizers::local(batch), logits, layout)
}

/// [`grpo_logits_forward`] with given (e.g. all-reduced) normalizers.
pub fn grpo_logits_forward_with<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    logits: &[E],
    layout: &LogitsLayout,
) -> Result<GrpoLogitsForward> {
    GrpoLogitsForward::check_batch(loss, batch, layout, layout.vocab)?;
    let stats = selective_log_softmax(
        logits,
        layout,
        batch.target_ids,
        Some(batch.mask),
        Temperature::checked(loss.config().temperature),
    )?;
    GrpoLogitsForward::from_stats(loss, batch, norm, stats, layout, None)
}

/// The per-token GRPO losses on logits `[B, T, V]`, unreduced (Liger's `reduce=False`):
/// the forward of `L = Σ_i g_i·ℓ_tot,i` with `grad_rows` `[N]` (the upstream gradient
/// of each token's loss; ones for the losses themselves, in
/// [`GrpoLogitsForward::token_loss`]), whose backward is then that sum's gradient
/// ([`crate::policy::policy_stage_per_token`]).
pub fn grpo_logits_forward_per_token<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
    grad_rows: &[f32],
) -> Result<GrpoLogitsForward> {
    GrpoLogitsForward::check_batch(loss, batch, layout, layout.vocab)?;
    let n = batch.rows();
    if grad_rows.len() != n {
        return Err(Error::ShapeMismatch {
            arg: "grad_rows",
            shape: format!("[B={}, T={}]", batch.batch, batch.seq_len),
            expected: n,
            actual: grad_rows.len(),
        });
    }
    if let Some(index) = (0..n).find(|&i| batch.mask[i] && !grad_rows[i].is_finite()) {
        let value = grad_rows[index] as f64;
        return Err(Error::NonFinite {
            arg: "grad_rows",
            index,
            value,
        });
    }
    let stats = selective_log_softmax(
        logits,
        layout,
        batch.target_ids,
        Some(batch.mask),
        Temperature::checked(loss.config().temperature),
    )?;
    let norm = Normalizers::local(batch);
    GrpoLogitsForward::from_stats(loss, batch, norm, stats, layout, Some(grad_rows))
}

/// The logits-level GRPO forward on a [`Grid`] of ranks: this rank's token group's
/// `batch` and its [`Shard`] of their logits `[B, T, V_r]` (see
/// [`crate::grpo_logits`]). [`GrpoLogitsForward::backward`] then writes this rank's
/// shard of the gradient.
pub fn grpo_logits_forward_sharded<E: Element>(
    grid: &Grid,
    shard: Shard,
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
) -> Result<GrpoLogitsForward> {
    agree(grid.world, layout.validate("logits", logits.len()))?;
    let inv_temp = RowTransform::grpo(loss).inv_temp;
    crate::grpo_logits::grpo_logits_forward_sharded(grid, shard, loss, batch, layout, |targets| {
        logits_row_states(logits, layout, targets, batch.mask, inv_temp)
    })
}

impl GrpoLogitsForward {
    /// Writes `grad_output · ∂L/∂z` into `dlogits`, a dense `[N, V]` buffer.
    pub fn backward<E: Element>(
        &self,
        logits: &[E],
        grad_output: f32,
        dlogits: &mut [E],
    ) -> Result<()> {
        self.check(logits.len(), grad_output)?;
        self.layout.validate_dense("dlogits", dlogits.len())?;
        let v = self.layout.vocab;
        dlogits.par_chunks_mut(v).enumerate().for_each_init(
            || vec![0.0f32; VOCAB_TILE],
            |tile, (i, dst)| {
                let start = self.layout.offset(i);
                self.grad_row(i, Some(&logits[start..start + v]), dst, grad_output, tile);
            },
        );
        Ok(())
    }

    /// Overwrites the logits with `grad_output · ∂L/∂z` (same layout).
    pub fn backward_in_place<E: Element>(&self, logits: &mut [E], grad_output: f32) -> Result<()> {
        self.check(logits.len(), grad_output)?;
        rows_mut(logits, &self.layout)
            .into_par_iter()
            .enumerate()
            .for_each_init(
                || vec![0.0f32; VOCAB_TILE],
                |tile, (i, row)| self.grad_row(i, None, row, grad_output, tile),
            );
        Ok(())
    }

    /// One row of the backward; reads `src`, or `dst` itself when `src` is `None`.
    fn grad_row<E: Element>(
        &self,
        i: usize,
        src: Option<&[E]>,
        dst: &mut [E],
        grad_output: f32,
        tile: &mut [f32],
    ) {
        let (dlogp, dentropy) = (self.dlogp[i], self.dentropy[i]);
        if dlogp == 0.0 && dentropy == 0.0 {
            dst.fill(E::default());
            return;
        }
        let st = &self.stats[i];
        let c = self
            .transform
            .grpo_coefs(grad_output as f64, dlogp, dentropy);
        let inv_temp = self.transform.inv_temp;
        let target = self.targets[i] as usize;
        let grad = simd::SoftmaxGrad {
            max: st.max,
            scale: inv_temp,
            log_sum: st.log_sum,
            coef_p: c.p,
            coef_h: c.h,
            entropy: st.entropy,
            ..Default::default()
        };
        for j0 in (0..dst.len()).step_by(VOCAB_TILE) {
            let j1 = (j0 + VOCAB_TILE).min(dst.len());
            let buf = &mut tile[..j1 - j0];
            simd::load(src.map_or(&dst[j0..j1], |s| &s[j0..j1]), buf);
            simd::softmax_grad(buf, &grad);
            if (j0..j1).contains(&target) {
                buf[target - j0] += c.target;
            }
            simd::store(buf, &mut dst[j0..j1]);
        }
    }
}

/// The disjoint rows of a strided buffer (validated layout), in row order.
pub(crate) fn rows_mut<'a, E>(data: &'a mut [E], layout: &LogitsLayout) -> Vec<&'a mut [E]> {
    let mut rows = Vec::with_capacity(layout.rows());
    let mut rest = data;
    let mut consumed = 0;
    for i in 0..layout.rows() {
        let offset = layout.offset(i);
        let tail = std::mem::take(&mut rest).split_at_mut(offset - consumed).1;
        let (row, tail) = tail.split_at_mut(layout.vocab);
        rows.push(row);
        rest = tail;
        consumed = offset + layout.vocab;
    }
    rows
}
