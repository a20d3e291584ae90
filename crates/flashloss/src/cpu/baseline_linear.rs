//! The plain LM-head path a framework runs, the A of the fused-linear A/B: full logits
//! `[N, V]` with the same GEMM, the unfused logits-level loss (materialized
//! log-softmax, softmax and dlogits), then GEMMs for dH and dW. The same for
//! cross-entropy.

use super::matmul::{MatRef, matmul};
use super::online_softmax::VOCAB_TILE;
use super::tiles::add_head_tile_grads;
use super::unfused_logits::{UnfusedWorkspace, grpo_logits_unfused_into};
use crate::batch::{GrpoBatch, LinearInputs, LogitsLayout};
use crate::cross_entropy::CrossEntropy;
use crate::element::Element;
use crate::error::Result;
use crate::fused::{HeadGrad, LinearGrads};
use crate::grpo_config::GrpoLoss;
use crate::rows::{RowTransform, check_targets};
use crate::weight_layout::WeightLayout;
use rayon::prelude::*;

/// The baseline's buffers, kept across steps (a framework's caching allocator).
#[derive(Debug, Default)]
pub struct BaselineWorkspace {
    logits: Vec<f32>,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    unfused: UnfusedWorkspace,
    /// A vocabulary tile of `dlogitsᵀ`, for the dW product.
    dz_t: Vec<f32>,
}

/// Loss and gradients by the materializing path.
pub fn grpo_linear_baseline<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    inputs: &LinearInputs<E>,
    grad_output: f32,
) -> Result<(f64, LinearGrads)> {
    let mut grads = LinearGrads::zeros(inputs);
    let mut ws = BaselineWorkspace::default();
    let value = grpo_linear_baseline_into(loss, batch, inputs, grad_output, &mut ws, &mut grads)?;
    Ok((value, grads))
}

/// [`grpo_linear_baseline`] writing (not adding) the gradients into `grads`.
pub fn grpo_linear_baseline_into<E: Element>(
    loss: &GrpoLoss,
    batch: &GrpoBatch,
    inputs: &LinearInputs<E>,
    grad_output: f32,
    ws: &mut BaselineWorkspace,
    grads: &mut LinearGrads,
) -> Result<f64> {
    inputs.validate()?;
    grads.check(inputs, HeadGrad::Full)?;
    head_logits(inputs, None, ws)?;
    let layout = LogitsLayout::contiguous(batch.batch, batch.seq_len, inputs.vocab);
    let value = grpo_logits_unfused_into(
        loss,
        batch,
        &ws.logits,
        &layout,
        grad_output,
        &mut ws.unfused,
    )?;
    head_grads(inputs, ws, grads);
    Ok(value)
}

/// Cross-entropy by the materializing path: logits, soft-capped logits, log-softmax
/// `[N, V]` and dlogits `[N, V]`, then GEMMs; writes (not adds) `grads`. Returns the
/// loss as [`super::ce_linear`] defines it (unit upstream gradients for reduction
/// `none`).
pub fn ce_linear_baseline_into<E: Element>(
    ce: &CrossEntropy,
    targets: &[i64],
    inputs: &LinearInputs<E>,
    grad_output: f32,
    ws: &mut BaselineWorkspace,
    grads: &mut LinearGrads,
) -> Result<f64> {
    inputs.validate()?;
    grads.check(inputs, HeadGrad::Full)?;
    let c = ce.config();
    let (n, v) = (inputs.tokens, inputs.vocab);
    let live: Vec<bool> = targets.iter().map(|&y| ce.counts(y)).collect();
    check_targets(targets, Some(&live), n, v, n)?;
    let count = live.iter().filter(|&&l| l).count();
    let weight = ce.row_weight(count);
    let upstream = weight * grad_output as f64;
    head_logits(inputs, c.softcap.map(|x| x as f32), ws)?;
    let transform = RowTransform::ce(ce);
    let inv_temp = transform.inv_temp;
    let logp = &mut ws.unfused.log_probs;
    crate::memory::try_resize(logp, "log_softmax [N, V]", n * v, 0.0)?;
    let dlogits = &mut ws.unfused.dlogits;
    crate::memory::try_resize(dlogits, "dlogits [N, V]", n * v, 0.0)?;
    let inv_cap = transform.inv_cap();
    let row_loss: Vec<f64> = ws
        .logits
        .par_chunks(v)
        .zip(logp.par_chunks_mut(v))
        .zip(dlogits.par_chunks_mut(v))
        .enumerate()
        .map(|(i, ((z, lp), dz))| {
            if !live[i] {
                dz.fill(0.0);
                return 0.0;
            }
            let max = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) * inv_temp;
            let sum: f64 = z.iter().map(|&x| ((x * inv_temp - max) as f64).exp()).sum();
            let lse = max as f64 + sum.ln();
            lp.iter_mut()
                .zip(z)
                .for_each(|(l, &x)| *l = (x * inv_temp) - lse as f32);
            let y = targets[i] as usize;
            let mean_s = z.iter().map(|&x| x as f64).sum::<f64>() * inv_temp as f64 / v as f64;
            let z_term = c.z_loss * lse * lse;
            let value = (1.0 - c.label_smoothing) * -(lp[y] as f64)
                + c.label_smoothing * (lse - mean_s)
                + z_term;
            // Coefficients formed in f64: only they, not `g/T`, need to fit in f32.
            let scale = transform.grad_scale(upstream);
            let coef_p = (scale * (1.0 + 2.0 * c.z_loss * lse)) as f32;
            let coef_uniform = (scale * c.label_smoothing / v as f64) as f32;
            let coef_target = (scale * (1.0 - c.label_smoothing)) as f32;
            for (j, d) in dz.iter_mut().enumerate() {
                let target = if j == y { coef_target } else { 0.0 };
                let slope = 1.0 - (z[j] * inv_cap) * (z[j] * inv_cap);
                *d = (coef_p * lp[j].exp() - target - coef_uniform) * slope;
            }
            value
        })
        .collect();
    head_grads(inputs, ws, grads);
    Ok(weight * row_loss.iter().sum::<f64>())
}

