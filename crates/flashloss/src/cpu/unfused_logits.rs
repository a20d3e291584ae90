//! The unfused logits-level GRPO path, as a framework runs it: materialized f32
//! `log_softmax` `[N, V]` and `softmax` `[N, V]`, gather, entropy, loss, then `dlogits`.
//! The A of the logits-level A/B. It uses the same vectorized `exp` and the same
//! policy stage as the fused kernel, so the difference measured is the memory passes.

use super::simd;
use crate::batch::{GrpoBatch, LogitsLayout};
use crate::element::Element;
use crate::error::Result;
use crate::grpo_config::GrpoLoss;
use crate::policy::{Normalizers, policy_stage};
use crate::range::check_policy_rows;
use crate::rows::RowTransform;
use rayon::prelude::*;

/// The unfused path's `[N, V]` buffers, kept across steps as a framework's caching
/// allocator keeps them (so the A/B compares memory passes, not page faults).
#[derive(Debug, Default)]
pub struct UnfusedWorkspace {
    pub(crate) log_probs: Vec<f32>,
    probs: Vec<f32>,
    /// `grad_output · ∂L/∂z` of the last step, dense `[N, V]`.
    pub dlogits: Vec<f32>,
}

fn sized<'a>(buf: &'a mut Vec<f32>, what: &str, len: usize) -> Result<&'a mut [f32]> {
    if buf.len() != len {
        *buf = Vec::new();
        crate::memory::try_resize(buf, what, len, 0.0)?;
    }
    Ok(buf)
}

/// Loss and `grad_output · ∂L/∂z` (dense `[N, V]` f32) by the unfused path.
pub fn grpo_logits_unfused<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
    grad_output: f32,
) -> Result<(f64, Vec<f32>)> {
    let mut ws = UnfusedWorkspace::default();
    let value = grpo_logits_unfused_into(loss, batch, logits, layout, grad_output, &mut ws)?;
    Ok((value, ws.dlogits))
}

/// [`grpo_logits_unfused`] with its buffers in `ws`; `ws.dlogits` holds the gradient.
pub fn grpo_logits_unfused_into<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    logits: &[E],
    layout: &LogitsLayout,
    grad_output: f32,
    ws: &mut UnfusedWorkspace,
) -> Result<f64> {
    layout.validate("logits", logits.len())?;
    loss.check_full_softmax("the unfused logits-level GRPO")?;
    batch.validate(layout.vocab, loss)?;
    let (n, v) = (layout.rows(), layout.vocab);
    let transform = RowTransform::grpo(loss);
    let inv_temp = transform.inv_temp;

    // log_softmax(z / T), materialized.
    let log_probs = sized(&mut ws.log_probs, "log_softmax [N, V]", n * v)?;
    log_probs.par_chunks_mut(v).enumerate().for_each(|(i, lp)| {
        let start = layout.offset(i);
        simd::load_scaled(&logits[start..start + v], inv_temp, lp);
        let max = simd::max(lp);
        let (sum, _, _) = simd::exp_sums(lp, max, 1.0);
        let lse = max + sum.ln() as f32;
        lp.iter_mut().for_each(|x| *x -= lse);
    });
    // softmax, materialized.
    let probs = sized(&mut ws.probs, "softmax [N, V]", n * v)?;
    probs
        .par_chunks_mut(v)
        .zip(log_probs.par_chunks(v))
        .for_each(|(p, lp)| p.iter_mut().zip(lp).for_each(|(p, &l)| *p = simd::exp(l)));
    // Gather and entropy H = -Σ p·log p.
    let (logp, entropy): (Vec<f32>, Vec<f32>) = (0..n)
        .into_par_iter()
        .map(|i| {
            let (p, lp) = (&probs[i * v..(i + 1) * v], &log_probs[i * v..(i + 1) * v]);
            let h: f32 = -p
                .iter()
                .zip(lp)
                .map(|(&p, &l)| if p > 0.0 { p * l } else { 0.0 })
                .sum::<f32>();
            let y = if batch.mask[i] {
                batch.target_ids[i] as usize
            } else {
                0
            };
            (lp[y], h)
        })
        .unzip();
    let policy = policy_stage(loss, batch, Normalizers::local(batch), &logp, &entropy);
    let scale = transform.grad_scale(grad_output as f64);
    let live = |i: usize| batch.mask[i];
    check_policy_rows(
        &policy,
        |i| entropy[i],
        0..n,
        live,
        batch.seq_len,
        Some(scale),
    )?;

    // dlogits = (g/T)·[dlogp·(onehot - p) - dentropy·p·(log p + H)], materialized.
    let (log_probs, probs) = (&ws.log_probs, &ws.probs);
    let dlogits = sized(&mut ws.dlogits, "dlogits [N, V]", n * v)?;
    dlogits.par_chunks_mut(v).enumerate().for_each(|(i, dz)| {
        let (p, lp) = (&probs[i * v..(i + 1) * v], &log_probs[i * v..(i + 1) * v]);
        let c = transform.grpo_coefs(grad_output as f64, policy.dlogp[i], policy.dentropy[i]);
        for j in 0..v {
            let ent = if p[j] > 0.0 {
                p[j] * (lp[j] + entropy[i])
            } else {
                0.0
            };
            dz[j] = c.p * p[j] + c.h * ent;
        }
        if batch.mask[i] {
            dz[batch.target_ids[i] as usize] += c.target;
        }
    });
    Ok(policy.loss)
}
