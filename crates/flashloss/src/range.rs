//! Numeric range (spec: "Numeric range"): a valid input can still take a loss or a
//! gradient beyond what f32 holds (a policy far from its old or reference log-probs
//! at a small temperature gives ratios like `e^160`). The kernels check, once per row
//! after the policy stage (O(N), never per logit), that every per-row quantity the
//! kernel stores or multiplies into a gradient is finite in f32, and return
//! [`Error::OutOfRange`] naming the first row and quantity that is not, before any
//! gradient is written. A NaN or infinite gradient never leaves a kernel.

use crate::batch::first_non_finite;
use crate::error::{Error, Result};
use crate::policy::PolicyOutput;
use crate::rows::RowStats;
use crate::weight_layout::WeightLayout;
use std::ops::Range;

/// The largest magnitude an f32 holds.
pub const F32_LIMIT: f64 = f32::MAX as f64;

/// Whether `x` is finite and within the f32 range.
pub fn fits_f32(x: f64) -> bool {
    x.is_finite() && x.abs() <= F32_LIMIT
}

fn out_of_range(row: usize, seq_len: usize, quantity: &'static str, value: f64) -> Error {
    let seq_len = seq_len.max(1);
    Error::OutOfRange {
        row,
        position: Some((row / seq_len, row % seq_len)),
        quantity,
        value,
    }
}

/// The error of a fused LM head's gradient entry `index` of `quantity` (`dhidden`,
/// `dweight` or `dbias`) that is not finite: an [`Error::OutOfRange`] at its token row
/// (`dhidden`, placed in its sequence of `seq_len`) or vocabulary row.
pub fn grad_out_of_range(
    quantity: &'static str,
    index: usize,
    value: f32,
    hidden_size: usize,
    seq_len: usize,
) -> Error {
    let h = hidden_size.max(1);
    match quantity {
        "dhidden" => out_of_range(index / h, seq_len, quantity, value as f64),
        _ => Error::OutOfRange {
            row: if quantity == "dbias" {
                index
            } else {
                index / h
            },
            position: None,
            quantity,
            value: value as f64,
        },
    }
}

/// Checks a fused LM head's gradients in host memory (scanned in parallel; `dweight` in
/// `layout`): the first entry that is not finite (a sum over the vocabulary or the
/// tokens can leave f32 even where every logit's gradient is in range, e.g. with an
/// extreme `grad_output`) is [`grad_out_of_range`]'s error.
pub fn check_linear_grads(
    dhidden: &[f32],
    (dweight, layout): (&[f32], WeightLayout),
    dbias: Option<&[f32]>,
    hidden_size: usize,
    seq_len: usize,
) -> Result<()> {
    let h = hidden_size.max(1);
    let v = dweight.len() / h;
    for (quantity, values) in [
        ("dhidden", dhidden),
        ("dweight", dweight),
        ("dbias", dbias.unwrap_or(&[])),
    ] {
        if let Some(k) = first_non_finite::<f32>(values) {
            // A `[H, V]` dW entry as its `[V, H]` index (its vocabulary row).
            let index = match (quantity, layout) {
                ("dweight", WeightLayout::HiddenMajor) => (k % v) * h + k / v,
                _ => k,
            };
            return Err(grad_out_of_range(
                quantity,
                index,
                values[k],
                hidden_size,
                seq_len,
            ));
        }
    }
    Ok(())
}

/// Bound on `|dz_j|` of a row whose gradient is
/// `dz_j = scale·[dlogp·(1[j=y] - p_j) - dentropy·p_j·(log p_j + H)]`:
/// `|scale|·(|dlogp| + |dentropy|·max(1, 1/e + |H|))` (as `|p·log p| ≤ 1/e`; the `max`
/// also bounds the f32 coefficient `scale·dentropy` the kernels multiply by, which
/// exceeds every `|dz_j|` where `1/e + H < 1`: spec, flashloss addition 6).
pub fn grpo_grad_bound(scale: f64, dlogp: f64, dentropy: f64, entropy: f64) -> f64 {
    let spread = (std::f64::consts::E.recip() + entropy.abs()).max(1.0);
    scale.abs() * (dlogp.abs() + dentropy.abs() * spread)
}