/// Widens the inputs into `ws` and forms `ws.logits = softcap(hidden·weightᵀ + bias)`.
fn head_logits<E: Element>(
    inputs: &LinearInputs<E>,
    softcap: Option<f32>,
    ws: &mut BaselineWorkspace,
) -> Result<()> {
    let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
    // bf16 inputs are widened once; f32 inputs are used where they are.
    let widen = |m: &[E], buf: &mut Vec<f32>| {
        buf.clear();
        if E::as_f32(m).is_none() {
            buf.extend(m.iter().map(|x| x.to_f32()));
        }
    };
    widen(inputs.hidden, &mut ws.hidden);
    widen(inputs.weight, &mut ws.weight);
    if ws.logits.len() != n * v {
        ws.logits = Vec::new();
        crate::memory::try_resize(&mut ws.logits, "logits [N, V]", n * v, 0.0)?;
    }
    matmul(
        &mut ws.logits,
        v,
        MatRef::row_major(as_f32(inputs.hidden, &ws.hidden), n, h),
        weight_view(inputs, as_f32(inputs.weight, &ws.weight)).t(),
        false,
    );
    if let Some(b) = inputs.bias {
        for row in ws.logits.chunks_mut(v) {
            row.iter_mut().zip(b).for_each(|(z, c)| *z += c.to_f32());
        }
    }
    if let Some(cap) = softcap {
        ws.logits.par_chunks_mut(v).for_each(|row| {
            row.iter_mut().for_each(|z| *z = cap * (*z / cap).tanh());
        });
    }
    Ok(())
}

/// `weight` (`inputs`' weight as f32) as a `[V, H]` view in its layout.
fn weight_view<'a, E>(inputs: &LinearInputs<E>, weight: &'a [f32]) -> MatRef<'a> {
    let (v, h) = (inputs.vocab, inputs.hidden_size);
    let (row_stride, col_stride) = inputs.layout.strides(v, h);
    MatRef {
        data: weight,
        rows: v,
        cols: h,
        row_stride,
        col_stride,
    }
}

/// `m` as f32: itself, or its widened copy `widened`.
fn as_f32<'a, E: Element>(m: &'a [E], widened: &'a [f32]) -> &'a [f32] {
    E::as_f32(m).unwrap_or(widened)
}

/// `dH = dZ·W`, `dW = dZᵀ·H`, `dbias = Σ_rows dZ` of `ws`'s dlogits, written into
/// `grads`. A `[V, H]` dW and dbias go a vocabulary tile at a time through a transposed
/// copy in `ws.dz_t` (what a BLAS does inside; as a transposed view `gemm` copies the
/// whole `[N, V]` into fresh memory on every call); an `[H, V]` dW is `Hᵀ·dZ`, read as
/// it lies.
fn head_grads<E: Element>(
    inputs: &LinearInputs<E>,
    ws: &mut BaselineWorkspace,
    grads: &mut LinearGrads,
) {
    let (dlogits, dz_t) = (&ws.unfused.dlogits, &mut ws.dz_t);
    let hidden = as_f32(inputs.hidden, &ws.hidden);
    let weight = as_f32(inputs.weight, &ws.weight);
    let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
    let dz = MatRef::row_major(dlogits, n, v);
    matmul(
        &mut grads.dhidden,
        h,
        dz,
        weight_view(inputs, weight),
        false,
    );
    grads.dweight.fill(0.0);
    if let Some(db) = grads.dbias.as_mut() {
        db.fill(0.0);
    }
    if inputs.layout == WeightLayout::HiddenMajor {
        let hid = MatRef::row_major(hidden, n, h).t();
        matmul(&mut grads.dweight, v, hid, dz, false);
        if let Some(db) = grads.dbias.as_mut() {
            for row in dlogits.chunks(v) {
                db.iter_mut().zip(row).for_each(|(d, x)| *d += x);
            }
        }
        return;
    }
    for j0 in (0..v).step_by(VOCAB_TILE) {
        let vocab = j0..(j0 + VOCAB_TILE).min(v);
        add_head_tile_grads(
            &dlogits[j0..],
            v,
            n,
            vocab.len(),
            hidden,
            h,
            &mut grads.dweight[j0 * h..vocab.end * h],
            grads.dbias.as_mut().map(|db| &mut db[vocab.clone()]),
            dz_t,
        );
    }
}
