//! The fused logits-level GRPO kernel. Forward: one streaming pass over each live row
//! (selective log-softmax) keeping only per-row statistics, then the O(N) policy stage.
//! Backward: one more streaming pass writing
//! `dz_ij = (g/T)·[dlogp_i·(1[j=y_i] - p_ij) - dentropy_i·p_ij·(log p_ij + H_i)]`
//! in the logits' dtype, optionally over the logits themselves. No `[N, V]` temporary.

use super::online_softmax::{RowStats, VOCAB_TILE};
use super::selective_log_softmax::selective_log_softmax;
use super::simd;
use crate::batch::{GrpoBatch, LogitsLayout};
use crate::config::GrpoLoss;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers, policy_stage};
use rayon::prelude::*;

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
    dlogp: Vec<f32>,
    dentropy: Vec<f32>,
    targets: Vec<i64>,
    layout: LogitsLayout,
    temperature: f64,
}

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
    GrpoLogitsForward::check_batch(loss, batch, layout)?;
    let stats = selective_log_softmax(
        logits,
        layout,
        batch.target_ids,
        Some(batch.mask),
        loss.config().temperature,
    )?;
    Ok(GrpoLogitsForward::from_stats(
        loss, batch, norm, stats, layout,
    ))
}

impl GrpoLogitsForward {
    /// Checks that the batch matches the layout and is valid for `loss`.
    pub(crate) fn check_batch(
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        layout: &LogitsLayout,
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
        batch.validate(layout.vocab, loss)
    }

    /// The forward from any backend's per-row statistics: runs the policy stage.
    pub(crate) fn from_stats(
        loss: &GrpoLoss,
        batch: &GrpoBatch,
        norm: Normalizers,
        stats: Vec<RowStats>,
        layout: &LogitsLayout,
    ) -> Self {
        let logp: Vec<f32> = stats.iter().map(|s| s.logp).collect();
        let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
        let policy = policy_stage(loss, batch, norm, &logp, &entropy);
        GrpoLogitsForward {
            loss: policy.loss,
            metrics: policy.metrics,
            stats,
            kl: policy.kl,
            clip: policy.clip,
            dlogp: policy.dlogp,
            dentropy: policy.dentropy,
            targets: batch.target_ids.to_vec(),
            layout: *layout,
            temperature: loss.config().temperature,
        }
    }

    /// Target ids per row.
    #[cfg(feature = "cuda")]
    pub(crate) fn targets(&self) -> &[i64] {
        &self.targets
    }

    /// The layout of the logits.
    #[cfg(feature = "cuda")]
    pub(crate) fn layout(&self) -> &LogitsLayout {
        &self.layout
    }

    /// The sampling temperature.
    #[cfg(feature = "cuda")]
    pub(crate) fn temperature(&self) -> f64 {
        self.temperature
    }

    /// `∂L/∂logp_i` per row.
    pub fn dlogp(&self) -> &[f32] {
        &self.dlogp
    }

    /// `∂L/∂H_i` per row.
    pub fn dentropy(&self) -> &[f32] {
        &self.dentropy
    }

    pub(crate) fn check(&self, logits_len: usize, grad_output: f32) -> Result<()> {
        self.layout.validate("logits", logits_len)?;
        if !grad_output.is_finite() {
            return Err(Error::NonFinite {
                arg: "grad_output",
                index: 0,
                value: grad_output as f64,
            });
        }
        Ok(())
    }

    /// Writes `grad_output · ∂L/∂z` into `dlogits`, a dense `[N, V]` buffer.
    pub fn backward<E: Element>(
        &self,
        logits: &[E],
        grad_output: f32,
        dlogits: &mut [E],
    ) -> Result<()> {
        self.check(logits.len(), grad_output)?;
        let (n, v) = (self.layout.rows(), self.layout.vocab);
        if dlogits.len() != n * v {
            return Err(Error::ShapeMismatch {
                arg: "dlogits",
                shape: format!("[N={n}, V={v}]"),
                expected: n * v,
                actual: dlogits.len(),
            });
        }
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
        let scale = (grad_output as f64 / self.temperature) as f32;
        let inv_temp = (1.0 / self.temperature) as f32;
        let target = self.targets[i] as usize;
        let grad = simd::SoftmaxGrad {
            max: st.max,
            scale: inv_temp,
            log_sum: st.log_sum,
            coef_p: -scale * dlogp,
            coef_h: -scale * dentropy,
            entropy: st.entropy,
            ..Default::default()
        };
        for j0 in (0..dst.len()).step_by(VOCAB_TILE) {
            let j1 = (j0 + VOCAB_TILE).min(dst.len());
            let buf = &mut tile[..j1 - j0];
            simd::load(src.map_or(&dst[j0..j1], |s| &s[j0..j1]), buf);
            simd::softmax_grad(buf, &grad);
            if (j0..j1).contains(&target) {
                buf[target - j0] += scale * dlogp;
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
