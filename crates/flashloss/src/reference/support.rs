//! The truncated support of vLLM V1's sampler on one row, materialized in f64
//! (docs/spec/losses.md, "Truncated support", and flashloss addition 12 for ties).
//!
//! The support is decided on the f32 scaled logits `s_j = fl(fl(z_j)·fl(1/T))` (`-0` as
//! `+0`), the
//! values a kernel sees, in vLLM's order: min-p keeps `exp(s_j - max s) ≥ min_p` (f64);
//! top-k keeps, of what is left, `s_j ≥` the k-th largest remaining value (ties kept);
//! top-p sorts what is left ascending by `(s_j, j)` (stable: among equal values the lower
//! index first), renormalizes it, and drops every entry whose ascending cumulative sum is
//! `≤ 1 - top_p`, always keeping the largest. The values (`lse^K`, `logp^K`, gradients)
//! are formed in f64 from `z_j / T`.

use crate::support_filter::SupportFilter;

/// One row's truncated support and its statistics.
#[derive(Debug, Clone)]
pub struct SupportRow {
    /// Whether each entry is in the support `K`.
    pub in_support: Vec<bool>,
    /// `|K|`.
    pub size: usize,
    /// `lse^K = log Σ_{j∈K} exp(z_j/T)`.
    pub lse: f64,
    /// `logp^K = z_y/T - lse^K`, `-inf` when `y ∉ K`.
    pub logp: f64,
    /// `∂logp^K/∂z_j = (1[j=y] - p^K_j)/T` on `K`, 0 elsewhere (all 0 when `y ∉ K`).
    pub dlogp: Vec<f64>,
    /// How far the decisions are from flipping: the smallest of min-p's
    /// `|exp(s_j - max s) - min_p|/min_p`, top-k's gap between the k-th value and the next
    /// smaller one relative to `max(1, |v_k|)`, and top-p's `|c_m - (1 - top_p)|` over
    /// the ascending cumulative sums (`inf` where no filter cuts). Inputs whose f32
    /// logits may differ from the reference's by rounding compare only rows with a
    /// margin above that rounding.
    pub margin: f64,
}

