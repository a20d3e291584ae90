//! A logits row's gradient with a truncated support's term
//! ([`crate::fused::SupportTerm`]): with `p_j = exp((z_j - max)·inv_temp - log_sum)`,
//! `p^K_j = exp((z_j - max)·inv_temp - log_sum^K)` and `K = {j : key(s_j, j) ≥ cut}`
//! (`s_j = fl(z_j·inv_temp)`, the key of the support's order),
//! `dz_j = (coef_p·p_j + coef_h·p_j·(log p_j + H) + uniform + coef·p^K_j·1[j∈K])·slope_j`,
//! each logit read once (the row becomes `dZ` in place; the target term is added by the
//! caller).

use super::simd::{exp_nonpositive, softcap_slope};
use crate::fused::{RowGrad, SupportTerm, support_key};

/// Writes the gradient of `row` (logits of vocabulary entries from `start`) over it.
pub(crate) fn support_grad_row(
    row: &mut [f32],
    start: usize,
    (g, term): (&RowGrad, &SupportTerm),
    inv_temp: f32,
    inv_cap: f32,
) {
    let st = &g.stats;
    for (o, v) in row.iter_mut().enumerate() {
        let z = *v;
        let shifted = (z - st.max) * inv_temp;
        let log_p = shifted - st.log_sum;
        let p = exp_nonpositive(log_p);
        let h = if p > 0.0 {
            p * (log_p + st.entropy)
        } else {
            0.0
        };
        let mut d = g.coef_p * p + g.coef_h * h + g.coef_uniform;
        if support_key(z, inv_temp, start + o) >= term.cut {
            d += term.coef * exp_nonpositive((shifted - term.log_sum).min(0.0));
        }
        *v = if inv_cap == 0.0 {
            d
        } else {
            d * softcap_slope(z, inv_cap)
        };
    }
}
