//! Per-row softmax statistics, shared by every kernel and backend. For raw logits `z`
//! of a row and scaled logits `s = z·inv_temp`, a kernel keeps an online state of the
//! row (running max `μ` of `z`, `S = Σ exp((z-μ)·inv_temp)`,
//! `U = Σ exp((z-μ)·inv_temp)·(z-μ)·inv_temp`, `S₂ = Σ exp(2(z-μ)·inv_temp)`), merges the
//! states of disjoint parts of the row (tiles, vocabulary shards on other ranks) and
//! finishes them into `lse = μ·inv_temp + log S`, `H = log S - U/S`,
//! `logp = (z_y - μ)·inv_temp - log S` and `Σp² = S₂/S²`.
//! Keeping `μ` in raw units makes `z - μ` exact before scaling (small temperatures,
//! large logits), and shifting `U` by `μ` keeps the entropy free of cancellation.
//!
//! [`RowTransform`] is the one place where a loss's options (temperature, soft-cap,
//! label smoothing) become what the kernels apply per logit.

use crate::cross_entropy::CrossEntropy;
use crate::error::{Error, Result};
use crate::grpo_config::GrpoLoss;
use crate::temperature::Temperature;

/// Online softmax state; [`OnlineSoftmax::merge`] combines the states of disjoint
/// parts of a row. A backend computes the state of one tile of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnlineSoftmax {
    /// `1 / T_temp`.
    pub inv_temp: f32,
    /// Running max `μ` of the raw logits (`-inf` while empty).
    pub max: f32,
    /// `S = Σ exp((z - μ)·inv_temp)`.
    pub sum: f64,
    /// `U = Σ exp((z - μ)·inv_temp)·(z - μ)·inv_temp`.
    pub weighted: f64,
    /// `S₂ = Σ exp(2(z - μ)·inv_temp)` (NaN where a backend does not form it).
    pub sum2: f64,
}

impl OnlineSoftmax {
    /// The state of an empty row part.
    pub fn empty(inv_temp: f32) -> Self {
        OnlineSoftmax {
            inv_temp,
            max: f32::NEG_INFINITY,
            sum: 0.0,
            weighted: 0.0,
            sum2: 0.0,
        }
    }

    /// Combines with the state of another, disjoint part of the row (same `inv_temp`):
    /// rescales both to the larger max, `U' = e^d·(U + d·S)`, `S₂' = e^{2d}·S₂` with
    /// `d = (μ - μ_new)·inv_temp`.
    pub fn merge(&mut self, other: OnlineSoftmax) {
        if other.max == f32::NEG_INFINITY {
            return;
        }
        if self.max == f32::NEG_INFINITY {
            *self = other;
            return;
        }
        let max = self.max.max(other.max);
        let rescale = |st: &OnlineSoftmax| {
            let d = (st.max as f64 - max as f64) * self.inv_temp as f64;
            let f = d.exp();
            (f * st.sum, f * (st.weighted + d * st.sum), f * f * st.sum2)
        };
        let (s1, u1, q1) = rescale(self);
        let (s2, u2, q2) = rescale(&other);
        *self = OnlineSoftmax {
            inv_temp: self.inv_temp,
            max,
            sum: s1 + s2,
            weighted: u1 + u2,
            sum2: q1 + q2,
        };
    }

    /// `log S` (so that `lse = μ·inv_temp + log S`).
    pub fn log_sum(&self) -> f64 {
        self.sum.ln()
    }

    /// `lse = μ·inv_temp + log S`.
    pub fn lse(&self) -> f64 {
        self.max as f64 * self.inv_temp as f64 + self.log_sum()
    }

    /// `H = log S - U / S`.
    pub fn entropy(&self) -> f64 {
        self.log_sum() - self.weighted / self.sum
    }

    /// `Σ p² = S₂ / S²`.
    pub fn sum_p2(&self) -> f64 {
        self.sum2 / (self.sum * self.sum)
    }
}

/// Statistics of one row, what every later pass needs:
/// `p_j = exp((z_j - max)·inv_temp - log_sum)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowStats {
    /// Row max of the raw logits `μ`.
    pub max: f32,
    /// `log S`.
    pub log_sum: f32,
    /// `lse = μ·inv_temp + log S`.
    pub lse: f32,
    /// Entropy `H`.
    pub entropy: f32,
    /// `logp = (z_y - μ)·inv_temp - log S` of the target.
    pub logp: f32,
    /// `Σ_j s_j / V`, the mean scaled logit, where a kernel needs it (label
    /// smoothing); 0 otherwise.
    pub mean_logit: f32,
    /// `Σ_j p_j² = S₂/S²` (NaN where the backend does not form `S₂`).
    pub sum_p2: f32,
}

