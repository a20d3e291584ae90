//! Streaming softmax statistics of a row read tile by tile (each logit read once):
//! running max `μ`, `S = Σ exp(s-μ)` and `U = Σ exp(s-μ)·(s-μ)`, so that
//! `lse = μ + log S` and `H = log S - U/S`. Shifting `U` by `μ` keeps the entropy exact
//! when logits are large (no cancellation of `lse` against `Σ p·s`).

use super::simd;
use crate::element::Element;

/// Elements per vocabulary tile (32 KiB of f32 with its source: stays in L1).
pub const VOCAB_TILE: usize = 2048;

/// Online softmax state; [`OnlineSoftmax::merge`] combines the states of disjoint
/// parts of a row (tiles, or vocabulary shards on other ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnlineSoftmax {
    /// Running max `μ` (`-inf` while empty).
    pub max: f32,
    /// `S = Σ exp(s - μ)`.
    pub sum: f64,
    /// `U = Σ exp(s - μ)·(s - μ)`.
    pub weighted: f64,
}

impl Default for OnlineSoftmax {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl OnlineSoftmax {
    /// The state of an empty row part.
    pub const EMPTY: OnlineSoftmax = OnlineSoftmax {
        max: f32::NEG_INFINITY,
        sum: 0.0,
        weighted: 0.0,
    };

    /// The state of one tile of scaled logits.
    pub fn of_tile(s: &[f32]) -> Self {
        let max = simd::max(s);
        if max == f32::NEG_INFINITY {
            return Self::EMPTY;
        }
        let (sum, weighted) = simd::exp_sums(s, max);
        OnlineSoftmax {
            max,
            sum: sum as f64,
            weighted: weighted as f64,
        }
    }

    /// Combines with the state of another, disjoint part of the row:
    /// rescales both to the larger max, `U' = e^d·(U + d·S)` with `d = μ - μ_new`.
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
            let d = st.max as f64 - max as f64;
            let f = d.exp();
            (f * st.sum, f * (st.weighted + d * st.sum))
        };
        let (s1, u1) = rescale(self);
        let (s2, u2) = rescale(&other);
        *self = OnlineSoftmax {
            max,
            sum: s1 + s2,
            weighted: u1 + u2,
        };
    }

    /// `log S` (so that `lse = μ + log S`).
    pub fn log_sum(&self) -> f64 {
        self.sum.ln()
    }

    /// `lse = μ + log S`.
    pub fn lse(&self) -> f64 {
        self.max as f64 + self.log_sum()
    }

    /// `H = log S - U / S`.
    pub fn entropy(&self) -> f64 {
        self.log_sum() - self.weighted / self.sum
    }
}

/// Statistics of one row, what every later pass needs: `p_j = exp((s_j - max) - log_sum)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowStats {
    /// Row max of the scaled logits `μ`.
    pub max: f32,
    /// `log S`.
    pub log_sum: f32,
    /// `lse = μ + log S`.
    pub lse: f32,
    /// Entropy `H`.
    pub entropy: f32,
    /// `logp = (s_y - μ) - log S` of the target.
    pub logp: f32,
}

impl RowStats {
    /// Final statistics from a row's state and its target's scaled logit `s_y`.
    pub fn finish(state: &OnlineSoftmax, target_logit: f32) -> Self {
        let log_sum = state.log_sum();
        RowStats {
            max: state.max,
            log_sum: log_sum as f32,
            lse: state.lse() as f32,
            entropy: state.entropy() as f32,
            logp: ((target_logit as f64 - state.max as f64) - log_sum) as f32,
        }
    }
}

/// Streams one row of logits `z` (scaled by `inv_temp`) through `tile`, a scratch
/// buffer of [`VOCAB_TILE`] floats.
pub fn row_state<E: Element>(row: &[E], inv_temp: f32, tile: &mut [f32]) -> OnlineSoftmax {
    let mut state = OnlineSoftmax::EMPTY;
    for chunk in row.chunks(VOCAB_TILE) {
        let s = &mut tile[..chunk.len()];
        simd::load_scaled(chunk, inv_temp, s);
        state.merge(OnlineSoftmax::of_tile(s));
    }
    state
}
