//! The logits-level GRPO kernel with one `exp` per logit: the forward writes each
//! vocabulary tile's unnormalized exponentials `e_j = exp((z_j - μ_tile)/T)` into the
//! (f32) `dlogits` buffer while it sums them, with the per-(row, tile) max `μ_tile`;
//! the backward rescales them in place, `p_j = e_j·exp((μ_tile - μ)/T - log S)`, and
//! reads the logits again only for an entropy term (`log p_j`). Four memory passes
//! (read z, write e, read e, write dz) instead of three, and half the `exp`s. bf16
//! outputs keep the two-`exp` kernel ([`GrpoLogitsForward::backward`]): exponentials
//! stored in bf16 would be rounded twice.

use super::online_softmax::VOCAB_TILE;
use super::simd;
use crate::batch::{GrpoBatch, LogitsLayout};
use crate::element::Element;
use crate::error::Result;
use crate::grpo_config::GrpoLoss;
use crate::grpo_logits::GrpoLogitsForward;
use crate::policy::Normalizers;
use crate::rows::{OnlineSoftmax, RowStats, RowTransform, check_row_stats, check_targets};
use rayon::prelude::*;

/// A forward whose exponentials wait in the `dlogits` buffer for
/// [`StagedForward::backward`].
#[derive(Debug, Clone)]
pub struct StagedForward {
    /// Loss, metrics, per-row outputs (as [`crate::cpu::grpo_logits_forward`]).
    pub forward: GrpoLogitsForward,
    /// `μ_tile` per (row, tile of [`VOCAB_TILE`]), `[N, tiles]`.
    tile_max: Vec<f32>,
    tiles: usize,
}

/// The GRPO forward on logits `[B, T, V]` (`layout`), with each row's unnormalized
/// exponentials written into `dlogits` (dense `[N, V]`, f32) for the backward.
pub fn grpo_logits_forward_staged<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
    dlogits: &mut [f32],
) -> Result<StagedForward> {
    GrpoLogitsForward::check_batch(loss, batch, layout, layout.vocab)?;
    layout.validate("logits", logits.len())?;
    layout.validate_dense("dlogits", dlogits.len())?;
    let (n, v) = (layout.rows(), layout.vocab);
    check_targets(batch.target_ids, Some(batch.mask), n, v, layout.seq_len)?;
    let inv_temp = RowTransform::grpo(loss).inv_temp;
    let tiles = v.div_ceil(VOCAB_TILE).max(1);
    let mut tile_max = vec![0.0f32; n * tiles];
    let stats: Vec<RowStats> = dlogits
        .par_chunks_mut(v)
        .zip(tile_max.par_chunks_mut(tiles))
        .enumerate()
        .map_init(
            || vec![0.0f32; VOCAB_TILE],
            |buf, (i, (dst, mu))| {
                if !batch.mask[i] {
                    return RowStats::default();
                }
                let row = &logits[layout.offset(i)..layout.offset(i) + v];
                let mut state = OnlineSoftmax::empty(inv_temp);
                for (k, j0) in (0..v).step_by(VOCAB_TILE).enumerate() {
                    let j1 = (j0 + VOCAB_TILE).min(v);
                    let z = match E::as_f32(&row[j0..j1]) {
                        Some(z) => z,
                        None => {
                            simd::load(&row[j0..j1], &mut buf[..j1 - j0]);
                            &buf[..j1 - j0]
                        }
                    };
                    let max = simd::max(z);
                    mu[k] = max;
                    if max == f32::NEG_INFINITY {
                        dst[j0..j1].fill(0.0);
                        continue;
                    }
                    let (sum, weighted, sum2) =
                        simd::exp_sums_store(z, &mut dst[j0..j1], max, inv_temp);
                    state.merge(OnlineSoftmax {
                        inv_temp,
                        max,
                        sum,
                        weighted,
                        sum2,
                    });
                }
                RowStats::finish(&state, row[batch.target_ids[i] as usize].to_f32())
            },
        )
        .collect();
    check_row_stats(&stats, |i| batch.mask[i], batch.target_ids, layout.seq_len)?;
    let forward =
        GrpoLogitsForward::from_stats(loss, batch, Normalizers::local(batch), stats, layout, None)?;
    Ok(StagedForward {
        forward,
        tile_max,
        tiles,
    })
}

impl StagedForward {
    /// Turns the exponentials in `dlogits` (written by the forward) into
    /// `grad_output · ∂L/∂z`; `logits` are read again only for rows with an entropy
    /// term.
    pub fn backward<E: Element>(
        &self,
        logits: &[E],
        grad_output: f32,
        dlogits: &mut [f32],
    ) -> Result<()> {
        let f = &self.forward;
        f.check(logits.len(), grad_output)?;
        f.layout.validate_dense("dlogits", dlogits.len())?;
        let v = f.layout.vocab;
        let inv_temp = f.transform.inv_temp;
        dlogits
            .par_chunks_mut(v)
            .zip(self.tile_max.par_chunks(self.tiles))
            .enumerate()
            .for_each_init(
                || vec![0.0f32; VOCAB_TILE],
                |buf, (i, (dst, mu))| {
                    let (dlogp, dentropy) = (f.dlogp[i], f.dentropy[i]);
                    if dlogp == 0.0 && dentropy == 0.0 {
                        dst.fill(0.0);
                        return;
                    }
                    let coefs = f.transform.grpo_coefs(grad_output as f64, dlogp, dentropy);
                    let st = &f.stats[i];
                    let row = &logits[f.layout.offset(i)..f.layout.offset(i) + v];
                    let target = f.targets[i] as usize;
                    for (k, j0) in (0..v).step_by(VOCAB_TILE).enumerate() {
                        let j1 = (j0 + VOCAB_TILE).min(v);
                        let e = &mut dst[j0..j1];
                        let c = simd::exp((mu[k] - st.max) * inv_temp - st.log_sum);
                        if dentropy == 0.0 {
                            simd::scale_add(e, coefs.p * c, 0.0);
                        } else {
                            let z = match E::as_f32(&row[j0..j1]) {
                                Some(z) => z,
                                None => {
                                    simd::load(&row[j0..j1], &mut buf[..j1 - j0]);
                                    &buf[..j1 - j0]
                                }
                            };
                            simd::rescaled_grad(
                                e,
                                z,
                                c,
                                &simd::SoftmaxGrad {
                                    max: st.max,
                                    scale: inv_temp,
                                    log_sum: st.log_sum,
                                    coef_p: coefs.p,
                                    coef_h: coefs.h,
                                    entropy: st.entropy,
                                    ..Default::default()
                                },
                            );
                        }
                        if (j0..j1).contains(&target) {
                            e[target - j0] += coefs.target;
                        }
                    }
                },
            );
        Ok(())
    }
}