/// The support of the row of logits `z` (after bias and soft-cap, before the
/// temperature) at `temperature` for target `target`, with `filters`.
pub fn support_row(
    z: &[f64],
    temperature: f64,
    target: usize,
    filters: SupportFilter,
) -> SupportRow {
    let v = z.len();
    let inv_temp = (1.0 / temperature) as f32;
    // `+ 0.0` makes `-0` `+0`: equal values compare equal in the (value, index) order.
    let s: Vec<f32> = z.iter().map(|&x| x as f32 * inv_temp + 0.0).collect();
    let s_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let rel = |j: usize| (s[j] as f64 - s_max).exp();
    let mut keep = vec![true; v];
    let mut margin = f64::INFINITY;
    // min-p.
    if let Some(min_p) = filters.min_p.filter(|&m| m > 0.0) {
        for (j, k) in keep.iter_mut().enumerate() {
            *k = rel(j) >= min_p;
            margin = margin.min((rel(j) - min_p).abs() / min_p);
        }
    }
    // Ascending by (s, j): the kept entries in the order top-k and top-p see them.
    let ascending = |keep: &[bool]| {
        let mut order: Vec<usize> = (0..v).filter(|&j| keep[j]).collect();
        order.sort_by(|&a, &b| s[a].total_cmp(&s[b]).then(a.cmp(&b)));
        order
    };
    // top-k.
    if let Some(k) = filters.top_k.filter(|&k| k < v) {
        let order = ascending(&keep);
        if order.len() > k {
            let v_k = s[order[order.len() - k]];
            let below = order.iter().rev().map(|&j| s[j]).find(|&x| x < v_k);
            if let Some(next) = below {
                margin = margin.min((v_k - next) as f64 / (v_k.abs() as f64).max(1.0));
            }
            for &j in &order {
                keep[j] = s[j] >= v_k;
            }
        }
    }
    // top-p, renormalized over what is left.
    if let Some(top_p) = filters.top_p.filter(|&p| p < 1.0) {
        let order = ascending(&keep);
        let mass: f64 = order.iter().map(|&j| rel(j)).sum();
        let mut cumulative = 0.0;
        for (m, &j) in order.iter().enumerate() {
            cumulative += rel(j) / mass;
            margin = margin.min((cumulative - (1.0 - top_p)).abs());
            keep[j] = cumulative > 1.0 - top_p || m + 1 == order.len();
        }
    }
    let s64: Vec<f64> = z.iter().map(|&x| x / temperature).collect();
    let kept_max = (0..v)
        .filter(|&j| keep[j])
        .map(|j| s64[j])
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = (0..v)
        .filter(|&j| keep[j])
        .map(|j| (s64[j] - kept_max).exp())
        .sum();
    let lse = kept_max + sum.ln();
    let hit = keep[target];
    let dlogp = (0..v)
        .map(|j| match (hit && keep[j], j == target) {
            (false, _) => 0.0,
            (true, at_y) => (f64::from(u8::from(at_y)) - (s64[j] - lse).exp()) / temperature,
        })
        .collect();
    SupportRow {
        size: keep.iter().filter(|&&k| k).count(),
        in_support: keep,
        lse,
        logp: if hit {
            s64[target] - lse
        } else {
            f64::NEG_INFINITY
        },
        dlogp,
        margin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filters(top_k: Option<usize>, top_p: Option<f64>, min_p: Option<f64>) -> SupportFilter {
        SupportFilter {
            top_k,
            top_p,
            min_p,
        }
    }

    fn kept(z: &[f64], f: SupportFilter) -> Vec<usize> {
        let row = support_row(z, 1.0, 0, f);
        (0..z.len()).filter(|&j| row.in_support[j]).collect()
    }

    #[test]
    fn each_filter_in_vllm_order() {
        let ln2 = 2f64.ln();
        // p ∝ 8, 4, 2, 1, 1 (ids 0..5); max p = 8/16.
        let z = [3.0 * ln2, 2.0 * ln2, ln2, 0.0, 0.0];
        assert_eq!(kept(&z, filters(None, None, None)), [0, 1, 2, 3, 4]);
        assert_eq!(
            kept(&z, filters(Some(5), Some(1.0), Some(0.0))),
            [0, 1, 2, 3, 4]
        );
        // min-p 0.2: keep p ≥ 1.6/16.
        assert_eq!(kept(&z, filters(None, None, Some(0.2))), [0, 1, 2]);
        // top-k: the 3rd value is unique; the 4th is tied with the 5th, both kept.
        assert_eq!(kept(&z, filters(Some(3), None, None)), [0, 1, 2]);
        assert_eq!(kept(&z, filters(Some(4), None, None)), [0, 1, 2, 3, 4]);
        // top-p 0.7: ascending sums 1/16, 2/16, 4/16, 8/16, 1; ≤ 0.3 dropped.
        assert_eq!(kept(&z, filters(None, Some(0.7), None)), [0, 1]);
        // Ties inside top-p: the lower index goes first (3 before 4).
        assert_eq!(kept(&z, filters(None, Some(0.9), None)), [0, 1, 2, 4]);
        // top-p renormalized after top-k 2: masses 8/12, 4/12; 0.5 keeps only the largest.
        assert_eq!(kept(&z, filters(Some(2), Some(0.5), None)), [0]);
        assert_eq!(kept(&z, filters(Some(2), Some(0.7), None)), [0, 1]);
        // min-p then top-k on what is left.
        assert_eq!(kept(&z, filters(Some(1), None, Some(0.1))), [0]);
        // top-p tiny: always keeps the largest.
        assert_eq!(kept(&z, filters(None, Some(1e-9), None)), [0]);
    }

    #[test]
    fn statistics_and_gradient_on_the_support() {
        let z = [1.0, 3.0, 2.0, -4.0];
        let t = 0.5;
        let f = filters(Some(2), None, None);
        let row = support_row(&z, t, 2, f);
        assert_eq!(row.in_support, [false, true, true, false]);
        assert_eq!(row.size, 2);
        let lse = (6f64.exp() + 4f64.exp()).ln();
        assert!((row.lse - lse).abs() < 1e-12);
        assert!((row.logp - (4.0 - lse)).abs() < 1e-12);
        let p1 = (6.0 - lse).exp();
        assert!((row.dlogp[1] + p1 / t).abs() < 1e-12);
        assert!((row.dlogp[2] - (1.0 - (4.0 - lse).exp()) / t).abs() < 1e-12);
        assert_eq!((row.dlogp[0], row.dlogp[3]), (0.0, 0.0));
        // Outside the support: -inf, zero gradient.
        let out = support_row(&z, t, 0, f);
        assert_eq!(out.logp, f64::NEG_INFINITY);
        assert!(out.dlogp.iter().all(|&d| d == 0.0));
        // The gap between the 2nd and 3rd values (4 and 2 after 1/T) over max(1, 4).
        assert!((row.margin - 0.5).abs() < 1e-12);
    }
}
