//! `flashloss gradcheck`: random inputs, the f64 reference and a kernel side by side,
//! and tolerance gates (spec: "Numerical tolerances").

use super::inputs::{GrpoInputs, InputSpec};
use crate::batch::LogitsLayout;
use crate::config::{GrpoLoss, LossConfig};
use crate::cpu::grpo_logits_forward;
use crate::element::{DType, Element};
use crate::error::Result;
use crate::policy::{GrpoMetrics, Normalizers};
use crate::reference::{dense_f64, grpo_reference};
use half::bf16;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The gradcheck config file (`configs/gradcheck/*.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GradcheckConfig {
    /// B.
    pub batch: usize,
    /// T.
    pub seq_len: usize,
    /// V.
    pub vocab: usize,
    /// Storage dtype of the logits.
    pub dtype: DType,
    /// Seed of the inputs.
    pub seed: u64,
    /// Expected fraction of padding positions.
    pub masked_fraction: f64,
    /// Standard deviation of the logits.
    pub logit_std: f64,
    /// Draw old-policy logp.
    pub old_logp: bool,
    /// Draw reference logp (needed when `loss.beta > 0`).
    pub ref_logp: bool,
    /// Draw a sampler importance ratio.
    pub sampler_ratio: bool,
    /// Per-token advantages.
    pub per_token_advantages: bool,
    /// Upstream gradient that scales `dlogits`.
    pub grad_output: f64,
    /// Write `dlogits` over the logits.
    pub in_place: bool,
    /// The loss.
    pub loss: LossConfig,
    /// Gates; unset ones take the spec's value for `dtype`.
    pub tolerance: Tolerance,
}

impl Default for GradcheckConfig {
    fn default() -> Self {
        let inputs = InputSpec::default();
        GradcheckConfig {
            batch: inputs.batch,
            seq_len: inputs.seq_len,
            vocab: inputs.vocab,
            dtype: DType::F32,
            seed: 0,
            masked_fraction: inputs.masked_fraction,
            logit_std: inputs.logit_std,
            old_logp: inputs.old_logp,
            ref_logp: inputs.ref_logp,
            sampler_ratio: inputs.sampler_ratio,
            per_token_advantages: inputs.per_token_advantages,
            grad_output: 1.0,
            in_place: false,
            loss: LossConfig::default(),
            tolerance: Tolerance::default(),
        }
    }
}

impl GradcheckConfig {
    /// The inputs this config draws.
    pub fn input_spec(&self) -> InputSpec {
        InputSpec {
            batch: self.batch,
            seq_len: self.seq_len,
            vocab: self.vocab,
            masked_fraction: self.masked_fraction,
            logit_std: self.logit_std,
            old_logp: self.old_logp,
            ref_logp: self.ref_logp,
            sampler_ratio: self.sampler_ratio,
            per_token_advantages: self.per_token_advantages,
        }
    }
}

/// Tolerance gates (spec defaults: f32 1e-5 / 1e-4 / 1e-6; bf16 1e-3 / 1e-2).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tolerance {
    /// `|ΔL| ≤ loss_rel · max(|L_ref|, 1)`.
    pub loss_rel: Option<f64>,
    /// `|Δlogp_i| ≤ logp_rel · max(|logp_i|, 1)`, and the same for entropy.
    pub logp_rel: Option<f64>,
    /// `max|Δdz| ≤ max(grad_rel · max|dz_ref|, grad_atol)`.
    pub grad_rel: Option<f64>,
    /// Absolute floor of the gradient gate.
    pub grad_atol: Option<f64>,
}

impl Tolerance {
    /// Fills unset gates with the spec's values for `dtype`.
    pub fn resolved(self, dtype: DType) -> Tolerance {
        let (loss, grad) = match dtype {
            DType::F32 => (1e-5, 1e-4),
            DType::Bf16 => (1e-3, 1e-2),
        };
        Tolerance {
            loss_rel: Some(self.loss_rel.unwrap_or(loss)),
            logp_rel: Some(self.logp_rel.unwrap_or(1e-5)),
            grad_rel: Some(self.grad_rel.unwrap_or(grad)),
            grad_atol: Some(self.grad_atol.unwrap_or(1e-6)),
        }
    }
}

/// One tolerance gate.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    /// What is compared.
    pub name: &'static str,
    /// The measured error.
    pub value: f64,
    /// The bound.
    pub limit: f64,
    /// `value ≤ limit` (false for NaN).
    pub passed: bool,
}

impl Gate {
    fn new(name: &'static str, value: f64, limit: f64) -> Self {
        Gate {
            name,
            value,
            limit,
            passed: value <= limit,
        }
    }
}

/// What gradcheck measured.
#[derive(Debug, Clone, Serialize)]
pub struct GradcheckReport {
    /// Reference loss.
    pub loss_ref: f64,
    /// Kernel loss.
    pub loss_kernel: f64,
    /// `|loss_kernel - loss_ref|`.
    pub abs_diff_loss: f64,
    /// Max over live rows of `|Δlogp|`.
    pub max_abs_diff_logp: f64,
    /// Max over live rows of `|ΔH|`.
    pub max_abs_diff_entropy: f64,
    /// `max |Δdz|`.
    pub max_abs_diff_dlogits: f64,
    /// `max |Δdz| / max |dz_ref|`.
    pub max_rel_diff_dlogits: f64,
    /// Reference metrics.
    pub metrics_ref: GrpoMetrics,
    /// Kernel metrics.
    pub metrics_kernel: GrpoMetrics,
    /// Seconds of the kernel's forward + backward.
    pub kernel_seconds: f64,
    /// Every gate.
    pub gates: Vec<Gate>,
    /// All gates passed.
    pub passed: bool,
}

/// Runs gradcheck as configured.
pub fn run(cfg: &GradcheckConfig) -> Result<GradcheckReport> {
    let loss = GrpoLoss::new(cfg.loss.clone())?;
    let inputs = GrpoInputs::random(&cfg.input_spec(), cfg.seed);
    match cfg.dtype {
        DType::F32 => check_inputs(cfg, &loss, &inputs, inputs.logits.clone()),
        DType::Bf16 => {
            let data = inputs.logits.iter().map(|&x| bf16::from_f32(x)).collect();
            check_inputs(cfg, &loss, &inputs, data)
        }
    }
}

fn max_abs_diff(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> f64 {
    // NaN-propagating max, so an unwritten (NaN-poisoned) element fails every gate.
    a.zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// Compares kernel and reference on given inputs (`logits` in the storage dtype,
/// dense `[B, T, V]`); `cfg` gives `grad_output`, `in_place` and the gates.
pub fn check_inputs<E: Element>(
    cfg: &GradcheckConfig,
    loss: &GrpoLoss,
    inputs: &GrpoInputs,
    mut logits: Vec<E>,
) -> Result<GradcheckReport> {
    let batch = inputs.batch();
    let layout = LogitsLayout::contiguous(inputs.batch, inputs.seq_len, inputs.vocab);
    batch.validate(layout.vocab, loss)?;
    let reference = grpo_reference(
        loss,
        &batch,
        Normalizers::local(&batch),
        &dense_f64(&logits, &layout),
        layout.vocab,
        cfg.grad_output,
    );

    let start = Instant::now();
    let fwd = grpo_logits_forward(loss, &batch, &logits, &layout)?;
    let dlogits: Vec<E> = if cfg.in_place {
        fwd.backward_in_place(&mut logits, cfg.grad_output as f32)?;
        logits
    } else {
        let mut out = vec![E::from_f32(f32::NAN); layout.rows() * layout.vocab];
        fwd.backward(&logits, cfg.grad_output as f32, &mut out)?;
        out
    };
    let kernel_seconds = start.elapsed().as_secs_f64();

    let live: Vec<usize> = (0..layout.rows()).filter(|&i| batch.mask[i]).collect();
    let tol = cfg.tolerance.resolved(E::DTYPE);
    let rel_err = |got: f32, want: f64| (got as f64 - want).abs() / want.abs().max(1.0);
    let worst_rel = |f: &dyn Fn(usize) -> f64| {
        live.iter()
            .map(|&i| f(i))
            .fold(0.0, |m: f64, d| if d.is_nan() || d > m { d } else { m })
    };
    let logp_err = worst_rel(&|i| rel_err(fwd.stats[i].logp, reference.logp[i]));
    let entropy_err = worst_rel(&|i| rel_err(fwd.stats[i].entropy, reference.entropy[i]));
    let max_abs_diff_logp = max_abs_diff(
        live.iter().map(|&i| fwd.stats[i].logp as f64),
        live.iter().map(|&i| reference.logp[i]),
    );
    let max_abs_diff_entropy = max_abs_diff(
        live.iter().map(|&i| fwd.stats[i].entropy as f64),
        live.iter().map(|&i| reference.entropy[i]),
    );
    let max_abs_diff_dlogits = max_abs_diff(
        dlogits.iter().map(|x| x.to_f32() as f64),
        reference.dlogits.iter().cloned(),
    );
    let max_ref = reference.dlogits.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let max_rel_diff_dlogits = max_abs_diff_dlogits / max_ref.max(f64::MIN_POSITIVE);
    let abs_diff_loss = (fwd.loss - reference.loss).abs();

    let gates = vec![
        Gate::new(
            "loss",
            abs_diff_loss / reference.loss.abs().max(1.0),
            tol.loss_rel.unwrap_or_default(),
        ),
        Gate::new("logp", logp_err, tol.logp_rel.unwrap_or_default()),
        Gate::new("entropy", entropy_err, tol.logp_rel.unwrap_or_default()),
        Gate::new(
            "dlogits",
            max_abs_diff_dlogits,
            (tol.grad_rel.unwrap_or_default() * max_ref).max(tol.grad_atol.unwrap_or_default()),
        ),
    ];
    Ok(GradcheckReport {
        loss_ref: reference.loss,
        loss_kernel: fwd.loss,
        abs_diff_loss,
        max_abs_diff_logp,
        max_abs_diff_entropy,
        max_abs_diff_dlogits,
        max_rel_diff_dlogits,
        metrics_ref: reference.metrics,
        metrics_kernel: fwd.metrics,
        kernel_seconds,
        passed: gates.iter().all(|g| g.passed),
        gates,
    })
}
