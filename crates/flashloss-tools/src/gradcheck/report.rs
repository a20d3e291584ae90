//! What gradcheck measured: gates (an error and its bound) and the report, with the
//! error measures (max absolute and max relative differences, NaN propagating).

use super::config::Tolerance;
use flashloss::policy::GrpoMetrics;
use serde::Serialize;

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
    pub(crate) fn new(name: &'static str, value: f64, limit: f64) -> Self {
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
    /// What ran, e.g. `linear ce single_pass`.
    pub kernel: String,
    /// Reference loss.
    pub loss_ref: f64,
    /// Kernel loss.
    pub loss_kernel: f64,
    /// `|loss_kernel - loss_ref|`.
    pub abs_diff_loss: f64,
    /// Reference metrics (GRPO).
    pub metrics_ref: Option<GrpoMetrics>,
    /// Kernel metrics (GRPO).
    pub metrics_kernel: Option<GrpoMetrics>,
    /// Seconds of the kernel's forward + backward.
    pub kernel_seconds: f64,
    /// Every gate: relative errors for loss, logp and entropy; max absolute
    /// differences for gradients (`dlogits`, or `dhidden`, `dweight`, `dbias`).
    pub gates: Vec<Gate>,
    /// All gates passed.
    pub passed: bool,
}

impl GradcheckReport {
    /// The gate called `name`.
    pub fn gate(&self, name: &str) -> Option<&Gate> {
        self.gates.iter().find(|g| g.name == name)
    }

    pub(crate) fn new(
        kernel: String,
        loss: (f64, f64),
        metrics: Option<(GrpoMetrics, GrpoMetrics)>,
        kernel_seconds: f64,
        gates: Vec<Gate>,
    ) -> Self {
        GradcheckReport {
            kernel,
            loss_ref: loss.0,
            loss_kernel: loss.1,
            abs_diff_loss: (loss.1 - loss.0).abs(),
            metrics_ref: metrics.map(|m| m.0),
            metrics_kernel: metrics.map(|m| m.1),
            kernel_seconds,
            passed: gates.iter().all(|g| g.passed),
            gates,
        }
    }
}

pub(crate) fn max_abs_diff(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> f64 {
    max_abs_diff_by(a.zip(b).map(|(x, y)| (x - y).abs()))
}

/// NaN-propagating max of errors, so an unwritten (NaN-poisoned) element fails every gate.
pub(crate) fn max_abs_diff_by(errors: impl Iterator<Item = f64>) -> f64 {
    errors.fold(0.0, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// `max |got - want| / max(|want|, 1)` over `(got, want)` pairs (NaN propagates).
pub(crate) fn worst_rel(pairs: impl Iterator<Item = (f32, f64)>) -> f64 {
    max_abs_diff_by(pairs.map(|(g, w)| (g as f64 - w).abs() / w.abs().max(1.0)))
}

/// The gate of one gradient: `max|Δg| ≤ max(grad_rel · max|g_ref|, grad_atol · rows)`,
/// where `rows` is 1 for an entry that holds one row's contribution (`dlogits`, `dH`)
/// and `Σ_i |c_i|` for one that sums rows (`dW`, `dbias`: spec, "Absolute floor of a
/// summed gradient entry").
pub(crate) fn grad_gate(
    name: &'static str,
    got: impl Iterator<Item = f64>,
    want: &[f64],
    tol: &Tolerance,
    rows: f64,
) -> Gate {
    grad_gate_scaled(name, got, want, max_abs(want), tol, rows)
}

/// [`grad_gate`] relative to `scale` instead of `max|g_ref|`.
pub(crate) fn grad_gate_scaled(
    name: &'static str,
    got: impl Iterator<Item = f64>,
    want: &[f64],
    scale: f64,
    tol: &Tolerance,
    rows: f64,
) -> Gate {
    let floor = tol.grad_atol.unwrap_or_default() * rows;
    Gate::new(
        name,
        max_abs_diff(got, want.iter().cloned()),
        (tol.grad_rel.unwrap_or_default() * scale).max(floor),
    )
}

/// `max |x|` (0 for none).
pub(crate) fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0f64, |m, v| m.max(v.abs()))
}
