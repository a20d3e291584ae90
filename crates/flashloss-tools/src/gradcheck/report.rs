//! What gradcheck measured: gates (an error and its bound) and the report, with the
//! error measures (max absolute and max relative differences, NaN propagating).

use super::config::Tolerance;
use flashloss::cpu::Bf16Choice;
use flashloss::policy::{GrpoMetrics, Normalizers};
use flashloss::reference::grpo_reference_loss;
use flashloss::{GrpoBatch, GrpoLoss, RowStats};
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
    /// A bf16 head on the CPU: the products its `bf16_products` ran and why (`auto`:
    /// this process's measured rates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_choice: Option<Bf16Choice>,
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
            bf16_choice: None,
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

/// The loss gate: `|L_kernel - L_ref|` beyond `|L_implied - L_ref|`, where `L_implied` is
/// the reference's loss on the kernel's own per-token statistics (each under its own
/// gate): what their rounding does to a loss that amplifies it. Relative to
/// `max(|L_ref|, 1)`; NaN propagates (spec, flashloss addition 5).
pub(crate) fn loss_gate((want, got): (f64, f64), implied: f64, limit: f64) -> Gate {
    let slack = (implied - want).abs();
    let value = if got.is_nan() || slack.is_nan() {
        f64::NAN
    } else {
        ((got - want).abs() - slack).max(0.0) / want.abs().max(1.0)
    };
    Gate::new("loss", value, limit)
}

/// The reference's loss on a kernel's own per-token statistics: the `implied` loss of
/// [`loss_gate`].
pub(crate) fn implied_loss(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    norm: Normalizers,
    stats: &[RowStats],
) -> f64 {
    let stat = |f: fn(&RowStats) -> f32| stats.iter().map(|s| f(s) as f64).collect::<Vec<_>>();
    grpo_reference_loss(loss, batch, norm, &stat(|s| s.logp), &stat(|s| s.entropy))
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

#[cfg(test)]
mod tests {
    use super::loss_gate;

    /// The slack is what the reference makes of the kernel's statistics, no more: a
    /// kernel loss off by more than that fails, a NaN fails.
    #[test]
    fn loss_gate_allows_only_the_implied_error() {
        let gate = |got: f64, implied: f64| loss_gate((2.0, got), implied, 1e-5);
        assert!(gate(2.0 + 1e-5, 2.0).passed);
        assert!(!gate(2.0 + 1e-4, 2.0).passed);
        assert!(gate(2.0 + 1e-4, 2.0 + 1e-4).passed);
        assert!(gate(2.0 + 1e-4, 2.0 - 1e-4).passed);
        let off = gate(2.0 + 1e-3, 2.0 + 1e-4);
        assert!(!off.passed && (off.value - 4.5e-4).abs() < 1e-12, "{off:?}");
        assert!(!gate(f64::NAN, 2.0).passed);
        assert!(!gate(2.0, f64::NAN).passed);
    }
}
