//! Streaming softmax statistics of a row of raw logits `z` read tile by tile (each
//! logit read once), for scaled logits `s = z·inv_temp`: running max `μ` of `z`,
//! `S = Σ exp((z-μ)·inv_temp)` and `U = Σ exp((z-μ)·inv_temp)·(z-μ)·inv_temp`, so that
//! `lse = μ·inv_temp + log S` and `H = log S - U/S`. Keeping `μ` in raw units makes
//! `z - μ` exact before scaling (small temperatures, large logits), and shifting `U`
//! by `μ` keeps the entropy free of cancellation.

use super::simd;
use crate::element::Element;

/// Elements per vocabulary tile (32 KiB of f32 with its source: stays in L1).
pub const VOCAB_TILE: usize = 2048;

/// Online softmax state; [`OnlineSoftmax::merge`] combines the states of disjoint
/// parts of a row (tiles, or vocabulary shards on other ranks).
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
}

impl OnlineSoftmax {
    /// The state of an empty row part.
    pub fn empty(inv_temp: f32) -> Self {
        OnlineSoftmax {
            inv_temp,
            max: f32::NEG_INFINITY,
            sum: 0.0,
            weighted: 0.0,
        }
    }

    /// The state of one tile of raw logits.
    pub fn of_tile(z: &[f32], inv_temp: f32) -> Self {
        let max = simd::max(z);
        if max == f32::NEG_INFINITY {
            return Self::empty(inv_temp);
        }
        let (sum, weighted) = simd::exp_sums(z, max, inv_temp);
        OnlineSoftmax {
            inv_temp,
            max,
            sum,
            weighted,
        }
    }

    /// Combines with the state of another, disjoint part of the row (same `inv_temp`):
    /// rescales both to the larger max, `U' = e^d·(U + d·S)` with `d = (μ - μ_new)·inv_temp`.
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
            (f * st.sum, f * (st.weighted + d * st.sum))
        };
        let (s1, u1) = rescale(self);
        let (s2, u2) = rescale(&other);
        *self = OnlineSoftmax {
            inv_temp: self.inv_temp,
            max,
            sum: s1 + s2,
            weighted: u1 + u2,
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
        }
    }
}

/// Streams one row of raw logits, tile by tile; other dtypes than f32 are widened
/// through `tile`, a scratch buffer of [`VOCAB_TILE`] floats.
pub fn row_state<E: Element>(row: &[E], inv_temp: f32, tile: &mut [f32]) -> OnlineSoftmax {
    let mut state = OnlineSoftmax::empty(inv_temp);
    for chunk in row.chunks(VOCAB_TILE) {
        let z = match E::as_f32(chunk) {
            Some(z) => z,
            None => {
                simd::load(chunk, &mut tile[..chunk.len()]);
                &tile[..chunk.len()]
            }
        };
        state.merge(OnlineSoftmax::of_tile(z, inv_temp));
    }
    state
}
