//! A logits row's gradient with a truncated support's term
//! ([`crate::fused::SupportTerm`]): with `p_j = exp((z_j - max)·inv_temp - log_sum)`,
//! `p^K_j = exp((z_j - max)·inv_temp - log_sum^K)` and `K = {j : key(s_j, j) ≥ cut}`
//! (`s_j = fl(z_j·inv_temp)`, the key of the support's order),
//! `dz_j = (coef_p·p_j + coef_h·p_j·(log p_j + H) + uniform + coef·p^K_j·1[j∈K])·slope_j`,
//! the softmax terms vectorized as on any row, the support's term added at the entries
//! of `K` (the row becomes `dZ` in place; the target term is added by the caller).

use super::simd::{SoftmaxGrad, exp_nonpositive, softcap_slope, softmax_grad};
use crate::fused::{SupportTerm, support_key};

/// Writes the gradient of `row` (logits of vocabulary entries from `start`) over it:
/// the row's softmax terms `params` (vectorized, as a row without a support), then the
/// support's term at the entries of `K`, found by their scaled logit first
/// (`s_j ≥ value(cut)` is necessary for `key_j ≥ cut`) and read before the row is
/// overwritten.
pub(crate) fn support_grad_row(
    row: &mut [f32],
    start: usize,
    (params, term): (&SoftmaxGrad, &SupportTerm),
) {
    let (inv_temp, cut_value) = (params.scale, term.cut_value());
    let mut adds = Vec::new();
    for (o, &z) in row.iter().enumerate() {
        if z * inv_temp >= cut_value
            && support_key(z, inv_temp, term.offset + start + o) >= term.cut
        {
            let shifted = (z - params.max) * inv_temp;
            let add = term.coef * exp_nonpositive((shifted - term.log_sum).min(0.0));
            let slope = if params.inv_cap == 0.0 {
                1.0
            } else {
                softcap_slope(z, params.inv_cap)
            };
            adds.push((o, add * slope));
        }
    }
    softmax_grad(row, params);
    for (o, add) in adds {
        row[o] += add;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::RowGrad;
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
            let params = SoftmaxGrad {
                max: g.stats.max,
                scale: inv_temp,
                log_sum: g.stats.log_sum,
                coef_p: g.coef_p,
                coef_h: g.coef_h,
                entropy: g.stats.entropy,
                uniform: g.coef_uniform,
                inv_cap,
            };
            let mut got = row.clone();
            support_grad_row(&mut got, start, (&params, &term));
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