impl RowStats {
    /// Final statistics from a row's state and its target's raw logit `z_y`.
    pub fn finish(state: &OnlineSoftmax, target_logit: f32) -> Self {
        let log_sum = state.log_sum();
        let shifted = (target_logit as f64 - state.max as f64) * state.inv_temp as f64;
        RowStats {
            max: state.max,
            log_sum: log_sum as f32,
            lse: state.lse() as f32,
            entropy: state.entropy() as f32,
            logp: (shifted - log_sum) as f32,
            mean_logit: 0.0,
            sum_p2: state.sum_p2() as f32,
        }
    }
}

/// What a loss applies to each logit before the softmax, built once from the loss's
/// options: `s = softcap(z)·inv_temp` with `softcap(z) = cap·tanh(z/cap)`, and the
/// gradient's `∂s/∂z = slope/T`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowTransform {
    /// The sampling temperature `T_temp`.
    pub temperature: f64,
    /// `1 / T_temp` in f32, as the kernels apply it.
    pub inv_temp: f32,
    /// Logit soft-cap (cross-entropy only).
    pub softcap: Option<f32>,
    /// Whether [`RowStats::mean_logit`] is wanted (label smoothing).
    pub mean_logit: bool,
}

impl RowTransform {
    /// Temperature only.
    pub fn with_temperature(temperature: Temperature) -> Self {
        let temperature = temperature.get();
        RowTransform {
            temperature,
            inv_temp: (1.0 / temperature) as f32,
            softcap: None,
            mean_logit: false,
        }
    }

    /// The GRPO loss's transform (its temperature).
    pub fn grpo(loss: &GrpoLoss) -> Self {
        Self::with_temperature(Temperature::checked(loss.config().temperature))
    }

    /// Cross-entropy's transform: temperature, soft-cap, mean logit for label smoothing.
    pub fn ce(ce: &CrossEntropy) -> Self {
        let c = ce.config();
        RowTransform {
            softcap: c.softcap.map(|x| x as f32),
            mean_logit: c.label_smoothing > 0.0,
            ..Self::with_temperature(Temperature::checked(c.temperature))
        }
    }

    /// `g / T`: the factor that turns an upstream gradient `g` of the scaled logits
    /// into one of the raw logits.
    pub fn grad_scale(&self, g: f64) -> f64 {
        g / self.temperature
    }

    /// The coefficients of a GRPO row's logits gradient for an upstream `g`
    /// (`scale = g/T`): `dz_j = coef_p·p_j + coef_h·p_j·(log p_j + H) + coef_target·1[j=y]`
    /// with `coef_p = -scale·dlogp`, `coef_h = -scale·dentropy`, `coef_target =
    /// scale·dlogp`. Formed in f64, so only the products (bounded by
    /// [`crate::range::grpo_grad_bound`]) need to fit in f32, not `scale` itself.
    pub fn grpo_coefs(&self, g: f64, dlogp: f32, dentropy: f32) -> GrpoCoefs {
        let scale = self.grad_scale(g);
        GrpoCoefs {
            p: (-scale * dlogp as f64) as f32,
            h: (-scale * dentropy as f64) as f32,
            target: (scale * dlogp as f64) as f32,
        }
    }

    /// `1 / cap` of the soft-cap (0: none).
    pub fn inv_cap(&self) -> f32 {
        self.softcap.map_or(0.0, |c| 1.0 / c)
    }
}

/// A GRPO row's gradient coefficients ([`RowTransform::grpo_coefs`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoCoefs {
    /// Of `p_j`: `-scale·dlogp`.
    pub p: f32,
    /// Of `p_j·(log p_j + H)`: `-scale·dentropy`.
    pub h: f32,
    /// Of the target's one-hot: `scale·dlogp`.
    pub target: f32,
}

/// The per-row inputs of a pass over a head: which rows take part, their targets and
/// the transform of their logits.
#[derive(Debug, Clone, Copy)]
pub struct RowInputs<'a> {
    /// Target ids `[N]` (read where `live`; ids local to the head's vocabulary, -1
    /// where another vocabulary shard holds the target).
    pub targets: &'a [i64],
    /// Rows that take part `[N]`.
    pub live: &'a [bool],
    /// What is applied to every logit.
    pub transform: RowTransform,
}

