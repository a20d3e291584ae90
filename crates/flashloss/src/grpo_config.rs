//! The GRPO loss configuration of `docs/spec/losses.md`, with its defaults and the
//! rules on which combinations are valid. [`GrpoLoss::new`] is the one place a config is
//! checked; kernels take a [`GrpoLoss`], so they never see an invalid one.

use crate::error::{Error, Result};
use crate::support_filter::SupportFilter;
use crate::temperature::Temperature;
use serde::{Deserialize, Serialize};

/// Which GRPO-family objective (spec: "GRPO per-token policy loss").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Clipped surrogate, per-sequence token mean, then batch mean.
    Grpo,
    /// Clipped surrogate, mean over all unmasked tokens of the batch.
    Bnpo,
    /// Clipped surrogate, normalized by `B · max_completion_length`.
    DrGrpo,
    /// Clipped surrogate, normalized by `num_items_in_batch`.
    Dapo,
    /// `-stopgrad(min(r, ε_high))·A·logp`, normalized by `num_items_in_batch`.
    Cispo,
    /// Soft gate `-A·(4/τ)·σ(τ(r-1))`, reduced like grpo.
    Sapo,
    /// Clipped surrogate (usually at sequence level), each sequence's token sum
    /// averaged over the batch: `w_bt = m_bt / B` (TRL 1.16).
    Luspo,
    /// `-stopgrad(φ_b)·A·logp` with a sequence-level weight φ_b.
    Vespo,
}

impl LossType {
    /// All loss types, in spec order.
    pub const ALL: [LossType; 8] = [
        LossType::Grpo,
        LossType::Bnpo,
        LossType::DrGrpo,
        LossType::Dapo,
        LossType::Cispo,
        LossType::Sapo,
        LossType::Luspo,
        LossType::Vespo,
    ];

    /// The name used in configs (`dr_grpo`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LossType::Grpo => "grpo",
            LossType::Bnpo => "bnpo",
            LossType::DrGrpo => "dr_grpo",
            LossType::Dapo => "dapo",
            LossType::Cispo => "cispo",
            LossType::Sapo => "sapo",
            LossType::Luspo => "luspo",
            LossType::Vespo => "vespo",
        }
    }

    /// True for the PPO-style clipped family (grpo, bnpo, dr_grpo, dapo, luspo).
    pub fn is_clipped(self) -> bool {
        matches!(
            self,
            LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo
        )
    }

    /// Whether this loss type may run at the given importance-sampling level: every
    /// type at token level, every type but vespo at sequence level (TRL 1.16; vespo's
    /// φ_b is already a sequence weight).
    pub fn allows_level(self, level: ImportanceSamplingLevel) -> bool {
        !matches!(
            (self, level),
            (LossType::Vespo, ImportanceSamplingLevel::Sequence)
        )
    }
}

/// Where the importance ratio lives: per token, or one per sequence (GSPO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// `r_i = exp(logp_i - o_i)`.
    Token,
    /// `R_b = exp(Σ_t m_bt (logp_bt - o_bt) / L_b)`.
    Sequence,
}

