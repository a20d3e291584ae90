//! The CPU's online-softmax states ([`crate::rows::OnlineSoftmax`]) of raw logits read
//! tile by tile, each logit read once: a tile's max `μ`, then
//! `S = Σ exp((z-μ)·inv_temp)` and `U = Σ exp((z-μ)·inv_temp)·(z-μ)·inv_temp` in one
//! vectorized sweep.

use super::simd;
use crate::element::Element;
use crate::rows::OnlineSoftmax;

/// Elements per vocabulary tile (32 KiB of f32 with its source: stays in L1).
pub const VOCAB_TILE: usize = 2048;

/// The state of one tile of raw logits.
pub fn tile_state(z: &[f32], inv_temp: f32) -> OnlineSoftmax {
    let max = simd::max(z);
    if max == f32::NEG_INFINITY {
        return OnlineSoftmax::empty(inv_temp);
    }
    let (sum, weighted, sum2) = simd::exp_sums(z, max, inv_temp);
    OnlineSoftmax {
        inv_temp,
        max,
        sum,
        weighted,
        sum2,
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
        state.merge(tile_state(z, inv_temp));
    }
    state
}
