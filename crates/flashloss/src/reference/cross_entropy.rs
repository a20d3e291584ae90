//! The cross-entropy loss of the spec in f64, on materialized logits.

use super::softmax::row_softmax;
use crate::cross_entropy::CrossEntropy;

/// Everything the reference computes; per-row vectors are `[N]` (0 where ignored).
#[derive(Debug, Clone)]
pub struct CeReference {
    /// The reduced loss (for reduction `none`: `Σ_i grad_rows_i·ℓ_i`, what the
    /// gradients are of).
    pub loss: f64,
    /// The z-loss part of `loss`, reduced the same way.
    pub z_loss: f64,
    /// Rows that are not ignored.
    pub count: usize,
    /// Per-row `ℓ_i`.
    pub row_loss: Vec<f64>,
    /// Per-row `lse_i` of the scaled (soft-capped) logits.
    pub lse: Vec<f64>,
    /// Per-row `logp_i = s_{i,y_i} - lse_i`.
    pub logp: Vec<f64>,
    /// `grad_output · ∂L/∂z` `[N, V]` w.r.t. the raw (uncapped) logits.
    pub dlogits: Vec<f64>,
}

/// Runs the reference on dense raw logits `[N, V]`; targets must be valid.
/// `grad_rows` (reduction `none` only) weights each row's loss; unset means ones.
/// Per row: `z' = cap·tanh(z/cap)`, `s = z'/T`, `p = softmax(s)`,
/// `∂ℓ/∂s_j = (1 + 2λ_z·lse)·p_j - (1-ε_ls)·[j = y] - ε_ls/V`,
/// `∂s_j/∂z_j = (1 - tanh²(z_j/cap)) / T`.
pub fn ce_reference(
    ce: &CrossEntropy,
    targets: &[i64],
    logits: &[f64],
    vocab: usize,
    grad_output: f64,
    grad_rows: Option<&[f32]>,
) -> CeReference {
    ce_reference_lse(ce, targets, logits, vocab, (grad_output, grad_rows), None)
}

/// [`ce_reference`] of `grad_output·L + Σ_i grad_lse_i·lse_i` (Cut Cross-Entropy's
/// `return_lse`: an upstream gradient on each counted row's log-sum-exp of the scaled
/// logits): `loss` is still `L`, `dlogits` the sum's gradient, adding
/// `grad_lse_i·p_ij·∂s_j/∂z_j` per row.
pub fn ce_reference_lse(
    ce: &CrossEntropy,
    targets: &[i64],
    logits: &[f64],
    vocab: usize,
    (grad_output, grad_rows): (f64, Option<&[f32]>),
    grad_lse: Option<&[f32]>,
) -> CeReference {
    let c = ce.config();
    let n = targets.len();
    let count = targets.iter().filter(|&&y| ce.counts(y)).count();
    let weight = ce.row_weight(count);
    let eps = c.label_smoothing;
    let mut out = CeReference {
        loss: 0.0,
        z_loss: 0.0,
        count,
        row_loss: vec![0.0; n],
        lse: vec![0.0; n],
        logp: vec![0.0; n],
        dlogits: vec![0.0; n * vocab],
    };
    for i in (0..n).filter(|&i| ce.counts(targets[i])) {
        let y = targets[i] as usize;
        let z = &logits[i * vocab..(i + 1) * vocab];
        let capped: Vec<f64> = match c.softcap {
            Some(cap) => z.iter().map(|x| cap * (x / cap).tanh()).collect(),
            None => z.to_vec(),
        };
        let row = row_softmax(&capped, c.temperature);
        let mean_s = capped.iter().sum::<f64>() / (vocab as f64 * c.temperature);
        let nll = -row.log_probs[y];
        let z_term = c.z_loss * row.lse * row.lse;
        let loss = (1.0 - eps) * nll + eps * (row.lse - mean_s) + z_term;
        let upstream = weight * grad_rows.map_or(1.0, |g| g[i] as f64);
        let lse_upstream = grad_lse.map_or(0.0, |g| g[i] as f64);
        out.row_loss[i] = loss;
        out.lse[i] = row.lse;
        out.logp[i] = row.log_probs[y];
        out.loss += upstream * loss;
        out.z_loss += upstream * z_term;
        let dz = &mut out.dlogits[i * vocab..(i + 1) * vocab];
        for (j, d) in dz.iter_mut().enumerate() {
            let p = row.log_probs[j].exp();
            let ds = (1.0 + 2.0 * c.z_loss * row.lse) * p
                - if j == y { 1.0 - eps } else { 0.0 }
                - eps / vocab as f64;
            let cap_slope = match c.softcap {
                Some(cap) => 1.0 - (z[j] / cap).tanh().powi(2),
                None => 1.0,
            };
            *d = (grad_output * upstream * ds + lse_upstream * p) * cap_slope / c.temperature;
        }
    }
    out
}
