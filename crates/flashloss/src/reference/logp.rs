//! Per-token log-prob statistics in f64 on materialized logits (spec: "Per-token
//! statistics beyond logp and entropy"): per row of scaled logits `s = z/T`,
//! `logp = s_y - lse`, entropy, `lse`, `max_j s_j`, `Σ_j p_j²`, the candidates'
//! `logp_ik = s_{i,k_ik} - lse`, and the gradient of
//! `g·Σ_i [g_logp·logp + g_H·H + g_lse·lse + Σ_k c_ik·logp_ik]` w.r.t. the raw logits:
//!
//! `∂/∂z_ij = (g/T)·[g_logp·(1[j=y] - p_j) - g_H·p_j·(log p_j + H) + g_lse·p_j
//! + Σ_k c_ik·(1[j=k_ik] - p_j)]`.

use super::softmax::row_softmax;

/// The rows of a reference log-prob call: targets `[N]`, the rows that take part, the
/// temperature, and the candidates `[N, k]` with their `k` (none: `k = 0`).
#[derive(Debug, Clone, Copy)]
pub struct LogpRefRows<'a> {
    /// Target ids `[N]`.
    pub targets: &'a [i64],
    /// Rows computed `[N]` (the others: zeros).
    pub live: &'a [bool],
    /// `T`.
    pub temperature: f64,
    /// Candidate ids `[N·k]`.
    pub gather_ids: &'a [i64],
    /// Candidates per row.
    pub k: usize,
}

/// Upstream gradients `[N]` (`gathered`: `[N, k]`); empty slices mean zero.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogpRefUpstream<'a> {
    /// `∂L/∂logp_i`.
    pub logp: &'a [f32],
    /// `∂L/∂H_i`.
    pub entropy: &'a [f32],
    /// `∂L/∂lse_i`.
    pub lse: &'a [f32],
    /// `∂L/∂logp_ik`.
    pub gathered: &'a [f32],
    /// `g`, multiplying everything.
    pub grad_output: f64,
}

/// Everything the reference computes (0 on rows that do not take part).
#[derive(Debug, Clone, Default)]
pub struct LogpReference {
    /// `logp_i` `[N]`.
    pub logp: Vec<f64>,
    /// `H_i` `[N]`.
    pub entropy: Vec<f64>,
    /// `lse_i` `[N]`.
    pub lse: Vec<f64>,
    /// `max_j s_ij` `[N]`.
    pub max_logit: Vec<f64>,
    /// `Σ_j p_ij²` `[N]`.
    pub sum_p2: Vec<f64>,
    /// `logp_ik` `[N, k]`.
    pub gathered: Vec<f64>,
    /// The gradient w.r.t. the raw logits `[N, V]`.
    pub dlogits: Vec<f64>,
}

/// Runs the reference on dense raw logits `logits` `[N, V]` (ids must be valid where
/// live).
pub fn logp_reference(
    logits: &[f64],
    vocab: usize,
    rows: LogpRefRows,
    up: LogpRefUpstream,
) -> LogpReference {
    let n = rows.live.len();
    let k = rows.k;
    let at = |g: &[f32], i: usize| g.get(i).map_or(0.0, |&x| x as f64);
    let mut out = LogpReference {
        logp: vec![0.0; n],
        entropy: vec![0.0; n],
        lse: vec![0.0; n],
        max_logit: vec![0.0; n],
        sum_p2: vec![0.0; n],
        gathered: vec![0.0; n * k],
        dlogits: vec![0.0; n * vocab],
    };
    for i in (0..n).filter(|&i| rows.live[i]) {
        let z = &logits[i * vocab..(i + 1) * vocab];
        let sm = row_softmax(z, rows.temperature);
        let p: Vec<f64> = sm.log_probs.iter().map(|lp| lp.exp()).collect();
        let y = rows.targets[i] as usize;
        let ids = &rows.gather_ids[i * k..(i + 1) * k];
        out.logp[i] = sm.log_probs[y];
        out.entropy[i] = sm.entropy;
        out.lse[i] = sm.lse;
        out.max_logit[i] = z
            .iter()
            .map(|x| x / rows.temperature)
            .fold(f64::MIN, f64::max);
        out.sum_p2[i] = p.iter().map(|x| x * x).sum();
        for (o, &id) in out.gathered[i * k..(i + 1) * k].iter_mut().zip(ids) {
            *o = sm.log_probs[id as usize];
        }
        let c: Vec<f64> = (0..k).map(|kk| at(up.gathered, i * k + kk)).collect();
        let (g_logp, g_h, g_lse) = (at(up.logp, i), at(up.entropy, i), at(up.lse, i));
        let scale = up.grad_output / rows.temperature;
        let d = &mut out.dlogits[i * vocab..(i + 1) * vocab];
        for (j, dj) in d.iter_mut().enumerate() {
            let h_term = if p[j] > 0.0 {
                p[j] * (sm.log_probs[j] + sm.entropy)
            } else {
                0.0
            };
            let candidates: f64 = (ids.iter().zip(&c))
                .map(|(&id, &ck)| ck * (f64::from(id as usize == j) - p[j]))
                .sum();
            *dj = scale
                * (g_logp * (f64::from(j == y) - p[j]) - g_h * h_term + g_lse * p[j] + candidates);
        }
    }
    out
}