/// Every field of the spec's loss configuration. Field names are TRL's; defaults are
/// the spec's. Construct a [`GrpoLoss`] from it to use it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoLossConfig {
    /// The objective (default dapo, TRL 1.16's `GRPOConfig.loss_type`).
    pub loss_type: LossType,
    /// Token-level or sequence-level (GSPO) ratios.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// Lower clip: `c ≥ 1 - epsilon_low`.
    pub epsilon_low: f64,
    /// Upper clip `c ≤ 1 + epsilon_high`; for cispo the absolute cap on `r`.
    pub epsilon_high: f64,
    /// Two-sided clipping: `r̃ = min(r, delta)` (clipped family only).
    pub delta: Option<f64>,
    /// KL coefficient β (k3 estimator against the reference policy).
    pub beta: f64,
    /// Multiply the KL by the (non-detached) importance ratio (`r_i`, or `R_b` at
    /// sequence level). Default `true`, as TRL 1.16.
    pub use_bias_correction_kl: bool,
    /// Logits are divided by this before the softmax.
    pub temperature: f64,
    /// sapo τ for positive advantages.
    pub sapo_temperature_pos: f64,
    /// sapo τ for non-positive advantages.
    pub sapo_temperature_neg: f64,
    /// vespo k for A ≥ 0.
    pub vespo_k_pos: f64,
    /// vespo λ for A ≥ 0.
    pub vespo_lambda_pos: f64,
    /// vespo k for A < 0.
    pub vespo_k_neg: f64,
    /// vespo λ for A < 0.
    pub vespo_lambda_neg: f64,
    /// dr_grpo's constant normalizer (required for dr_grpo).
    pub max_completion_length: Option<usize>,
    /// dapo/cispo/vespo normalizer, as the caller passes it; when unset, the number of
    /// unmasked tokens of the batch (all-reduced over token groups in a sharded run).
    pub num_items_in_batch: Option<f64>,
    /// Entropy bonus, a token mean whatever the loss type:
    /// `L = L_policy - entropy_coef · Σ_i m'_i H_i / max(1, Σ_i m'_i)` with `m' = m`, or
    /// `m · entropy_mask` when the batch has one.
    pub entropy_coef: f64,
    /// The sampler's top-k (TRL's and vLLM's `top_k`; `None` or 0: none). With any of
    /// `top_k`, `top_p`, `min_p` set, `logp` is the log-prob under the sampler's
    /// truncated support and a token whose target is outside it is masked (spec,
    /// flashloss addition 13).
    pub top_k: Option<usize>,
    /// The sampler's top-p in `(0, 1]` (`None` or 1: none).
    pub top_p: Option<f64>,
    /// The sampler's min-p in `[0, 1]` (`None` or 0: none).
    pub min_p: Option<f64>,
}

impl Default for GrpoLossConfig {
    fn default() -> Self {
        GrpoLossConfig {
            loss_type: LossType::Dapo,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            beta: 0.0,
            use_bias_correction_kl: true,
            temperature: 1.0,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            max_completion_length: None,
            num_items_in_batch: None,
            entropy_coef: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
        }
    }
}

/// A validated [`GrpoLossConfig`]: the only form the kernels accept.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoLoss {
    config: GrpoLossConfig,
}

fn check(ok: bool, field: &'static str, reason: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidConfig {
            field,
            reason: reason(),
        })
    }
}

fn check_finite(x: f64, field: &'static str) -> Result<()> {
    check(x.is_finite(), field, || format!("must be finite, got {x}"))
}

