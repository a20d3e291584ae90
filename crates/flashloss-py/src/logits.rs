//! The logits-level entry points of `flashloss._native`: TRL's GRPO loss on materialized
//! logits `[B, T', V]` (`T' ≥ T`, as Liger's `triton_grpo_loss` takes `[B, T+1, V]`),
//! reduced with its gradient formed in one call ([`grpo_logits`]), or per token, unreduced
//! ([`grpo_logits_per_token`]). CPU tensors.

use crate::args::{BatchArrays, BatchTensors, F32, FLOAT, TorchElement};
use crate::device::{cpu, run};
use crate::front::with_element;
use crate::losses::{grpo_result, write_f32, write_stats};
use crate::spec::Spec;
use crate::tensor::{Tensor, arg_error};
use flashloss::{GrpoLoss, GrpoLossConfig, LogitsLayout};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The logits-level GRPO loss on `logits` `[B, T', V]` (`T' ≥ T`; positions `t < T`
/// are read, as in Liger's `triton_grpo_loss` where `T' = T + 1`): forward and
/// backward at once, `∂L/∂logits` of the first T positions written into `dlogits`
/// (dense `[B, T, V]`, `logits`' dtype) or, when it is `None`, over `logits`.
#[pyfunction]
#[pyo3(signature = (logits, batch, dlogits, outs, spec))]
pub fn grpo_logits<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    batch: BatchArrays<'py>,
    dlogits: Option<&Bound<'py, PyAny>>,
    outs: (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
    spec: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let (loss, mut logits, tensors) = logits_args(logits, &batch, spec)?;
    let (out_logp, out_entropy, out_kl) = (&outs.0, &outs.1, &outs.2);
    let batch = tensors.batch()?;
    let layout = logits_layout(&logits, batch.batch, batch.seq_len)?;
    let (b, t, v) = (batch.batch, batch.seq_len, logits.shape[2]);
    let mut dlogits = Tensor::optional("dlogits", dlogits, FLOAT)?;
    if let Some(d) = &dlogits {
        d.expect_shape(&[b, t, v])?;
    }
    let device = cpu();
    // SAFETY: `logits` is the caller's to overwrite (in place) or only read; `dlogits`
    // is a fresh allocation.
    let fwd = with_element!(logits.dtype, E => unsafe {
        let z = E::slice_mut(&mut logits)?;
        match dlogits.as_mut().map(|d| E::slice_mut(d)).transpose()? {
            Some(d) => run(py, || device.grpo_logits(&loss, &batch, z, &layout, 1.0, d))?,
            None => run(py, || device.grpo_logits_in_place(&loss, &batch, z, &layout, 1.0))?,
        }
    });
    write_stats(
        &fwd.stats,
        &mut Tensor::new("out_logp", out_logp, F32)?,
        &mut Tensor::new("out_entropy", out_entropy, F32)?,
    )?;
    write_f32(&fwd.kl, &mut Tensor::new("out_kl", out_kl, F32)?)?;
    grpo_result(py, fwd.loss, &fwd.metrics, None)
}

/// A logits-level call's config (`spec`'s), logits `[B, T' ≥ T, V]` and per-token
/// inputs ([`BatchArrays`], without the policy and entropy masks), checked.
fn logits_args<'py>(
    logits: &Bound<'py, PyAny>,
    batch: &BatchArrays<'py>,
    spec: &str,
) -> PyResult<(GrpoLoss, Tensor<'py>, BatchTensors<'py>)> {
    let loss = GrpoLoss::new(Spec::parse(spec)?.config::<GrpoLossConfig>()?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    for (arg, t) in [("policy_mask", &batch.6), ("entropy_mask", &batch.7)] {
        if t.is_some() {
            return Err(arg_error(arg, "is not taken by the logits-level loss"));
        }
    }
    let logits = Tensor::new("logits", logits, FLOAT)?;
    Ok((loss, logits, BatchTensors::new(batch)?))
}

/// The layout of `logits` `[B, T' ≥ T, V]` whose first T positions are read.
fn logits_layout(logits: &Tensor, b: usize, t: usize) -> PyResult<LogitsLayout> {
    let s = &logits.shape;
    if s.len() != 3 || s[0] != b || s[1] < t {
        return Err(arg_error(
            "logits",
            format!("expected shape [B={b}, T' >= {t}, V], got {s:?}"),
        ));
    }
    Ok(LogitsLayout {
        row_stride: s[2],
        seq_stride: s[1] * s[2],
        ..LogitsLayout::contiguous(b, t, s[2])
    })
}

/// The per-token GRPO losses on `logits` `[B, T', V]` (Liger's `triton_grpo_loss(...,
/// reduce=False)`): `ℓ_tot,i = ℓ_i·ρ_i + β·kl_i`, 0 where masked, unreduced. Without
/// `grad_rows` the losses are written into `out_token_loss` `[B, T]` (and logp,
/// entropy, KL, the clip flags as 0/1 into `out_*`); with `grad_rows` `[B, T]` (their
/// upstream gradient), `∂(Σ_i g_i·ℓ_tot,i)/∂logits` of the first T positions is written
/// into `dlogits` (dense `[B, T, V]`, the logits' dtype). CPU tensors.
#[pyfunction]
#[pyo3(signature = (logits, batch, grad_rows, dlogits, outs, spec))]
pub fn grpo_logits_per_token<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    batch: BatchArrays<'py>,
    grad_rows: Option<&Bound<'py, PyAny>>,
    dlogits: Option<&Bound<'py, PyAny>>,
    outs: PerTokenOuts<'py>,
    spec: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let (loss, logits, tensors) = logits_args(logits, &batch, spec)?;
    let (out_token_loss, out_logp, out_entropy, out_kl, out_clip) =
        (&outs.0, &outs.1, &outs.2, &outs.3, &outs.4);
    let batch = tensors.batch()?;
    let (b, t) = (batch.batch, batch.seq_len);
    let layout = logits_layout(&logits, b, t)?;
    let grad_rows = Tensor::optional("grad_rows", grad_rows, F32)?;
    if let Some(g) = &grad_rows {
        g.expect_shape(&[b, t])?;
    }
    let ones = vec![1.0f32; b * t];
    let g = grad_rows.as_ref().map_or(Ok(&ones[..]), |g| g.f32s())?;
    let mut dlogits = Tensor::optional("dlogits", dlogits, FLOAT)?;
    if let Some(d) = &dlogits {
        d.expect_shape(&[b, t, logits.shape[2]])?;
    }
    let device = cpu();
    // SAFETY: `dlogits` is a fresh allocation from the Python side.
    let fwd = with_element!(logits.dtype, E => unsafe {
        let z = E::slice(&logits)?;
        let d = dlogits.as_mut().map(|d| E::slice_mut(d)).transpose()?;
        run(py, || device.grpo_logits_per_token(&loss, &batch, z, &layout, g, d))?
    });
    let token_loss: Vec<f32> = fwd.token_loss.iter().map(|&x| x as f32).collect();
    write_f32(
        &token_loss,
        &mut Tensor::new("out_token_loss", out_token_loss, F32)?,
    )?;
    let clip: Vec<f32> = fwd.clip.iter().map(|&c| (c != 0) as u8 as f32).collect();
    write_f32(&clip, &mut Tensor::new("out_clip", out_clip, F32)?)?;
    write_stats(
        &fwd.stats,
        &mut Tensor::new("out_logp", out_logp, F32)?,
        &mut Tensor::new("out_entropy", out_entropy, F32)?,
    )?;
    write_f32(&fwd.kl, &mut Tensor::new("out_kl", out_kl, F32)?)?;
    grpo_result(py, fwd.loss, &fwd.metrics, None)
}

/// Where [`grpo_logits_per_token`] writes: `(out_token_loss, out_logp, out_entropy,
/// out_kl, out_clip)`, `[B, T]` f32 each.
type PerTokenOuts<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
);
