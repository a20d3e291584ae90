//! The plain LM-head path a framework runs, the A of the fused-linear A/B: full logits
//! `[N, V]` with the same GEMM, the unfused logits-level loss (materialized
//! log-softmax, softmax and dlogits), then GEMMs for dH and dW.

use super::fused_linear::LinearGrads;
use super::matmul::{MatRef, matmul};
use super::unfused_logits::{UnfusedWorkspace, grpo_logits_unfused_into};
use crate::batch::{GrpoBatch, LinearInputs, LogitsLayout};
use crate::config::GrpoLoss;
use crate::element::Element;
use crate::error::Result;

/// The baseline's buffers, kept across steps (a framework's caching allocator).
#[derive(Debug, Default)]
pub struct BaselineWorkspace {
    logits: Vec<f32>,
    hidden: Vec<f32>,
    weight: Vec<f32>,
    unfused: UnfusedWorkspace,
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
    grads.check(inputs)?;
    let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
    let widen = |m: &[E], buf: &mut Vec<f32>| {
        buf.clear();
        buf.extend(m.iter().map(|x| x.to_f32()));
    };
    widen(inputs.hidden, &mut ws.hidden);
    widen(inputs.weight, &mut ws.weight);
    let (hidden, weight) = (&ws.hidden, &ws.weight);
    if ws.logits.len() != n * v {
        ws.logits = vec![0.0f32; n * v];
    }
    let logits = &mut ws.logits;
    matmul(
        logits,
        v,
        MatRef::row_major(hidden, n, h),
        MatRef::row_major(weight, v, h).t(),
        false,
    );
    if let Some(b) = inputs.bias {
        for row in logits.chunks_mut(v) {
            row.iter_mut().zip(b).for_each(|(z, c)| *z += c.to_f32());
        }
    }
    let layout = LogitsLayout::contiguous(batch.batch, batch.seq_len, v);
    let value =
        grpo_logits_unfused_into(loss, batch, logits, &layout, grad_output, &mut ws.unfused)?;
    let dlogits = &ws.unfused.dlogits;
    let dz = MatRef::row_major(dlogits, n, v);
    matmul(
        &mut grads.dhidden,
        h,
        dz,
        MatRef::row_major(weight, v, h),
        false,
    );
    matmul(
        &mut grads.dweight,
        h,
        dz.t(),
        MatRef::row_major(hidden, n, h),
        false,
    );
    if let Some(db) = grads.dbias.as_mut() {
        db.fill(0.0);
        for row in dlogits.chunks(v) {
            db.iter_mut().zip(row).for_each(|(d, x)| *d += x);
        }
    }
    Ok(value)
}