/// Checks the policy stage's outputs of the live `rows` (`live(i)`), in row order:
/// each row's share of the loss, its KL, `∂L/∂logp`, `∂L/∂H`, the bound
/// [`grpo_grad_bound`] of its logits' gradient for an upstream `scale = g/T`
/// (`None`: not checked here), and the running sum of the loss, all within f32.
pub fn check_policy_rows(
    policy: &PolicyOutput,
    stats_entropy: impl Fn(usize) -> f32,
    rows: Range<usize>,
    live: impl Fn(usize) -> bool,
    seq_len: usize,
    scale: Option<f64>,
) -> Result<()> {
    let mut total = 0.0f64;
    for i in rows.filter(|&i| live(i)) {
        total += policy.token_loss[i];
        let checks = [
            ("kl", policy.kl[i] as f64),
            ("loss", policy.token_loss[i]),
            ("dlogp", policy.dlogp[i] as f64),
            ("dentropy", policy.dentropy[i] as f64),
            ("loss (running sum)", total),
        ];
        if let Some((quantity, value)) = checks.into_iter().find(|(_, v)| !fits_f32(*v)) {
            return Err(out_of_range(i, seq_len, quantity, value));
        }
        if let Some(scale) = scale {
            let bound = grpo_grad_bound(
                scale,
                policy.dlogp[i] as f64,
                policy.dentropy[i] as f64,
                stats_entropy(i) as f64,
            );
            if !fits_f32(bound) {
                return Err(out_of_range(i, seq_len, "dlogits", bound));
            }
        }
    }
    Ok(())
}

/// Checks the backward coefficients of a logits-level forward for an upstream
/// `scale = g/T`: the bound [`grpo_grad_bound`] of each live row's gradient.
pub fn check_grad_coefs(
    dlogp: &[f32],
    dentropy: &[f32],
    stats: &[RowStats],
    seq_len: usize,
    scale: f64,
) -> Result<()> {
    for i in 0..dlogp.len() {
        if dlogp[i] == 0.0 && dentropy[i] == 0.0 {
            continue;
        }
        let bound = grpo_grad_bound(
            scale,
            dlogp[i] as f64,
            dentropy[i] as f64,
            stats[i].entropy as f64,
        );
        if !fits_f32(bound) {
            return Err(out_of_range(i, seq_len, "dlogits", bound));
        }
    }
    Ok(())
}

/// Checks a cross-entropy row's loss `value` (and the running sum `total`) and its
/// gradient coefficient.
pub fn check_ce_row(row: usize, value: f64, total: f64, coef: f64, seq_len: usize) -> Result<()> {
    for (quantity, v) in [
        ("loss", value),
        ("loss (running sum)", total),
        ("dlogits", coef),
    ] {
        if !fits_f32(v) {
            return Err(out_of_range(row, seq_len, quantity, v));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_and_fit() {
        assert!(fits_f32(3.0e38));
        assert!(!fits_f32(3.5e38));
        assert!(!fits_f32(f64::NAN));
        assert!(!fits_f32(f64::NEG_INFINITY));
        let b = grpo_grad_bound(-2.0, 1.0, -1.0, 1.0);
        assert!((b - 2.0 * (1.0 + (1.0 / std::f64::consts::E + 1.0))).abs() < 1e-12);
        // At H = 0 the coefficient `scale·dentropy` (2) exceeds every |dz_j| (2/e).
        assert_eq!(grpo_grad_bound(2.0, 0.0, -1.0, 0.0), 2.0);
    }

    #[test]
    fn policy_rows_name_the_first_bad_row_and_quantity() {
        let mut p = PolicyOutput::new(4);
        p.dlogp[2] = f32::INFINITY;
        p.token_loss[3] = 1e300;
        let err = check_policy_rows(&p, |_| 0.0, 0..4, |_| true, 2, None).unwrap_err();
        assert_eq!(
            err,
            Error::OutOfRange {
                row: 2,
                position: Some((1, 0)),
                quantity: "dlogp",
                value: f64::INFINITY
            }
        );
        // A masked row is not read.
        let ok = check_policy_rows(&p, |_| 0.0, 0..4, |i| i < 2, 2, None);
        assert_eq!(ok, Ok(()));
        // Each finite, the sum not.
        let mut p = PolicyOutput::new(2);
        p.token_loss = vec![3e38, 3e38];
        let err = check_policy_rows(&p, |_| 0.0, 0..2, |_| true, 2, None).unwrap_err();
        assert!(matches!(
            err,
            Error::OutOfRange {
                row: 1,
                quantity: "loss (running sum)",
                ..
            }
        ));
        // The gradient bound with the upstream scale.
        let mut p = PolicyOutput::new(1);
        p.dlogp[0] = 1e37;
        assert!(check_policy_rows(&p, |_| 0.0, 0..1, |_| true, 1, Some(1.0)).is_ok());
        let err = check_policy_rows(&p, |_| 0.0, 0..1, |_| true, 1, Some(100.0)).unwrap_err();
        assert!(matches!(
            err,
            Error::OutOfRange {
                quantity: "dlogits",
                ..
            }
        ));
    }
}
