//! Log-softmax of one row in f64, materialized.

/// The softmax statistics of one row of scaled logits `s = z / T_temp`.
#[derive(Debug, Clone)]
pub struct RowSoftmax {
    /// `lse = log Σ_j exp(s_j)`.
    pub lse: f64,
    /// `log p_j = s_j - lse` for every j (`-inf` where `z_j = -inf`).
    pub log_probs: Vec<f64>,
    /// `H = -Σ_j p_j log p_j` (terms with `p_j = 0` are 0).
    pub entropy: f64,
}

/// Materializes the log-softmax of `logits / temperature`.
pub fn row_softmax(logits: &[f64], temperature: f64) -> RowSoftmax {
    let s: Vec<f64> = logits.iter().map(|z| z / temperature).collect();
    let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
    let lse = max + sum.ln();
    let log_probs: Vec<f64> = s.iter().map(|x| x - lse).collect();
    let entropy = -log_probs
        .iter()
        .map(|&lp| if lp.exp() > 0.0 { lp.exp() * lp } else { 0.0 })
        .sum::<f64>();
    RowSoftmax {
        lse,
        log_probs,
        entropy,
    }
}
