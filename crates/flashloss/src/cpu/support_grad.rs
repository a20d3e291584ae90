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
        if support_key(z, inv_temp, term.offset + start + o) >= term.cut {
            d += term.coef * exp_nonpositive((shifted - term.log_sum).min(0.0));
        }
        *v = if inv_cap == 0.0 {
            d
        } else {
            d * softcap_slope(z, inv_cap)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::RowStats;

    /// Every term against f64, with and without a soft-cap, the support cut inside a
    /// run of ties (the order's index decides).
    #[test]
    fn terms_match_f64_on_and_off_the_support() {
        let row: Vec<f32> = (0..40).map(|j| ((j * 7) % 11) as f32 * 0.5 - 2.0).collect();
        let (inv_temp, start) = (0.5f32, 100);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s = |z: f32| ((z - max) * inv_temp) as f64;
        let log_sum: f64 = row.iter().map(|&z| s(z).exp()).sum::<f64>().ln();
        let entropy = -row
            .iter()
            .map(|&z| (s(z) - log_sum).exp() * (s(z) - log_sum))
            .sum::<f64>();
        // The cut: value 1.0 (z = 2), index 100 + 20; ties at 1.0 below index 120 are out.
        let cut = support_key(2.0, inv_temp, start + 20);
        let in_k = |j: usize| support_key(row[j], inv_temp, start + j) >= cut;
        let log_sum_k: f64 = (0..row.len())
            .filter(|&j| in_k(j))
            .map(|j| s(row[j]).exp())
            .sum::<f64>()
            .ln();
        for inv_cap in [0.0f32, 1.0 / 30.0] {
            let g = RowGrad {
                stats: RowStats {
                    max,
                    log_sum: log_sum as f32,
                    entropy: entropy as f32,
                    ..RowStats::default()
                },
                coef_p: 0.25,
                coef_h: -0.5,
                coef_uniform: 0.125,
                ..RowGrad::default()
            };
            let term = SupportTerm {
                coef: -0.75,
                log_sum: log_sum_k as f32,
                cut,
                offset: 0,
            };
            let mut got = row.clone();
            support_grad_row(&mut got, start, (&g, &term), inv_temp, inv_cap);
            for (j, &z) in row.iter().enumerate() {
                let (lp, lpk) = (s(z) - log_sum, s(z) - log_sum_k);
                let slope = 1.0 - (z as f64 * inv_cap as f64).powi(2);
                let k = if in_k(j) { -0.75 * lpk.exp() } else { 0.0 };
                let want = (0.25 * lp.exp() - 0.5 * lp.exp() * (lp + entropy) + 0.125 + k) * slope;
                assert!(
                    (got[j] as f64 - want).abs() < 1e-5,
                    "cap {inv_cap} j {j}: {} vs {want}",
                    got[j]
                );
            }
            assert!(
                in_k(39) && !in_k(9) && row[9] == row[20],
                "the cut splits a run of ties"
            );
        }
    }
}
