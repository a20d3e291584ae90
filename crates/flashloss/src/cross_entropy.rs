//! The cross-entropy (SFT) loss configuration of `docs/spec/losses.md`, section
//! "Cross-entropy": `ℓ_i = (1-ε_ls)·(lse_i - s_{i,y_i}) + ε_ls·(lse_i - mean_j s_ij)
//! + λ_z·lse_i²` on `s = softcap(z) / T_temp`, for rows whose target is not
//! `ignore_index`. [`CrossEntropy::new`] is the one place a config is checked.

use crate::error::{Error, Result};
use crate::temperature::Temperature;
use serde::{Deserialize, Serialize};

/// How per-row losses become the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    /// Mean over the rows that are not ignored (0 when every row is ignored).
    #[default]
    Mean,
    /// Sum over the rows that are not ignored.
    Sum,
    /// Per-row losses; the backward takes one upstream gradient per row.
    None,
}

/// Cross-entropy options, as in a config file (`ce:`); every field has the spec's
/// default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CeConfig {
    /// Rows whose target equals this take no part (PyTorch's -100).
    pub ignore_index: i64,
    /// ε_ls in `[0, 1]`.
    pub label_smoothing: f64,
    /// λ_z ≥ 0, the weight of `lse²` (z-loss).
    pub z_loss: f64,
    /// Logit soft-cap `z ← cap·tanh(z/cap)` (unset: none).
    pub softcap: Option<f64>,
    /// Reduction over rows.
    pub reduction: Reduction,
    /// `T_temp`: logits are divided by it (after the soft-cap).
    pub temperature: f64,
}

impl Default for CeConfig {
    fn default() -> Self {
        CeConfig {
            ignore_index: -100,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            reduction: Reduction::Mean,
            temperature: 1.0,
        }
    }
}

/// A validated [`CeConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEntropy {
    config: CeConfig,
}

impl CrossEntropy {
    /// Validates `config`: `label_smoothing ∈ [0, 1]`, `z_loss ≥ 0`, `softcap > 0`,
    /// `temperature > 0`, all finite.
    pub fn new(config: CeConfig) -> Result<Self> {
        let c = &config;
        let bad = |field: &'static str, reason: String| Err(Error::InvalidConfig { field, reason });
        if !(0.0..=1.0).contains(&c.label_smoothing) {
            return bad(
                "label_smoothing",
                format!("must be in [0, 1], got {}", c.label_smoothing),
            );
        }
        if !(c.z_loss.is_finite() && c.z_loss >= 0.0) {
            return bad(
                "z_loss",
                format!("must be finite and >= 0, got {}", c.z_loss),
            );
        }
        if let Some(cap) = c.softcap
            && !(cap.is_finite() && cap > 0.0)
        {
            return bad("softcap", format!("must be finite and > 0, got {cap}"));
        }
        Temperature::of_config(c.temperature)?;
        Ok(CrossEntropy { config })
    }

    /// The validated config.
    pub fn config(&self) -> &CeConfig {
        &self.config
    }

    /// `Σ_i c_i` over the rows of `targets` that take part, `c_i` each row's weight in
    /// the reduction (mean `1/count`, sum and none 1): times `|grad_output|` it scales the
    /// absolute floor of `dW` and `dbias` (spec: "Absolute floor of a summed gradient
    /// entry").
    pub fn reduction_weight_sum(&self, targets: &[i64]) -> f64 {
        let counted = targets.iter().filter(|&&y| self.counts(y)).count();
        counted as f64 * self.row_weight(counted)
    }

    /// True for rows that take part: target ≠ `ignore_index`.
    pub fn counts(&self, target: i64) -> bool {
        target != self.config.ignore_index
    }

    /// `∂L/∂ℓ_i` of a counted row before the upstream gradient: `1/count` for mean,
    /// 1 for sum and none.
    pub fn row_weight(&self, count: usize) -> f64 {
        match self.config.reduction {
            Reduction::Mean => 1.0 / count.max(1) as f64,
            Reduction::Sum | Reduction::None => 1.0,
        }
    }

    /// Checks the upstream gradient: one per row (`[N]`) exactly when the reduction is
    /// `none`.
    pub fn check_grad_rows(&self, grad_rows: Option<&[f32]>, n: usize) -> Result<()> {
        match (self.config.reduction, grad_rows) {
            (Reduction::None, Some(g)) if g.len() != n => Err(Error::ShapeMismatch {
                arg: "grad_rows",
                shape: format!("[N={n}]"),
                expected: n,
                actual: g.len(),
            }),
            (Reduction::None, Some(g)) => match g.iter().position(|x| !x.is_finite()) {
                Some(index) => Err(Error::NonFinite {
                    arg: "grad_rows",
                    index,
                    value: g[index] as f64,
                }),
                None => Ok(()),
            },
            (Reduction::Mean | Reduction::Sum, Some(_)) => Err(Error::InvalidArgument {
                arg: "grad_rows",
                reason: "per-row upstream gradients need reduction `none`".into(),
            }),
            _ => Ok(()),
        }
    }
}
