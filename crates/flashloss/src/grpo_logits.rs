//! The logits-level GRPO loss, backend-neutral part: a backend streams each live row of
//! the logits `[B, T, V]` once for its statistics (selective log-softmax), the O(N)
//! policy stage runs here, and [`GrpoLogitsForward`] keeps what the backward needs
//! (`∂L/∂logp`, `∂L/∂H` per row). A backend's backward then writes
//! `dz_ij = (g/T)·[dlogp_i·(1[j=y_i] - p_ij) - dentropy_i·p_ij·(log p_ij + H_i)]` in the
//! logits' dtype in one more streaming pass, optionally over the logits themselves.

use crate::batch::{GrpoBatch, LogitsLayout};
use crate::config::GrpoLoss;
use crate::error::{Error, Result};
use crate::policy::{GrpoMetrics, Normalizers, policy_stage};
use crate::rows::{RowStats, RowTransform};

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
    pub(crate) dlogp: Vec<f32>,
    pub(crate) dentropy: Vec<f32>,
    pub(crate) targets: Vec<i64>,
    pub(crate) layout: LogitsLayout,
    /// Temperature of the logits.
    pub(crate) transform: RowTransform,
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
            transform: RowTransform::grpo(loss),
        }
    }

    /// `∂L/∂logp_i` per row.
    pub fn dlogp(&self) -> &[f32] {
        &self.dlogp
    }

    /// `∂L/∂H_i` per row.
    pub fn dentropy(&self) -> &[f32] {
        &self.dentropy
    }

    /// Checks a backward's logits length and `grad_output`.
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

}