/// Per-row softmax states of a pass over (part of) the vocabulary, before finishing:
/// what tiles and vocabulary shards merge.
#[derive(Debug, Clone, PartialEq)]
pub struct PartialStats {
    /// Online-softmax state per row.
    pub states: Vec<OnlineSoftmax>,
    /// Raw logit of each row's target where the pass saw it (0 elsewhere).
    pub target_logits: Vec<f32>,
    /// `Σ_j z_j` per row (when the rows want mean logits; 0 otherwise).
    pub sums: Vec<f64>,
}

impl PartialStats {
    /// Empty states for `n` rows.
    pub fn empty(n: usize, inv_temp: f32) -> Self {
        PartialStats {
            states: vec![OnlineSoftmax::empty(inv_temp); n],
            target_logits: vec![0.0; n],
            sums: vec![0.0; n],
        }
    }

    /// Combines with the states of another, disjoint part of the same rows' vocabulary
    /// (a row's target logit is in the part that saw it, 0 in the others).
    pub fn merge(&mut self, other: &PartialStats) {
        for (s, o) in self.states.iter_mut().zip(&other.states) {
            s.merge(*o);
        }
        for (t, o) in self.target_logits.iter_mut().zip(&other.target_logits) {
            *t += o;
        }
        for (s, o) in self.sums.iter_mut().zip(&other.sums) {
            *s += o;
        }
    }

    /// The final statistics of row `r` of these states, which is row `i` of `rows`
    /// (zeroed where it does not take part); `vocab` is the whole vocabulary's size.
    pub fn finish_row(&self, r: usize, i: usize, rows: &RowInputs, vocab: usize) -> RowStats {
        if !rows.live[i] {
            return RowStats::default();
        }
        let mut st = RowStats::finish(&self.states[r], self.target_logits[r]);
        if rows.transform.mean_logit {
            st.mean_logit = (self.sums[r] / vocab as f64 * rows.transform.inv_temp as f64) as f32;
        }
        st
    }

    /// Final [`RowStats`] of every row (these states cover all rows of `rows`).
    pub fn finish(&self, rows: &RowInputs, vocab: usize) -> Vec<RowStats> {
        (0..self.states.len())
            .map(|i| self.finish_row(i, i, rows, vocab))
            .collect()
    }
}

/// Checks that each live row's statistics are finite: a `-inf` target logit is an
/// [`Error::ImpossibleTarget`], NaN or `+inf` logits an [`Error::InvalidArgument`].
pub fn check_row_stats(
    stats: &[RowStats],
    live: impl Fn(usize) -> bool,
    target_ids: &[i64],
    seq_len: usize,
) -> Result<()> {
    for (row, st) in stats.iter().enumerate().filter(|(i, _)| live(*i)) {
        if st.logp == f32::NEG_INFINITY || st.lse == f32::NEG_INFINITY {
            return Err(Error::ImpossibleTarget {
                row,
                seq: row / seq_len,
                pos: row % seq_len,
                id: target_ids[row],
            });
        }
        if !(st.lse.is_finite() && st.logp.is_finite() && st.entropy.is_finite()) {
            return Err(Error::InvalidArgument {
                arg: "logits",
                reason: format!("row {row} holds NaN or +inf logits"),
            });
        }
    }
    Ok(())
}

/// Checks `target_ids` and `mask` (`[N]`, N = B·T with T = `seq_len`), ids in
/// `[0, vocab)` where the mask is set.
pub fn check_targets(
    target_ids: &[i64],
    mask: Option<&[bool]>,
    n: usize,
    vocab: usize,
    seq_len: usize,
) -> Result<()> {
    let shape = || format!("[B={}, T={seq_len}]", n / seq_len);
    for (arg, len) in [
        ("target_ids", target_ids.len()),
        ("mask", mask.map_or(n, <[bool]>::len)),
    ] {
        if len != n {
            return Err(Error::ShapeMismatch {
                arg,
                shape: shape(),
                expected: n,
                actual: len,
            });
        }
    }
    let live = |i: usize| mask.is_none_or(|m| m[i]);
    if let Some(i) = (0..n).find(|&i| live(i) && !(0..vocab as i64).contains(&target_ids[i])) {
        return Err(Error::TokenOutOfRange {
            arg: "target_ids",
            index: i,
            seq: i / seq_len,
            pos: i % seq_len,
            id: target_ids[i],
            vocab,
        });
    }
    Ok(())
}