impl GrpoLoss {
    /// Validates `config`: the parameters the loss type uses, finite and in range (a
    /// parameter another type uses is not read, so not checked: a bnpo config may hold
    /// any sapo temperature), and the spec's rules (δ only for the clipped family;
    /// sequence level not for vespo; dr_grpo needs `max_completion_length`).
    pub fn new(config: GrpoLossConfig) -> Result<Self> {
        let c = &config;
        let t = c.loss_type;
        let mut used = vec![
            (c.beta, "beta"),
            (c.temperature, "temperature"),
            (c.entropy_coef, "entropy_coef"),
        ];
        if t.is_clipped() {
            used.extend([
                (c.epsilon_low, "epsilon_low"),
                (c.epsilon_high, "epsilon_high"),
            ]);
        }
        match t {
            LossType::Cispo => used.push((c.epsilon_high, "epsilon_high")),
            LossType::Sapo => used.extend([
                (c.sapo_temperature_pos, "sapo_temperature_pos"),
                (c.sapo_temperature_neg, "sapo_temperature_neg"),
            ]),
            LossType::Vespo => used.extend([
                (c.vespo_k_pos, "vespo_k_pos"),
                (c.vespo_lambda_pos, "vespo_lambda_pos"),
                (c.vespo_k_neg, "vespo_k_neg"),
                (c.vespo_lambda_neg, "vespo_lambda_neg"),
            ]),
            _ => {}
        }
        for (x, field) in used {
            check_finite(x, field)?;
        }
        if t.is_clipped() {
            check((0.0..1.0).contains(&c.epsilon_low), "epsilon_low", || {
                format!("must be in [0, 1), got {}", c.epsilon_low)
            })?;
            check(c.epsilon_high >= 0.0, "epsilon_high", || {
                format!("must be >= 0, got {}", c.epsilon_high)
            })?;
        }
        if t == LossType::Cispo {
            check(c.epsilon_high > 0.0, "epsilon_high", || {
                "cispo caps the ratio at epsilon_high, which must be > 0".into()
            })?;
        }
        check(c.beta >= 0.0, "beta", || {
            format!("must be >= 0, got {}", c.beta)
        })?;
        Temperature::of_config(c.temperature)?;
        if t == LossType::Sapo {
            for (tau, field) in [
                (c.sapo_temperature_pos, "sapo_temperature_pos"),
                (c.sapo_temperature_neg, "sapo_temperature_neg"),
            ] {
                check(tau > 0.0, field, || format!("must be > 0, got {tau}"))?;
            }
        }
        if let Some(delta) = c.delta {
            check(c.loss_type.is_clipped(), "delta", || {
                format!(
                    "delta is valid only for the clipped family (grpo, bnpo, dr_grpo, dapo, luspo), not {}",
                    c.loss_type.name()
                )
            })?;
            check(delta.is_finite() && delta > 1.0, "delta", || {
                format!("must be finite and > 1, got {delta}")
            })?;
        }
        check(
            c.loss_type.allows_level(c.importance_sampling_level),
            "importance_sampling_level",
            || {
                format!(
                    "{} supports only importance_sampling_level = token",
                    c.loss_type.name()
                )
            },
        )?;
        if c.loss_type == LossType::DrGrpo {
            check(
                c.max_completion_length.is_some_and(|l| l > 0),
                "max_completion_length",
                || "dr_grpo requires max_completion_length >= 1".into(),
            )?;
        }
        if let (Some(n), LossType::Dapo | LossType::Cispo | LossType::Vespo) =
            (c.num_items_in_batch, t)
        {
            check(n.is_finite() && n > 0.0, "num_items_in_batch", || {
                format!("must be finite and > 0, got {n}")
            })?;
        }
        let filter = SupportFilter {
            top_k: c.top_k.filter(|&k| k > 0),
            top_p: c.top_p,
            min_p: c.min_p,
        };
        filter.check().map_err(|e| match e {
            Error::InvalidArgument { arg, reason } => Error::InvalidConfig { field: arg, reason },
            e => e,
        })?;
        Ok(GrpoLoss { config })
    }

    /// The sampler's truncation, where a filter cuts (`top_k ≥ 1`, `top_p < 1`,
    /// `min_p > 0`); `None`: the full softmax.
    pub fn support(&self) -> Option<SupportFilter> {
        let c = &self.config;
        let filter = SupportFilter {
            top_k: c.top_k.filter(|&k| k > 0),
            top_p: c.top_p.filter(|&p| p < 1.0),
            min_p: c.min_p.filter(|&m| m > 0.0),
        };
        (filter != SupportFilter::default()).then_some(filter)
    }

    /// The validated configuration.
    pub fn config(&self) -> &GrpoLossConfig {
        &self.config
    }

    /// True when the ratio is one per sequence (GSPO) or the loss needs a
    /// per-sequence reduction of ratios before any gradient (vespo): such losses need
    /// every token's logp before the backward can start.
    pub fn needs_sequence_reduction(&self) -> bool {
        self.config.importance_sampling_level == ImportanceSamplingLevel::Sequence
            || self.config.loss_type == LossType::Vespo
    }

    /// Refuses a truncated support (`Unsupported`, naming the filter) where `kernel`
    /// computes the full softmax only (the logits-level kernels, the JAX policy stage on
    /// given statistics).
    pub fn check_full_softmax(&self, kernel: &str) -> Result<()> {
        let Some(feature) = self.support().and_then(|f| f.first_set()) else {
            return Ok(());
        };
        Err(Error::Unsupported {
            feature,
            reason: format!(
                "{kernel} computes the full softmax; the sampler's truncated support is taken \
                 by the fused LM-head GRPO (linear_grpo_loss)"
            ),
        })
    }

    /// True when no gradient may start before every row's statistics are known: a
    /// sequence-level reduction, or a truncated support (its cut, and so the mask,
    /// needs each row's whole vocabulary first).
    pub fn needs_two_pass(&self) -> bool {
        self.needs_sequence_reduction() || self.support().is_some()
    }
}
